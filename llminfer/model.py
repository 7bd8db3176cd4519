"""The Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU. Chapter 01.

Parameter names follow Hugging Face's Llama/Qwen2 checkpoints (without the leading "model."), so a
checkpoint maps onto this module name for name. The mixture-of-experts families (Qwen3-MoE, Mixtral, OLMoE,
chapter 14) replace the feed-forward of their MoE layers by `llminfer.moe.MoEFeedForward`, whose experts are
stacked (the checkpoint reader maps their per-expert tensors), and Qwen3-MoE and OLMoE normalise q and k.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .attention import get_backend
from .checks import check_token_ids
from .config import SHAPE_ONLY_MODEL_TYPES, ModelConfig
from .kv_cache import Cache, KVCache
from .moe import MoEFeedForward, SwiGLU

__all__ = ["Transformer", "DecoderStack", "RMSNorm", "rope_frequencies", "apply_rope", "norm_qk", "check_token_ids"]

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in float32. Chapter 01."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_frequencies(config: ModelConfig) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies θ^(-2i/d), with Llama 3's long-context rescaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling and scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are slowed down by `factor`, short ones kept, the band between blended smoothly
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + d/2) pair of x (B, H, T, D) by its position's angle; cos, sin are (T, D) or (B, 1, T, D). Chapter 02."""
    return x * cos + _rotate_half(x) * sin


def norm_qk(q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module | None, k_norm: nn.Module | None,
            head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, T, H·D) and k (B, T, H_kv·D) RMS-normalised before RoPE, where the family does (Qwen3: each head
    over its D, the norms' width; OLMoE: all of q, all of k); unchanged without norms. Chapter 14."""
    if q_norm is None:
        return q, k
    if q_norm.weight.shape[0] != head_dim:                        # over all heads at once
        return q_norm(q), k_norm(k)
    return (q_norm(q.unflatten(-1, (-1, head_dim))).flatten(-2),
            k_norm(k.unflatten(-1, (-1, head_dim))).flatten(-2))


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions and an optional KV cache. Chapter 02."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        bias = config.qkv_bias
        self.q_proj = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)
        # Qwen3-MoE and OLMoE normalise q and k (chapter 14): over each head, or over all heads
        widths = {"head": (config.head_dim, config.head_dim),
                  "full": (config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim)}.get(config.qk_norm)
        self.q_norm = RMSNorm(widths[0], config.norm_eps) if widths else None
        self.k_norm = RMSNorm(widths[1], config.norm_eps) if widths else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache | None,
                backend) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        q, k = norm_qk(self.q_proj(x), self.k_proj(x), self.q_norm, self.k_norm, self.head_dim)
        q = q.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)                  # (B, H, T, D)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)               # (B, H_kv, T, D)
        v = self.v_proj(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)   # the cache stores keys *after* RoPE
        if cache is not None:
            out = cache.attend(self.layer_idx, q, k, v, backend)  # writes k, v; attends over the whole prefix
        else:
            out = backend(q, k, v, causal=True)                   # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, self.n_heads * self.head_dim))


class MLP(SwiGLU):
    """SwiGLU: down(silu(gate(x)) · up(x)), of the config's hidden_dim. Chapter 01."""

    def __init__(self, config: ModelConfig):
        super().__init__(config.dim, config.hidden_dim)


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)); mlp is a mixture of experts in the config's moe_layers.
    Chapters 01, 14."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MoEFeedForward.from_config(config) if layer_idx in config.moe_layers else MLP(config)

    def forward(self, x, cos, sin, cache, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.ModuleList):
    """The decoder layers, run in order. Chapter 01.

    A ModuleList (so parameter names stay `layers.0. ...`), with one forward: x through every layer. It is
    the seam a module transform replaces to run a whole stack in one call (chapter 08's native decode).
    """

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Cache | None,
                backend) -> torch.Tensor:
        for layer in self:
            x = layer(x, cos, sin, cache, backend)                      # (B, T, dim)
        return x


