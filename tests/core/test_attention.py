"""Attention: the article's worked example, and the explicit path against the fused kernel."""
from __future__ import annotations

import math

import pytest
import torch

import llminfer

from llminfer.attention import attention, causal_mask, fast_attention, softmax

# The article's "I love AI" example: one query, three keys, three values, two dimensions.
KEYS = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])    # I, love, AI
VALUES = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]])
QUERY = torch.tensor([[1.0, 1.0]])                           # the query of "AI"


def test_article_example_unscaled():
    out, weights = attention(QUERY, KEYS, VALUES, scale=1.0)
    scores = QUERY @ KEYS.T
    assert scores.tolist() == [[1.0, 1.0, 2.0]]
    # softmax of (1, 1, 2) by hand: e/(2e + e²) and e²/(2e + e²)
    e = math.e
    exact = [e / (2 * e + e**2), e / (2 * e + e**2), e**2 / (2 * e + e**2)]
    assert weights[0].tolist() == pytest.approx(exact, abs=1e-7)
    assert [round(w, 2) for w in weights[0].tolist()] == [0.21, 0.21, 0.58]
    # the exact mix is 0.2119·[1,0] + 0.2119·[0,2] + 0.5761·[3,1] = [1.940, 1.000]
    assert out[0].tolist() == pytest.approx([exact[0] + 3 * exact[2], 2 * exact[1] + exact[2]], abs=1e-6)
    assert [round(x, 2) for x in out[0].tolist()] == [1.94, 1.00]
    # the article's 1.95 comes from mixing with the *rounded* weights: 0.21 + 3 × 0.58 = 1.95
    rounded = torch.tensor([[0.21, 0.21, 0.58]])
    article = rounded @ VALUES
    assert [round(x, 2) for x in article[0].tolist()] == [1.95, 1.00]
    print(f"exact output {out[0].tolist()} vs rounded-weight mix {article[0].tolist()}")


def test_article_example_with_standard_scale():
    _, weights = attention(QUERY, KEYS, VALUES)           # scale 1/√2
    assert [round(w, 2) for w in weights[0].tolist()] == [0.25, 0.25, 0.50]
    expected = torch.softmax(torch.tensor([1.0, 1.0, 2.0]) / math.sqrt(2), dim=0)
    torch.testing.assert_close(weights[0], expected)


def test_softmax_is_stable_for_large_scores():
    scores = torch.tensor([1000.0, 1000.0, 1001.0])
    assert torch.isfinite(softmax(scores)).all()
    torch.testing.assert_close(softmax(scores), torch.softmax(scores, dim=0))


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("t_q,t_k", [(9, 9), (1, 9), (3, 11)])
def test_explicit_and_fused_agree(n_heads, n_kv_heads, causal, t_q, t_k):
    gen = torch.Generator().manual_seed(n_heads * 100 + t_q * 10 + t_k)
    q = torch.randn(2, n_heads, t_q, 16, generator=gen)
    k = torch.randn(2, n_kv_heads, t_k, 16, generator=gen)
    v = torch.randn(2, n_kv_heads, t_k, 16, generator=gen)
    out, weights = attention(q, k, v, causal=causal)
    fused = fast_attention(q, k, v, causal=causal)
    assert (out - fused).abs().max() <= 1e-6
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, n_heads, t_q))
    if causal:  # no weight on a future key
        future = ~causal_mask(t_q, t_k)
        assert weights.masked_select(future).abs().sum() == 0


