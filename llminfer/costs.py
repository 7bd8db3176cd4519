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

Mixture of experts (chapter 14), a `MoEShape` beside the config:
    expected_distinct_experts(n_experts, top_k, batch_size)  experts a batch touches under random routing
    moe_decode_step_bytes(cfg, moe, batch_size, ...)  bytes of one MoE decode step, beside the dense model
                                             of the same active size
    moe_decode_step_flops(cfg, moe, batch_size, ...)  its FLOPs (only the k chosen experts compute)
    moe_weight_bytes(cfg, moe, dtype_bytes)  every weight an MoE model holds

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
    "MoEShape", "expected_distinct_experts", "MoEStepBytes", "moe_decode_step_bytes", "moe_decode_step_flops",
    "moe_weight_bytes",
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
    qk_norms = {"head": 2 * head_dim, "full": (cfg.n_heads + cfg.n_kv_heads) * head_dim}.get(
        getattr(cfg, "qk_norm", None), 0)                              # Qwen3-MoE, OLMoE (chapter 14)
    norms = cfg.n_layers * (2 * cfg.dim + qk_norms) + cfg.dim
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


# --- mixture of experts ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MoEShape:
    """What a mixture-of-experts feed-forward puts in place of a layer's MLP. Chapter 14.

    n_experts routed experts, each a SwiGLU MLP of width expert_hidden_dim; every token is sent to top_k of them
    by a router (a dim × n_experts matrix). shared_hidden_dim is the width of the shared expert(s) every token
    also goes through (0: none; DeepSeek-V3 and Qwen2-MoE have one). n_dense_layers of the config's layers keep
    its dense MLP of width cfg.hidden_dim (DeepSeek-V3: the first 3); the others are MoE layers. shared_gate:
    the shared expert's output is scaled by a sigmoid of x · w (Qwen2-MoE: dim more weights a layer).
    `MoEShape.from_config(cfg)` reads it from a ModelConfig of an MoE family.
    """

    n_experts: int
    top_k: int
    expert_hidden_dim: int
    shared_hidden_dim: int = 0
    n_dense_layers: int = 0
    shared_gate: bool = False

    def __post_init__(self) -> None:
        for name, least in (("n_experts", 1), ("top_k", 1), ("expert_hidden_dim", 1), ("shared_hidden_dim", 0),
                            ("n_dense_layers", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"MoEShape.{name} must be an integer >= {least}, got {value!r}")
        if not isinstance(self.shared_gate, bool):
            raise ValueError(f"MoEShape.shared_gate must be True or False, got {self.shared_gate!r}")
        if self.top_k > self.n_experts:
            raise ValueError(f"MoEShape.top_k={self.top_k} is more than n_experts={self.n_experts}: a token picks "
                             "top_k distinct experts; lower top_k or add experts")

    @classmethod
    def from_config(cls, cfg) -> "MoEShape":
        """The MoE shape of a ModelConfig with experts: n_experts, n_experts_per_tok, moe_hidden_dim,
        shared_expert_dim, and its layers outside cfg.moe_layers as the dense ones."""
        if not getattr(cfg, "n_experts", 0):
            raise ValueError("this config has no experts (n_experts=0): it is a dense model; pass an MoE config "
                             "or an MoEShape")
        return cls(cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_hidden_dim, cfg.shared_expert_dim,
                   cfg.n_layers - len(cfg.moe_layers), cfg.shared_expert_gate)

    def moe_layers(self, cfg) -> int:
        """The number of MoE layers of cfg: its layers less the leading dense ones."""
        if self.n_dense_layers > cfg.n_layers:
            raise ValueError(f"MoEShape.n_dense_layers={self.n_dense_layers} is more than the model's "
                             f"n_layers={cfg.n_layers}")
        return cfg.n_layers - self.n_dense_layers

    def expert_params(self, dim: int) -> int:
        """The weights of one routed expert: gate, up and down, 3 · dim · expert_hidden_dim."""
        return 3 * dim * self.expert_hidden_dim


def expected_distinct_experts(n_experts: int, top_k: int, batch_size: int) -> float:
    """Returns the expected number of distinct experts B tokens touch when each picks top_k of n_experts at
    random: E · (1 − (1 − k/E)^B). Chapter 14.

    Derivation. Fix one expert e. A token picks k distinct experts, a uniformly random k-subset of the E; of the
    C(E, k) subsets, C(E − 1, k − 1) contain e, a fraction k/E, so the token misses e with probability 1 − k/E.
    Tokens route independently, so all B miss e with probability (1 − k/E)^B. The distinct count is the sum over
    the E experts of the indicator "touched", and an expectation of a sum is the sum of the expectations (the
    indicators need not be independent): E · (1 − (1 − k/E)^B).

    Limits: B = 1 gives E · k/E = k (one token reads only its own experts); while k·B is small against E the
    count is about k·B (almost every pick is new); as B grows it tends to E (every expert is read, as in a dense
    model of the total size). A trained router is not uniform: measure its count with
    `llminfer.moe_balance.mean_distinct_experts`.
    """
    moe = MoEShape(n_experts, top_k, 1)          # checks the counts
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 0:
        raise ValueError(f"batch_size must be an integer >= 0, got {batch_size!r}")
    return moe.n_experts * (1.0 - (1.0 - moe.top_k / moe.n_experts) ** batch_size)


@dataclass(frozen=True)
class MoEStepBytes:
    """The bytes one MoE decode step of batch_size sequences reads, split by what sets them. Chapter 14."""

    batch_size: int
    distinct_experts: float   # routed experts read per MoE layer (expected, or measured)
    always_bytes: float       # read whatever the routing: attention, norms, head, routers, shared experts, dense MLPs
    expert_bytes: float       # the routed experts touched, in every MoE layer
    kv_bytes: float           # each sequence's K/V
    dense_bytes: float        # the dense model of the same active size: always + k experts a layer + K/V

    @property
    def total_bytes(self) -> float:
        return self.always_bytes + self.expert_bytes + self.kv_bytes

    @property
    def per_token_bytes(self) -> float:
        return self.total_bytes / self.batch_size

    @property
    def dense_per_token_bytes(self) -> float:
        return self.dense_bytes / self.batch_size


def _moe_of(cfg, moe: MoEShape | None) -> MoEShape:
    return MoEShape.from_config(cfg) if moe is None else moe


def _moe_always_params(cfg, moe: MoEShape) -> int:
    """Weights read whatever the routing, less the routed experts: attention, norms, head, the dense layers'
    MLPs, and each MoE layer's router and shared expert (an untied embedding is gathered, not read)."""
    moe_layers = moe.moe_layers(cfg)
    dense_mlp = 3 * cfg.dim * cfg.hidden_dim
    per_moe_layer = cfg.dim * (moe.n_experts + 3 * moe.shared_hidden_dim + moe.shared_gate)
    return weight_bytes_read(cfg, 1) - moe_layers * dense_mlp + moe_layers * per_moe_layer


def moe_weight_bytes(cfg, moe: MoEShape | None = None, dtype_bytes: int = 2) -> int:
    """Returns the bytes of every weight an MoE model holds: all n_experts routed experts of every MoE layer,
    routers, shared experts, and everything `weight_bytes` counts outside the MLPs (moe None: read from cfg).
    Chapter 14."""
    moe = _moe_of(cfg, moe)
    embedding = 0 if getattr(cfg, "tie_embeddings", False) else cfg.vocab_size * cfg.dim
    routed = moe.moe_layers(cfg) * moe.n_experts * moe.expert_params(cfg.dim)
    return (_moe_always_params(cfg, moe) + embedding + routed) * dtype_bytes


def moe_decode_step_bytes(cfg, moe: MoEShape | None = None, batch_size: int = 1, *, cached_len: int = 0, dtype_bytes: int = 2,
                          distinct_experts: float | None = None) -> MoEStepBytes:
    """Returns the bytes one decode step of batch_size sequences after cached_len positions reads. Chapter 14.

    Each MoE layer reads its router and shared expert, and each routed expert that at least one of the
    batch_size tokens chose, once: distinct_experts of them (default: `expected_distinct_experts`, uniform random
    routing; pass a count measured on a real router instead). At batch 1 that is k experts, the active size; as
    the batch grows it tends to all n_experts. The dense model of the same active size reads, at every batch,
    what the MoE reads at batch 1 (dense_bytes): its bytes per token fall as 1/B, the MoE's much more slowly.
    moe None: the shape is read from cfg (`MoEShape.from_config`).
    """
    moe = _moe_of(cfg, moe)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    most = min(moe.n_experts, moe.top_k * batch_size)
    if distinct_experts is None:
        distinct_experts = expected_distinct_experts(moe.n_experts, moe.top_k, batch_size)
    elif not moe.top_k <= distinct_experts <= most:
        raise ValueError(f"distinct_experts={distinct_experts} is impossible for {batch_size} tokens choosing "
                         f"top_k={moe.top_k} of {moe.n_experts} experts: it lies in {moe.top_k}..{most}")
    expert = moe.moe_layers(cfg) * moe.expert_params(cfg.dim) * dtype_bytes
    always = _moe_always_params(cfg, moe) * dtype_bytes
    kv = kv_cache_bytes(cfg, cached_len + 1, dtype_bytes, batch_size)
    return MoEStepBytes(batch_size, distinct_experts, always, distinct_experts * expert, kv,
                        always + moe.top_k * expert + kv)


def moe_decode_step_flops(cfg, moe: MoEShape | None = None, batch_size: int = 1, *, cached_len: int = 0) -> int:
    """Returns the FLOPs of one MoE decode step: as `decode_step_flops`, with each MoE layer's dense MLP replaced
    by its router, its shared expert and the top_k chosen experts, for every token. Chapter 14.

    Unlike the bytes, the FLOPs do not depend on how the tokens spread over the experts: each token computes
    its k experts whichever they are. So the arithmetic intensity (FLOPs / bytes) of an MoE decode step grows
    more slowly with the batch than a dense model's, and it reaches the roofline's ridge at a larger batch.
    """
    moe = _moe_of(cfg, moe)
    per_token_mlp = 3 * cfg.dim * cfg.hidden_dim
    per_token_moe = cfg.dim * (moe.n_experts + 3 * moe.shared_hidden_dim + moe.shared_gate) + moe.top_k * (
        moe.expert_params(cfg.dim))
    dense = decode_step_flops(cfg, cached_len=cached_len, batch_size=batch_size)
    return dense + 2 * batch_size * moe.moe_layers(cfg) * (per_token_moe - per_token_mlp)