class Transformer(nn.Module):
    """A Llama-family decoder; `forward(input_ids, positions=None, cache=None)` returns logits. Chapter 01."""

    def __init__(self, config: ModelConfig, attn_backend: str | None = None):
        super().__init__()
        if config.model_type in SHAPE_ONLY_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is a published shape for the cost model only (its "
                             "attention is not implemented); build an MoE model of a family llminfer runs, e.g. "
                             "config.replace(model_type='qwen3_moe')")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = DecoderStack(DecoderLayer(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.set_attention_backend(attn_backend or getattr(config, "attn_backend", "sdpa"))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def set_attention_backend(self, name: str) -> "Transformer":
        """Attention runs through the backend registered as `name` ('sdpa', 'explicit', ...); returns self."""
        self.attn_backend = name
        self._backend = get_backend(name)        # an unknown name is refused here, not at the first forward
        return self

    def new_cache(self, batch_size: int = 1, max_seq_len: int | None = None) -> KVCache:
        """A preallocated KVCache for the layers and K/V heads this model holds, on its device and dtype. Chapter 04.

        It is sized from the modules, not the config, so a split model (a tensor-parallel rank's heads, a
        pipeline stage's layers, chapter 10) gets a cache of its own part with no hook set on it."""
        return KVCache.for_model(self, batch_size, max_seq_len)

    def rope_tables(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin tables (end, head_dim) in the model's dtype, computed once in float32 and grown on demand."""
        cached = self._rope_cache
        if cached is None or cached[0].shape[0] < end or cached[0].device != self.device or cached[0].dtype != self.dtype:
            size = min(self.config.max_seq_len, max(end, 256, 2 * (cached[0].shape[0] if cached else 0)))
            inv_freq = rope_frequencies(self.config).to(self.device)
            angles = torch.outer(torch.arange(size, device=self.device, dtype=torch.float32), inv_freq)
            angles = torch.cat((angles, angles), dim=-1)                   # (size, head_dim)
            cached = (angles.cos().to(self.dtype), angles.sin().to(self.dtype))
            self._rope_cache = cached
        return cached

    def check_input(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                    cache: Cache | None = None) -> None:
        """Raise ValueError, before any compute, for input this model cannot take. No host sync: ids are
        checked against the vocabulary where they come from the user (`generate`, `check_token_ids`)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be a (batch, seq_len) tensor of token ids, got {shape}; "
                             "wrap a single sequence as torch.tensor([ids])")
        if input_ids.dtype not in _INTEGER_DTYPES:
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; "
                             "pass a torch.long tensor")
        batch, seq_len = input_ids.shape
        if seq_len == 0:
            raise ValueError("the prompt must hold at least one token, got 0")
        if positions is not None:
            if not isinstance(positions, torch.Tensor) or positions.dtype not in _INTEGER_DTYPES:
                raise ValueError(f"positions must be an integer tensor of shape (T,) or (B, T), got "
                                 f"{getattr(positions, 'dtype', type(positions).__name__)}")
            if positions.shape[-1] != seq_len or positions.dim() not in (1, 2) or \
                    (positions.dim() == 2 and positions.shape[0] != batch):
                raise ValueError(f"positions has shape {tuple(positions.shape)} but input_ids is {tuple(input_ids.shape)};"
                                 f" pass ({seq_len},) or ({batch}, {seq_len})")
        start = cache.length if cache is not None and positions is None else 0
        if positions is None and start + seq_len > self.config.max_seq_len:
            raise ValueError(f"{start + seq_len} positions ({start} cached + {seq_len} new tokens) exceed the "
                             f"model's max_seq_len={self.config.max_seq_len}; shorten the input")

    def check_token_ids(self, input_ids: torch.Tensor) -> None:
        """Raise ValueError if any id lies outside the vocabulary (one host sync: call it once per request)."""
        check_token_ids(input_ids, self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache: Cache | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Logits (B, T, vocab), or (B, 1, vocab) with last_only; writes K/V into `cache`. Chapter 01.

        The one forward: prefill (T prompt tokens), decode (T = 1), verification of T guessed tokens,
        CUDA-graph capture (a static cache and a positions tensor) and the paged engine all call it.
        positions=None continues from the cache's length (or from 0 without a cache).
        """
        self.check_input(input_ids, positions, cache)
        input_ids = input_ids.to(self.device)
        batch, seq_len = input_ids.shape
        # the RoPE table must reach the last position: known without a sync unless positions are explicit
        end = (cache.length if cache is not None else 0) + seq_len if positions is None else self.config.max_seq_len
        if cache is not None:
            positions = cache.begin(seq_len, batch, positions)          # (T,) or (B, T): checked, before compute
        elif positions is None:
            positions = torch.arange(seq_len, device=self.device)       # (T,)
        else:
            positions = positions.to(self.device)
            lo, hi = (int(p) for p in torch.aminmax(positions))         # explicit positions: checked once
            if lo < 0 or hi >= self.config.max_seq_len:
                raise ValueError(f"position {lo if lo < 0 else hi} is outside 0..{self.config.max_seq_len - 1} "
                                 f"(the model's max_seq_len={self.config.max_seq_len})")
        cos, sin = self.rope_tables(end)
        cos, sin = cos[positions], sin[positions]                       # (T, head_dim) or (B, T, head_dim)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]                       # (B, 1, T, head_dim): one angle per row
        x = self.embed_tokens(input_ids)                                # (B, T, dim)
        x = self.layers(x, cos, sin, cache, self._backend)              # (B, T, dim), layer by layer
        if cache is not None:
            cache.end()
        if last_only:
            x = x[:, -1:]                                               # (B, 1, dim)
        return self.lm_head(self.norm(x))                               # (B, T, vocab)

    @torch.no_grad()
    def use_decode_layout(self) -> "Transformer":
        """Stores each weight with more outputs than inputs column-major; returns self. Chapter 04.

        Same shapes, same values, same parameter names: only the memory order changes, so that the
        one-token matvec of a decode step (x @ W.T) streams long contiguous rows of W.T. On a CPU this
        speeds up the wide matrices (MLP gate/up, the output head) and so the whole decode step.
        """
        for param in self.parameters():
            if param.dim() == 2 and param.shape[0] > param.shape[1] and param.is_contiguous():
                param.data = param.data.t().contiguous().t()                # (out, in) with strides (1, out)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> "Transformer":
        """Fill the weights with N(0, std²) (norms with ones), reproducibly from `seed`; returns self."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):                      # every RMSNorm's scale
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values.to(param.dtype))
        return self
