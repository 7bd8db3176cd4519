"""Chapter 07 in torch: the online softmax, the tiled loop and its counted traffic, split-K decoding."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import llminfer
from llminfer.attention import attention, backends, get_backend
from llminfer.flash import (combine_partials, flash_io_elements, merge_states, naive_attention,
                              online_softmax, online_softmax_steps, softmax_state, split_kv_attention,
                              standard_io_elements, tile_grid, tiled_attention)


def _qkv(batch, n_heads, n_kv_heads, t_q, t_k, head_dim, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, t_q, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(batch, n_kv_heads, t_k, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(batch, n_kv_heads, t_k, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, k, v


def _sdpa(q, k, v, causal):
    """The independent reference: torch's fused kernel, with the end-aligned causal mask spelled out."""
    mask = None
    if causal:
        t_q, t_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# --- the online softmax ---------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_online_softmax_matches_torch_softmax_on_large_and_negative_values(block_size):
    gen = torch.Generator().manual_seed(block_size)
    x = torch.cat([torch.randn(4, 100, generator=gen) * 30,                    # ordinary spread
                   torch.tensor([[1e4, -1e4, 88.0, 89.0] * 25]),                  # exp would overflow unshifted
                   torch.full((1, 100), -3e4),                                  # all very negative
                   torch.linspace(-500, 500, 100)[None]])                       # rising: the max moves every step
    x[0, 7] = float("-inf")                                                     # a masked score
    got = online_softmax(x, block_size=block_size)
    want = torch.softmax(x, dim=-1)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert got[0, 7] == 0


def test_online_softmax_of_an_all_masked_row_is_nan_like_torch():
    x = torch.full((3,), float("-inf"))
    assert torch.isnan(online_softmax(x)).all() and torch.isnan(torch.softmax(x, dim=-1)).all()


def test_online_softmax_steps_on_the_i_love_ai_scores():
    # chapter 02's scores q·k for "I", "love", "AI": 1, 1, 2
    steps = online_softmax_steps([1.0, 1.0, 2.0])
    assert [s.max for s in steps] == [1.0, 1.0, 2.0]
    # l after "I": e^0 = 1; after "love": 2; after "AI" the max moves to 2: 2·e^(1-2) + e^0
    assert [s.sum for s in steps] == pytest.approx([1.0, 2.0, 2 / math.e + 1], abs=1e-12)
    assert [s.rescale for s in steps] == pytest.approx([0.0, 1.0, 1 / math.e], abs=1e-12)
    final = steps[-1]
    weights = [math.exp(x - final.max) / final.sum for x in (1.0, 1.0, 2.0)]
    assert weights == pytest.approx(torch.softmax(torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64), 0).tolist())
    assert [round(w, 2) for w in weights] == [0.21, 0.21, 0.58]


def test_merge_states_is_the_state_of_the_concatenation():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 7, generator=gen) * 10, torch.randn(5, 4, generator=gen) * 10 + 20
    m, l = merge_states(*softmax_state(a), *softmax_state(b))
    m_all, l_all = softmax_state(torch.cat([a, b], dim=-1))
    torch.testing.assert_close(m, m_all)
    torch.testing.assert_close(l, l_all)
    # an empty (all-masked) state changes nothing
    empty = softmax_state(torch.full((5, 3), float("-inf")))
    m2, l2 = merge_states(*empty, m, l)
    torch.testing.assert_close(m2, m)
    torch.testing.assert_close(l2, l)


@pytest.mark.parametrize("bad, match", [(torch.tensor([1, 2, 3]), "floating-point"),
                                        (torch.zeros(3, 0), "at least one element")])
def test_online_softmax_refuses_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        online_softmax(bad)
    with pytest.raises(ValueError, match="block_size=0"):
        online_softmax(torch.zeros(3), block_size=0)


# --- the tiled loop ----------------------------------------------------------------------------------------

