"""FLOP and byte counts of a forward pass, from a ModelConfig alone. Chapter 04.

These are the numbers that a speed is compared with: a prefill is judged by
the floating-point operations it has to do (compute-bound), a decode step by
the bytes it has to read (memory-bound). Nothing here touches a tensor.

    matmul_params(cfg)                       weights that multiply every token
    forward_flops(cfg, n_tokens, start_pos)  FLOPs of one forward over n_tokens new positions
    prefill_flops(cfg, prompt_len)           FLOPs of the prefill (logits of the last position only)
    decode_step_flops(cfg, cached_len=n)     FLOPs of one decode step after n cached positions
    weight_bytes(cfg, dtype_bytes)           every weight the model holds (its one byte count)
    weight_bytes_read(cfg, dtype_bytes)      the weights a forward reads (an untied embedding is gathered)
    decode_step_bytes(cfg, cached_len=n, dtype_bytes=b)  bytes it reads: weights + K/V of n + 1 positions
    kv_cache_bytes(cfg, seq_len, dtype_bytes, batch_size)  the K/V a cache of seq_len positions holds (every
                                             cache's size: contiguous, paged, int8, shipped between workers)
    activation_bytes(cfg, n_tokens, dtype_bytes)  peak activations of one forward
    generation_bytes(cfg, batch, prompt_len, new_tokens, dtype_bytes)  KV cache + activations of a generation
    decode_bytes(cfg, prompt_len, new_tokens) bytes read by a whole cached decode
    cache_vs_recompute_flops(cfg, prompt_len, new_tokens)  the chapter 04 prediction
    roofline_seconds(flops, nbytes, flops_per_s, bytes_per_s)  the slower of the two limits

Conventions: one multiply-add is 2 FLOPs; attention is causal, so a query at
absolute position p scores p + 1 keys; element-wise work (norms, RoPE,
softmax, SwiGLU gate) is left out, being a few FLOPs per activation against
thousands per weight. `cfg` is any object with the ModelConfig fields
vocab_size, dim, n_layers, n_heads, n_kv_heads, hidden_dim and head_dim
(for K/V bytes, n_layers, n_kv_heads and head_dim are enough: a `KVShape`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "head_dim_of", "layer_matmul_params", "matmul_params", "weight_bytes", "weight_bytes_read", "KVShape",
    "attention_flops", "forward_flops", "prefill_flops", "decode_step_flops",
    "kv_bytes_per_token", "kv_cache_bytes", "activation_bytes", "generation_bytes", "decode_step_bytes", "decode_bytes",
    "CacheVsRecompute", "cache_vs_recompute_flops", "roofline_seconds",
]


def head_dim_of(cfg) -> int:
    """Returns the per-head width: cfg.head_dim, or dim // n_heads when unset. Chapter 04."""
    head_dim = getattr(cfg, "head_dim", None)
    return int(head_dim) if head_dim else cfg.dim // cfg.n_heads


def layer_matmul_params(cfg) -> int:
    """Returns the weights one decoder layer multiplies each token by (q, k, v, o, MLP). Chapter 04."""
    head_dim = head_dim_of(cfg)
    q_out = cfg.n_heads * head_dim
    kv_out = cfg.n_kv_heads * head_dim
    attention = cfg.dim * q_out + 2 * cfg.dim * kv_out + q_out * cfg.dim   # wq, wk, wv, wo
    mlp = 3 * cfg.dim * cfg.hidden_dim                                     # gate, up, down
    return attention + mlp


def matmul_params(cfg, with_head: bool = True) -> int:
    """Returns the weights every token meets in a matmul: all layers, plus the output head. Chapter 04."""
    head = cfg.vocab_size * cfg.dim if with_head else 0
    return cfg.n_layers * layer_matmul_params(cfg) + head


def weight_bytes(cfg, dtype_bytes: int) -> int:
    """Returns the bytes of every weight the model holds: layers, norms, embedding and head (a tied table
    counted once). The one byte count of a model, in every chapter. Chapter 04."""
    head_dim = head_dim_of(cfg)
    bias = (cfg.n_heads + 2 * cfg.n_kv_heads) * head_dim if getattr(cfg, "qkv_bias", False) else 0
    norms = cfg.n_layers * 2 * cfg.dim + cfg.dim
    embedding = 0 if getattr(cfg, "tie_embeddings", False) else cfg.vocab_size * cfg.dim
    params = matmul_params(cfg) + cfg.n_layers * bias + norms + embedding
    return params * dtype_bytes


