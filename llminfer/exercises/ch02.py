"""Chapter 02's exercises: attention weights by hand, GQA's head repetition, the K/V bytes a token costs."""
from __future__ import annotations

import functools
import math

import torch

from . import as_numbers, as_whole, close, exercise, not_a, run_code

# The chapter's three tokens "I", "love", "AI": one key and one value each; 02.1 asks with another query
K = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
V = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0]])
QUERY = torch.tensor([0.0, 1.0])
REAL_MODEL = "smollm2-135m-instruct"


@functools.lru_cache(maxsize=1)
def real_config():
    """SmolLM2-135M-Instruct's config, read from its GGUF header (no weights loaded)."""
    from ..checkpoint import open_checkpoint
    return open_checkpoint(REAL_MODEL).config


@exercise("02.1", "attention weights of the query [0, 1] over the chapter's three keys")
def weights_of_another_query(answer):
    from ..attention import attention
    weights = as_numbers(answer, 3)
    if weights is None:
        return not_a("three weights, one per token (I, love, AI)", answer)
    want = attention(QUERY[None, :], K, V, causal=False, scale=1.0)[1][0].tolist()
    scores = (K @ QUERY).tolist()
    if all(close(w, s, abs_=1e-3) for w, s in zip(weights, scores)):
        return False, "these are the scores q·k; the weights are their softmax (Step 2)"
    scaled = torch.softmax(K @ QUERY / math.sqrt(2), 0).tolist()
    if all(close(w, s, rel=1e-3, abs_=1e-4) for w, s in zip(weights, scaled)):
        return False, "the exercise asks for scale 1, as Steps 1–3 use; you divided by √2 first"
    if not close(sum(weights), 1.0, abs_=1e-3):
        return False, f"weights sum to {sum(weights):.4f}: softmax divides each exp(score) by their sum (Step 2)"
    if not all(close(w, x, rel=1e-3, abs_=1e-4) for w, x in zip(weights, want)):
        return False, (f"weights {[round(w, 4) for w in weights]}: the scores are K @ q = {scores}, then "
                       "softmax (Steps 1 and 2)")
    return True, f"scores {scores} → weights 1/(1+2e), e/(1+2e), e/(1+2e) = {[round(w, 4) for w in want]}"


@exercise("02.2", "GQA's head repetition written out, equal to llminfer.attention.repeat_kv")
def head_repetition(answer):
    from ..attention import repeat_kv
    if not callable(answer):
        return not_a("a function repeat_kv(x, n_groups) over x of shape (B, n_kv_heads, T, head_dim)", answer)
    x = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0))   # (B, n_kv_heads, T, head_dim)
    for groups in (3, 1, 2):
        want = repeat_kv(x, groups)
        got, error = run_code(answer, x.clone(), groups)
        if error:
            return False, error
        if not isinstance(got, torch.Tensor):
            return not_a("a tensor", got)
        if got.shape != want.shape:
            return False, (f"with n_groups={groups} the shape is {tuple(got.shape)}, expected {tuple(want.shape)}: "
                           "(B, n_kv_heads × n_groups, T, head_dim)")
        if not torch.equal(got, want):
            if torch.equal(got, x.repeat(1, groups, 1, 1)):
                return False, ("the heads come out interleaved (0, 1, 2, 0, 1, 2): query heads 0, 1 and 2 must all "
                               "read K/V head 0, so each K/V head is repeated in place (0, 0, 0, 1, 1, 1, ...), "
                               "as 'Several heads' shows")
            return False, f"with n_groups={groups} the values differ from llminfer.attention.repeat_kv"
    return True, "equal to llminfer.attention.repeat_kv for 1, 2 and 3 query heads per K/V head"


@exercise("02.3", "K/V bytes per token of SmolLM2-135M-Instruct in bfloat16")
def kv_bytes_per_token(answer):
    from ..costs import kv_bytes_per_token
    cfg = real_config()
    nbytes = as_whole(answer)
    if nbytes is None:
        return not_a("a whole number of bytes", answer)
    want = kv_bytes_per_token(cfg, 2)
    hints = {
        want * cfg.n_heads // cfg.n_kv_heads: f"that counts {cfg.n_heads} heads: only the {cfg.n_kv_heads} K/V "
                                              "heads are stored (grouped-query attention)",
        want // 2: "K and V are both kept: two vectors per head",
        want * 2: "bfloat16 is 2 bytes a number, not 4",
        want // cfg.n_layers: f"that is one layer; the model has {cfg.n_layers}",
    }
    if nbytes != want:
        return False, hints.get(int(nbytes), f"{int(nbytes)} bytes: 2 (K and V) × layers × K/V heads × head_dim × "
                                             "2 bytes, from the model's config (the GQA table in 'Several heads')")
    return True, (f"2 × {cfg.n_layers} layers × {cfg.n_kv_heads} K/V heads × {cfg.head_dim} × 2 bytes = {want:,} "
                  f"bytes a token, {cfg.n_heads // cfg.n_kv_heads}× less than with a K/V head per query head")