SHAPES = [  # batch, n_heads, n_kv_heads, t_q, t_k, head_dim, block_m, block_n
    (1, 2, 2, 33, 33, 16, 8, 8),       # lengths not multiples of the blocks
    (2, 4, 2, 20, 20, 8, 16, 4),       # GQA, unequal blocks
    (1, 3, 1, 1, 45, 16, 4, 8),        # one query against a cache (decode), multi-query
    (1, 2, 1, 7, 30, 8, 4, 16),        # a chunk of a prefill: queries at the end of the keys
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_tiled_attention_matches_sdpa(shape, causal):
    batch, n_heads, n_kv_heads, t_q, t_k, head_dim, block_m, block_n = shape
    q, k, v = _qkv(batch, n_heads, n_kv_heads, t_q, t_k, head_dim, seed=t_q + t_k)
    result = tiled_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    want = _sdpa(q, k, v, causal)
    assert (result.out - want).abs().max().item() <= 1e-5
    # the log-sum-exp, against logsumexp of the explicit scores
    _, weights = attention(q, k, v, causal=causal)
    scores = (q @ llminfer.attention.repeat_kv(k, n_heads // n_kv_heads).transpose(-2, -1)) / math.sqrt(head_dim)
    if causal:
        scores = scores.masked_fill(~llminfer.attention.causal_mask(t_q, t_k), float("-inf"))
    torch.testing.assert_close(result.lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=0)


def test_tiled_traffic_is_what_the_loop_loads():
    # 64 queries and keys, d = 16, float32, 16 × 16 tiles, causal: 4 query blocks; block i computes i + 1 tiles
    q, k, v = _qkv(1, 1, 1, 64, 64, 16)
    traffic = tiled_attention(q, k, v, causal=True, block_m=16, block_n=16).traffic
    tile_bytes = 16 * 16 * 4
    assert traffic.tiles_computed == 1 + 2 + 3 + 4 and traffic.tiles_skipped == 3 + 2 + 1
    assert traffic.read == {"Q": 4 * tile_bytes, "K": 10 * tile_bytes, "V": 10 * tile_bytes}
    assert traffic.written == {"O": 4 * tile_bytes, "LSE": 64 * 4}
    full = tiled_attention(q, k, v, causal=False, block_m=16, block_n=16).traffic
    assert full.tiles_computed == 16 and full.tiles_skipped == 0
    assert full.read["K"] == full.read["V"] == 16 * tile_bytes      # K and V read once per query block
    # GQA: each query head reads its K/V head's tiles, so the reads count per query head
    q2, k2, v2 = _qkv(1, 4, 1, 64, 64, 16)
    gqa = tiled_attention(q2, k2, v2, causal=False, block_m=16, block_n=16).traffic
    assert gqa.read["K"] == 4 * full.read["K"] and gqa.tiles_computed == 4 * full.tiles_computed


def test_naive_traffic_counts_the_score_matrix_both_ways():
    q, k, v = _qkv(1, 2, 2, 10, 24, 8, dtype=torch.float64)
    out, traffic = naive_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, _sdpa(q, k, v, True))
    n = 2 * 10 * 24 * 8      # bytes of one (B, H, T_q, T_k) float64 matrix
    assert traffic.written == {"S": n, "P": n, "O": 2 * 10 * 8 * 8}
    assert traffic.read == {"Q": 2 * 10 * 8 * 8, "K": 2 * 24 * 8 * 8, "S": n, "P": n, "V": 2 * 24 * 8 * 8}


def test_counts_on_the_meta_device_equal_the_real_ones():
    q, k, v = _qkv(1, 2, 1, 20, 20, 16)
    real = tiled_attention(q, k, v, causal=True, block_m=16, block_n=8).traffic
    meta = tiled_attention(*(t.to("meta") for t in (q, k, v)), causal=True, block_m=16, block_n=8).traffic
    assert meta == real
    assert naive_attention(*(t.to("meta") for t in (q, k, v)))[1] == naive_attention(q, k, v)[1]


def test_traffic_falls_with_the_block_size_as_the_bound_says():
    # K/V are read once per query block, so traffic ~ N²d/B
    n, d = 128, 16
    q, k, v = _qkv(1, 1, 1, n, n, d)
    totals = {b: tiled_attention(q, k, v, causal=False, block_m=b, block_n=b).traffic.total_bytes
              for b in (16, 32, 64)}
    assert totals[16] > totals[32] > totals[64]
    naive = naive_attention(q, k, v, causal=False)[1].total_bytes
    assert naive > totals[16]
    for b, total in totals.items():   # exact: Q, O once; K, V once per query block; LSE
        assert total == 4 * (2 * n * d + 2 * (n // b) * n * d + n)
    sram = 4 * 64 * d   # Q, K, V and O tiles of 64 rows
    assert flash_io_elements(n, d, sram) == n * n * d * d / sram
    assert standard_io_elements(n, d) == n * d + n * n


def test_tile_grid_marks_the_diagonal_and_the_skipped_tiles():
    grid = tile_grid(8, 8, 4, 4, causal=True)
    assert grid == [["diagonal", "skipped"], ["full", "diagonal"]]
    assert tile_grid(2, 8, 4, 4, causal=True) == [["full", "diagonal"]]   # two queries at the end of 8 keys
    assert tile_grid(8, 8, 4, 4, causal=False) == [["full", "full"], ["full", "full"]]
    q, k, v = _qkv(1, 1, 1, 37, 53, 8)
    traffic = tiled_attention(q, k, v, causal=True, block_m=8, block_n=16).traffic
    cells = [c for row in tile_grid(37, 53, 8, 16) for c in row]
    assert traffic.tiles_skipped == cells.count("skipped") > 0
    assert traffic.tiles_computed == len(cells) - cells.count("skipped")


def test_on_tile_reports_the_running_state():
    q, k, v = _qkv(1, 1, 1, 8, 8, 4)
    steps = []
    result = tiled_attention(q, k, v, causal=False, block_m=8, block_n=4, on_tile=steps.append)
    assert [(s.q_block, s.k_block) for s in steps] == [(0, 0), (0, 1)]
    s = (q @ k.transpose(-2, -1)) / 2                           # scale 1/√4
    torch.testing.assert_close(steps[0].row_max, s[..., :4].amax(-1))
    torch.testing.assert_close(steps[0].row_sum, torch.exp(s[..., :4] - s[..., :4].amax(-1, keepdim=True)).sum(-1))
    torch.testing.assert_close(steps[0].output, torch.softmax(s[..., :4], -1) @ v[:, :, :4])  # attention to 4 keys
    torch.testing.assert_close(steps[-1].output, result.out)
    assert steps[0].traffic.read_bytes < steps[1].traffic.read_bytes == result.traffic.read_bytes


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_m=0), "block_m=0"),
    (dict(block_n=2.5), "block_n=2.5"),
])
def test_tiled_attention_refuses_bad_blocks(kwargs, match):
    q, k, v = _qkv(1, 1, 1, 4, 4, 4)
    with pytest.raises(ValueError, match=match):
        tiled_attention(q, k, v, **kwargs)


