"""Chapter 07's Triton kernel: under Triton's interpreter on CPU tensors, compiled on CUDA.

Triton fixes interpreter or compiler when it is first imported; tests/conftest.py sets
TRITON_INTERPRET=1 on a machine without CUDA before anything imports it. With CUDA the same
tests run the compiled kernel on the GPU, and the `gpu` tests add larger and half-precision shapes.
The interpreter runs every program in Python: shapes here stay small.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import llminfer
from llminfer.flash import (flash_attention, flash_decode, flash_tile_counts, split_kv_attention, tile_grid,
                              tiled_attention)
from llminfer.flash import triton_flash

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _qkv(batch, n_heads, n_kv_heads, t_q, t_k, head_dim, seed=0, dtype=torch.float32, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, t_q, head_dim, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(batch, n_kv_heads, t_k, head_dim, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(batch, n_kv_heads, t_k, head_dim, generator=gen).to(device=device, dtype=dtype)
    return q, k, v


def _reference(q, k, v, causal=True, mask=None):
    """(out, lse) in float64, written out independently of the package: scores, mask, logsumexp, softmax."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])        # (B, H, T_q, T_k)
    t_q, t_k = scores.shape[-2:]
    if mask is None and causal:
        mask = torch.ones(t_q, t_k, dtype=torch.bool).tril(diagonal=t_k - t_q)
    if mask is not None:
        scores = scores.masked_fill(~mask.cpu(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


SHAPES = [  # batch, n_heads, n_kv_heads, t_q, t_k, head_dim, block_m, block_n
    pytest.param(1, 2, 2, 50, 50, 64, 16, 32, id="d64-ragged"),          # 50 is no multiple of 16 or 32
    pytest.param(1, 1, 1, 40, 40, 128, 32, 16, id="d128"),
    pytest.param(1, 4, 2, 33, 33, 80, 16, 16, id="d80-padded-gqa"),      # head 80 padded to 128 lanes
    pytest.param(2, 4, 1, 1, 70, 64, 16, 32, id="decode-mqa"),           # one query against a cache
    pytest.param(1, 2, 2, 9, 41, 64, 16, 16, id="chunk"),                # 9 queries at the end of 41 keys
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("batch, n_heads, n_kv_heads, t_q, t_k, head_dim, block_m, block_n", SHAPES)
def test_flash_attention_matches_sdpa_and_the_log_sum_exp(batch, n_heads, n_kv_heads, t_q, t_k, head_dim,
                                                          block_m, block_n, causal):
    q, k, v = _qkv(batch, n_heads, n_kv_heads, t_q, t_k, head_dim, seed=t_q * 100 + head_dim)
    out, lse = flash_attention(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    mask = None
    if causal:
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_heads != n_kv_heads)
    assert (out - sdpa).abs().max().item() <= 1e-5
    want_out, want_lse = _reference(q, k, v, causal)
    assert (out.double().cpu() - want_out).abs().max().item() <= 1e-5
    assert (lse.double().cpu() - want_lse).abs().max().item() <= 1e-5


def test_default_blocks_and_a_non_contiguous_cache_view():
    # K/V as views into a longer buffer, the way KVCache.get hands them out
    q, k_buf, v_buf = _qkv(1, 2, 2, 5, 64, 32)
    k, v = k_buf[:, :, :37], v_buf[:, :, :37]
    assert not k.is_contiguous()
    out, lse = flash_attention(q, k, v, causal=True)
    want_out, want_lse = _reference(q, k, v, causal=True)
    assert (out.double().cpu() - want_out).abs().max().item() <= 1e-5
    assert (lse.double().cpu() - want_lse).abs().max().item() <= 1e-5


def test_a_boolean_mask_replaces_the_causal_rule():
    q, k, v = _qkv(2, 2, 1, 6, 20, 32, seed=5)
    gen = torch.Generator().manual_seed(9)
    mask = (torch.rand(2, 1, 6, 20, generator=gen) > 0.4).to(DEVICE)     # broadcast over heads
    mask[1, 0, 2] = False                                                # a query that may see nothing
    out, lse = flash_attention(q, k, v, causal=True, mask=mask, block_m=16, block_n=16)
    want_out, want_lse = _reference(q, k, v, mask=mask)
    seen = mask.any(-1).expand(2, 2, 6).cpu()
    assert (out.double().cpu() - want_out)[seen].abs().max().item() <= 1e-5
    assert (lse.double().cpu() - want_lse)[seen].abs().max().item() <= 1e-5
    assert (out[1, :, 2] == 0).all() and torch.isneginf(lse[1, :, 2]).all()   # zeros, not NaN


def test_the_kernel_skips_the_tiles_above_the_diagonal():
    q, k, v = _qkv(1, 2, 1, 50, 50, 32)
    counts = flash_tile_counts(q, k, v, causal=True, block_m=16, block_n=16)   # (B·H, query blocks)
    grid = tile_grid(50, 50, 16, 16, causal=True)
    per_block = [len(row) - row.count("skipped") for row in grid]
    assert counts.tolist() == [per_block, per_block] == [[1, 2, 3, 4]] * 2
    traffic = tiled_attention(q, k, v, causal=True, block_m=16, block_n=16).traffic
    assert int(counts.sum()) == traffic.tiles_computed == 2 * 10        # both count per (batch, head)
    assert traffic.tiles_skipped == 2 * 6
    full = flash_tile_counts(q, k, v, causal=False, block_m=16, block_n=16)
    assert (full == 4).all()


@pytest.mark.parametrize("t_q, num_splits", [(1, 3), (4, 2)])
def test_split_k_decoding_is_exact(t_q, num_splits):
    q, k, v = _qkv(1, 4, 2, t_q, 100, 64, seed=num_splits)
    out, lse = flash_decode(q, k, v, num_splits=num_splits, block_n=16)
    want_out, want_lse = _reference(q, k, v, causal=True)
    assert (out.double().cpu() - want_out).abs().max().item() <= 1e-5
    assert (lse.double().cpu() - want_lse).abs().max().item() <= 1e-5
    torch_out, _ = split_kv_attention(q, k, v, num_splits=num_splits)
    assert (out - torch_out).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_as_close_as_sdpa(dtype):
    q, k, v = _qkv(1, 2, 2, 24, 40, 64, seed=3, dtype=dtype)
    want, _ = _reference(q, k, v)
    out, _ = flash_attention(q, k, v, causal=True, block_m=16, block_n=16)
    mask = torch.ones(24, 40, dtype=torch.bool, device=q.device).tril(diagonal=16)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    error = (out.double().cpu() - want).abs().max().item()
    sdpa_error = (sdpa.double().cpu() - want).abs().max().item()
    assert out.dtype == dtype
    assert error <= 2 * sdpa_error + 1e-3, (error, sdpa_error)


@pytest.mark.parametrize("change, match", [
    (dict(block_m=24), "block_m=24 must be a power of two"),
    (dict(block_n=8), "block_n=8 must be a power of two from 16"),
    (dict(head_dim=300), "head_dim=300 is outside"),
    (dict(dtype=torch.float64), "float32, float16 or bfloat16"),
    (dict(t_q=9, t_k=4), "9 queries against 4 keys"),
    (dict(n_heads=3), "3 query heads cannot share 2"),
    (dict(mask=torch.ones(3, 7, dtype=torch.bool)), r"mask of shape \(3, 7\) does not broadcast"),
    (dict(mask=torch.ones(4, 4)), "mask must be a boolean tensor"),
])
def test_bad_input_is_refused_before_any_work(change, match, monkeypatch):
    def no_kernel():
        raise AssertionError("the kernel was loaded before the input was checked")

    monkeypatch.setattr(triton_flash, "_load_kernel", no_kernel)
    shape = dict(n_heads=2, t_q=4, t_k=4, head_dim=16, dtype=torch.float32)
    shape.update({key: value for key, value in change.items() if key in shape})
    q, k, v = _qkv(1, shape["n_heads"], 2, shape["t_q"], shape["t_k"], shape["head_dim"], dtype=shape["dtype"])
    kwargs = {key: value for key, value in change.items() if key in ("block_m", "block_n", "mask")}
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, **kwargs)


def test_flash_decode_refuses_more_splits_than_keys():
    q, k, v = _qkv(1, 2, 2, 1, 10, 16)
    with pytest.raises(ValueError, match="num_splits=11"):
        flash_decode(q, k, v, num_splits=11)


def test_bundled_model_generates_the_same_greedy_tokens_with_flash(monkeypatch):
    model, tokenizer = llminfer.load_pretrained("tiny-capitals", device=DEVICE)
    launches = []
    real_launch = triton_flash._launch
    monkeypatch.setattr(triton_flash, "_launch", lambda *a, **kw: launches.append(a[0].shape) or real_launch(*a, **kw))
    ids = tokenizer.encode("The capital of France")
    tokens = {}
    for backend in ("sdpa", "flash"):
        model.set_attention_backend(backend)
        tokens[backend] = llminfer.generate(model, ids, max_new_tokens=6, eos_token_id=tokenizer.eos_token_id).token_ids
    assert tokens["flash"] == tokens["sdpa"]
    assert tokenizer.decode(tokens["flash"]) == " is Paris."
    # every layer of the prefill and of each decode step ran the kernel: prompt-length queries, then one
    n_layers = model.config.n_layers
    assert len(launches) == n_layers * len(tokens["flash"])
    assert launches[0][2] == len(ids) and launches[-1][2] == 1
    # a teacher-forced batch of two prompts: the same logits to float32 rounding
    rows = [tokenizer.encode("The capital of Japan is Tokyo."), tokenizer.encode("Rome is the capital of")]
    width = max(map(len, rows))
    batch = torch.tensor([row + [0] * (width - len(row)) for row in rows], device=DEVICE)   # right-padded
    logits = {}
    for backend in ("sdpa", "flash"):
        model.set_attention_backend(backend)
        with torch.no_grad():
            logits[backend] = model(batch)
    assert (logits["flash"] - logits["sdpa"]).abs().max().item() <= 1e-4
    assert torch.equal(logits["flash"].argmax(-1), logits["sdpa"].argmax(-1))


_IMPORT_CHECK = """
import sys, torch
import llminfer.flash as kernels
assert "triton" not in sys.modules, "importing llminfer.flash imported triton"
q = torch.randn(1, 1, 3, 16)
out, _ = kernels.flash_attention(q, q, q)
assert kernels.interpreted()
print("ok", float((out - torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)).abs().max()))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen automatically only without CUDA")
def test_without_cuda_the_first_call_chooses_the_interpreter():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_IMPORT_CHECK)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok") and float(done.stdout.split()[1]) <= 1e-6


def test_a_compiled_kernel_refuses_cpu_tensors_with_the_fix(monkeypatch):
    class JITFunction:   # what triton.jit returns when triton was imported without TRITON_INTERPRET
        pass

    monkeypatch.setattr(triton_flash, "_load_kernel", JITFunction)
    q = torch.randn(1, 1, 3, 16)
    with pytest.raises(RuntimeError, match=r"os.environ\['TRITON_INTERPRET'\] = '1' before anything imports"):
        flash_attention(q, q, q)


# --- on a GPU: the compiled kernel --------------------------------------------------------------------------

@pytest.mark.gpu
@cuda
def test_cuda_runs_the_compiled_kernel():
    assert not triton_flash.interpreted(), "TRITON_INTERPRET is set: the GPU tests would run the interpreter"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_cuda_long_sequences_against_sdpa(dtype, head_dim):
    q, k, v = _qkv(2, 8, 2, 1000, 1000, head_dim, dtype=dtype)
    out, lse = flash_attention(q, k, v, causal=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    error = (out.float() - want).abs().max().item()
    if dtype == torch.float32:
        assert error <= 1e-5
    else:
        assert error <= 2 * (sdpa.float() - want).abs().max().item() + 1e-3


@pytest.mark.gpu
@cuda
def test_cuda_split_k_decode_over_a_long_cache():
    q, k, v = _qkv(4, 32, 8, 1, 16384, 128, dtype=torch.float16)
    out, _ = flash_decode(q, k, v, num_splits=16)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    assert (out.float() - want).abs().max().item() <= 2e-3