def weight_bytes_read(cfg, dtype_bytes: int) -> int:
    """Returns the bytes of weights a forward (a decode step) reads: `weight_bytes` less an untied embedding
    table. Chapter 04.

    A forward reads every layer weight, the norms and the output head once; an untied embedding table is only
    gathered (one row per token), so it is not read in full. A tied table *is* the head and is read.
    """
    gathered = 0 if getattr(cfg, "tie_embeddings", False) else cfg.vocab_size * cfg.dim * dtype_bytes
    return weight_bytes(cfg, dtype_bytes) - gathered


def attention_flops(cfg, n_tokens: int, start_pos: int = 0) -> int:
    """Returns the FLOPs of q·k scores and the weighted sum of v for n_tokens new causal queries. Chapter 04."""
    # queries at positions start_pos .. start_pos + n_tokens - 1 each see (position + 1) keys
    keys_seen = n_tokens * start_pos + n_tokens * (n_tokens + 1) // 2
    per_key = 2 * 2 * cfg.n_heads * head_dim_of(cfg)         # scores and mix, multiply-add = 2
    return cfg.n_layers * per_key * keys_seen


def forward_flops(cfg, n_tokens: int, start_pos: int = 0, logits_positions: int | None = None,
                  batch_size: int = 1) -> int:
    """Returns the FLOPs of one forward over n_tokens new positions after start_pos cached ones. Chapter 04.

    logits_positions: how many positions go through the output head (default all n_tokens).
    """
    if n_tokens < 0 or start_pos < 0 or batch_size < 1:
        raise ValueError(f"n_tokens={n_tokens}, start_pos={start_pos}, batch_size={batch_size}: "
                         "counts must be >= 0 and batch_size >= 1")
    logits_positions = n_tokens if logits_positions is None else logits_positions
    layers = 2 * cfg.n_layers * layer_matmul_params(cfg) * n_tokens
    head = 2 * cfg.vocab_size * cfg.dim * logits_positions
    return batch_size * (layers + head + attention_flops(cfg, n_tokens, start_pos))


def prefill_flops(cfg, prompt_len: int, batch_size: int = 1) -> int:
    """Returns the FLOPs of a prefill: all prompt positions, the head on the last one only. Chapter 04."""
    return forward_flops(cfg, prompt_len, 0, logits_positions=1, batch_size=batch_size)


def _cached_len(cached_len, context_len, offset: int, fn: str) -> int:
    """Resolves the deprecated context_len argument to cached_len (positions already in the cache)."""
    if context_len is not None:
        warnings.warn(f"{fn}(context_len=...) is deprecated; pass cached_len (the positions already cached, "
                      "so the new token sits at position cached_len)", DeprecationWarning, stacklevel=3)
        if cached_len is not None:
            raise ValueError(f"{fn}: pass cached_len or context_len, not both")
        cached_len = context_len + offset
    if cached_len is None:
        raise TypeError(f"{fn}() needs cached_len")
    return cached_len


def decode_step_flops(cfg, context_len: int | None = None, batch_size: int = 1, *, cached_len: int | None = None) -> int:
    """Returns the FLOPs of one cached decode step after cached_len positions (the new one at cached_len). Chapter 04."""
    cached_len = _cached_len(cached_len, context_len, 0, "decode_step_flops")
    if cached_len < 0:
        raise ValueError(f"cached_len={cached_len} must be >= 0")
    return forward_flops(cfg, 1, cached_len, logits_positions=1, batch_size=batch_size)


class KVShape(NamedTuple):
    """What sets a cache's K/V bytes per position: layers, K/V heads and their width. Chapter 04."""
    n_layers: int
    n_kv_heads: int
    head_dim: int


def kv_cache_bytes(cfg, seq_len: int, dtype_bytes: int, batch_size: int = 1, *, scale_bytes: int = 0,
                   scale_block: int = 1) -> int | float:
    """Returns the bytes of K and V for seq_len positions of batch_size sequences: 2 · layers · kv_heads ·
    head_dim · seq_len · batch · dtype_bytes. Every cache's size comes from here. Chapter 04.

    A quantized cache (chapter 08: dtype_bytes=1 for int8 codes) also holds scales of scale_bytes each: one per
    position and head for V, and one per channel for each scale_block positions of K (a fraction per position).
    """
    if seq_len < 0 or batch_size < 1:
        raise ValueError(f"seq_len must be >= 0 and batch_size >= 1; got seq_len={seq_len}, batch_size={batch_size}")
    if scale_block < 1:
        raise ValueError(f"scale_block must be >= 1 (positions sharing one key scale), got {scale_block}")
    head_dim = head_dim_of(cfg)
    heads = cfg.n_layers * cfg.n_kv_heads * batch_size * seq_len          # (layer, head, sequence, position)
    nbytes = heads * 2 * head_dim * dtype_bytes
    if scale_bytes:
        return nbytes + heads * scale_bytes * (1 + head_dim / scale_block)
    return nbytes