def test_tiled_attention_refuses_bad_shapes():
    q, k, v = _qkv(1, 3, 2, 4, 4, 4)
    with pytest.raises(ValueError, match="3 query heads cannot share 2"):
        tiled_attention(q, k, v)
    q, k, v = _qkv(1, 2, 2, 9, 4, 4)
    with pytest.raises(ValueError, match="9 queries but only 4 keys"):
        tiled_attention(q, k, v)


# --- split-K (flash-decoding) ----------------------------------------------------------------------------

@pytest.mark.parametrize("num_splits", [1, 2, 5, 7])
@pytest.mark.parametrize("t_q", [1, 3])
def test_split_kv_attention_is_exact(num_splits, t_q):
    q, k, v = _qkv(2, 4, 2, t_q, 50, 16, seed=num_splits)
    out, lse = split_kv_attention(q, k, v, num_splits=num_splits, causal=True)
    assert (out - _sdpa(q, k, v, True)).abs().max().item() <= 1e-5
    torch.testing.assert_close(lse, tiled_attention(q, k, v, causal=True, block_m=4, block_n=8).lse,
                               atol=1e-5, rtol=0)


def test_combine_partials_gives_no_weight_to_a_slice_a_row_cannot_see():
    outs = torch.stack([torch.full((2, 3), 5.0), torch.zeros(2, 3)])            # (S=2, rows, D)
    lses = torch.tensor([[0.3, 0.7], [float("-inf"), float("-inf")]])           # slice 1 saw nothing
    out, lse = combine_partials(outs, lses)
    torch.testing.assert_close(out, torch.full((2, 3), 5.0))
    torch.testing.assert_close(lse, torch.tensor([0.3, 0.7]))
    with pytest.raises(ValueError, match="combine_partials needs"):
        combine_partials(outs, lses[0])


def test_split_kv_attention_refuses_more_splits_than_keys():
    q, k, v = _qkv(1, 1, 1, 1, 5, 4)
    with pytest.raises(ValueError, match="num_splits=6"):
        split_kv_attention(q, k, v, num_splits=6)


def test_importing_the_package_registers_the_flash_backend():
    from llminfer.flash import flash_backend

    assert "flash" in backends()
    assert get_backend("flash") is flash_backend