def test_causal_mask_aligns_queries_with_the_last_keys():
    assert causal_mask(3, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert causal_mask(1, 4).tolist() == [[True, True, True, True]]
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="head_dim"):
        attention(torch.zeros(1, 3), torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        attention(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(ValueError, match="same number of tokens"):
        attention(torch.zeros(1, 4), torch.zeros(2, 4), torch.zeros(3, 4))


def test_backends_by_name_give_the_same_model_logits():
    from small_models import SMALL_CONFIGS, random_model
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    ids = torch.randint(0, 101, (2, 33), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fused = model(ids)
        model.set_attention_backend("explicit")
        explicit = model(ids)
        cache = model.new_cache(2, max_seq_len=40)
        model(ids[:, :30], cache=cache)
        stepped = model(ids[:, 30:], cache=cache)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stepped, fused[:, 30:], rtol=1e-5, atol=1e-5)
    assert {"explicit", "sdpa"} <= set(llminfer.attention.backends())


def test_a_backend_chosen_by_config_and_unknown_names_refused():
    from small_models import SMALL_CONFIGS
    config = SMALL_CONFIGS["llama-mha-untied"].replace(attn_backend="explicit")
    assert llminfer.Transformer(config).attn_backend == "explicit"
    with pytest.raises(ValueError, match="unknown attention backend 'flash-nope'.*registered: explicit"):
        llminfer.Transformer(SMALL_CONFIGS["llama-mha-untied"], attn_backend="flash-nope")
    with pytest.raises(ValueError, match="already registered"):
        llminfer.attention.register_backend("sdpa", lambda *a, **k: None)


def test_a_mask_replaces_the_causal_rule_in_both_backends():
    q, k, v = (torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    k, v = torch.cat([k, torch.full_like(k, 1e3)], 2), torch.cat([v, torch.full_like(v, 1e3)], 2)   # 3 stale slots
    mask = torch.arange(6)[None, :] <= torch.tensor([0, 1, 2])[:, None]                             # (3, 6)
    expected = llminfer.attention.attention(q, k[:, :, :3], v[:, :, :3], causal=True)[0]
    for name in ("explicit", "sdpa"):
        got = llminfer.attention.get_backend(name)(q, k, v, causal=False, mask=mask)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- masked grouped-query attention, the query groups folded into the query axis (fused on CUDA) -------------

def _repeated_reference(q, k, v, mask, scale=None):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("mask_kind", ["decode", "static", "per_head", "two_dims", "additive"])
@pytest.mark.parametrize("n_heads, n_kv_heads", [(8, 2), (4, 1), (6, 3)])
def test_folded_query_groups_equal_repeated_kv(mask_kind, n_heads, n_kv_heads):
    from llminfer.attention import grouped_query_sdpa

    torch.manual_seed(0)
    batch, t_q, t_k, head_dim = 3, (1 if mask_kind == "decode" else 5), 11, 16
    q = torch.randn(batch, n_heads, t_q, head_dim)
    k, v = torch.randn(2, batch, n_kv_heads, t_k, head_dim)
    lengths = torch.tensor([4, 11, 7])
    if mask_kind == "decode":        # the paged engine's gather: (S, 1, 1, L), each sequence its own length
        mask = (torch.arange(t_k)[None, :] < lengths[:, None])[:, None, None, :]
    elif mask_kind == "static":      # a static cache's written positions, the causal rule inside them
        mask = causal_mask(t_q, t_k)[None, None]
    elif mask_kind == "per_head":    # a different mask for every query head
        mask = torch.rand(batch, n_heads, t_q, t_k) > 0.3
        mask[..., 0] = True          # every row sees a key
    elif mask_kind == "two_dims":
        mask = causal_mask(t_q, t_k)
    else:                            # a float mask added to the scores
        mask = torch.randn(1, 1, t_q, t_k)
    want = _repeated_reference(q, k, v, mask, scale=0.3)
    got = grouped_query_sdpa(q, k, v, mask, scale=0.3)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if mask_kind == "per_head":      # the fold keeps each head's own mask: mixing two heads' masks is caught
        swapped = mask.clone()
        swapped[:, [0, 1]] = mask[:, [1, 0]]
        assert not torch.allclose(grouped_query_sdpa(q, k, v, swapped, scale=0.3), want, atol=1e-4)


@pytest.mark.gpu
def test_masked_gqa_on_cuda_folds_the_groups_and_matches_repeated_kv():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn(2, 2, 2, 40, 64, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(40, device="cuda")[None, :] < torch.tensor([[17], [40]], device="cuda"))[:, None, None, :]
    want = _repeated_reference(q.float(), k.float(), v.float(), mask)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        got = fast_attention(q, k, v, mask=mask)           # refused if it needed the math kernel
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