def kv_bytes_per_token(cfg, dtype_bytes: int) -> int:
    """Returns the bytes of K and V that one cached position holds across all layers. Chapter 04."""
    return kv_cache_bytes(cfg, 1, dtype_bytes)


def activation_bytes(cfg, n_tokens: int, dtype_bytes: int, batch_size: int = 1) -> int:
    """Returns the peak activations of one forward over n_tokens: a few (T, dim) and (T, hidden) tensors
    alive at once, plus one float32 row of logits per sequence. Chapter 04."""
    return (batch_size * n_tokens * (4 * cfg.dim + 2 * cfg.hidden_dim) * dtype_bytes
            + batch_size * cfg.vocab_size * 4)


def generation_bytes(cfg, batch_size: int, prompt_len: int, new_tokens: int, dtype_bytes: int,
                     use_cache: bool = True) -> int:
    """Returns the memory a generation needs beyond the weights: its K/V cache (with use_cache) plus the
    activations of its widest forward (the prompt with a cache, the whole context without). Chapter 04."""
    context = prompt_len + new_tokens
    kv = kv_cache_bytes(cfg, max(context - 1, prompt_len), dtype_bytes, batch_size) if use_cache else 0
    return kv + activation_bytes(cfg, prompt_len if use_cache else context, dtype_bytes, batch_size)


def decode_step_bytes(cfg, context_len: int | None = None, dtype_bytes: int | None = None, batch_size: int = 1, *,
                      cached_len: int | None = None) -> int:
    """Returns the bytes one decode step after cached_len positions reads: the weights once, plus each
    sequence's K/V for cached_len + 1 positions (the new one included). Chapter 04."""
    cached_len = _cached_len(cached_len, context_len, -1, "decode_step_bytes")
    if dtype_bytes is None:
        raise TypeError("decode_step_bytes() needs dtype_bytes")
    if cached_len < 0 or batch_size < 1:
        raise ValueError(f"cached_len={cached_len}, batch_size={batch_size}: need cached_len >= 0, batch_size >= 1")
    return weight_bytes_read(cfg, dtype_bytes) + kv_cache_bytes(cfg, cached_len + 1, dtype_bytes, batch_size)


def decode_bytes(cfg, prompt_len: int, new_tokens: int, dtype_bytes: int, batch_size: int = 1) -> int:
    """Returns the bytes read by new_tokens cached decode steps after a prompt of prompt_len. Chapter 04.

    Step i (0-based) writes position prompt_len + i and attends to prompt_len + i + 1 positions.
    """
    return sum(decode_step_bytes(cfg, cached_len=prompt_len + i, dtype_bytes=dtype_bytes, batch_size=batch_size)
               for i in range(new_tokens))


@dataclass(frozen=True)
class CacheVsRecompute:
    """FLOPs of decoding with a K/V cache and by recomputation, and their ratio. Chapter 04."""
    cached_flops: int        # prefill once, then one position per step
    recompute_flops: int     # every step runs the whole sequence so far again
    speedup: float           # recompute_flops / cached_flops


def cache_vs_recompute_flops(cfg, prompt_len: int, new_tokens: int,
                             recompute_all_logits: bool = False) -> CacheVsRecompute:
    """Returns the FLOP prediction for generating new_tokens after prompt_len with and without a cache. Chapter 04.

    Both strategies produce the first new token from a prefill of the prompt.
    Each later token t (1 .. new_tokens - 1) costs a one-position step at
    position prompt_len + t - 1 with a cache, or a forward over all
    prompt_len + t positions without one. With recompute_all_logits the
    uncached forward also runs the head on every position.
    """
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"prompt_len={prompt_len}, new_tokens={new_tokens}: both must be >= 1")
    first = prefill_flops(cfg, prompt_len)
    cached = first + sum(decode_step_flops(cfg, cached_len=prompt_len + t - 1) for t in range(1, new_tokens))
    recompute = first
    for t in range(1, new_tokens):
        length = prompt_len + t
        recompute += forward_flops(cfg, length, 0, logits_positions=length if recompute_all_logits else 1)
    return CacheVsRecompute(cached, recompute, recompute / cached)


def roofline_seconds(flops: float, nbytes: float, flops_per_s: float, bytes_per_s: float) -> float:
    """Returns the time the slower limit allows: max(FLOPs / rate, bytes / bandwidth). Chapter 04."""
    return max(flops / flops_per_s, nbytes / bytes_per_s)
