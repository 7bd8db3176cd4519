"""Attention, written out step by step for teaching and through the fused kernel for speed. Chapter 02.

Shapes follow the usual convention: q is (B, n_heads, T_q, head_dim); k and v are (B, n_kv_heads, T_k, head_dim).
When n_kv_heads < n_heads (grouped-query attention) each K/V head serves n_heads // n_kv_heads query heads.
A causal mask lines the queries up with the *last* T_q keys, so query i sits at absolute position
T_k - T_q + i and sees keys 0 .. T_k - T_q + i: the same rule serves a whole prompt (T_q = T_k) and
a decode step against a cache (T_q = 1, which sees every key).
"""
from __future__ import annotations

import math
from typing import Callable, Protocol

import torch
import torch.nn.functional as F

__all__ = ["attention", "fast_attention", "grouped_query_sdpa", "causal_mask", "repeat_kv", "softmax",
           "AttentionBackend", "Registry", "register_backend", "get_backend", "backends"]


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(
            f"q, k and v must have the same number of dimensions (…, T, head_dim); got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must share head_dim to be compared; got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must hold the same number of tokens; got {k.shape[-2]} and {v.shape[-2]}")
    if q.dim() == 4 and q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"{q.shape[1]} query heads cannot share {k.shape[1]} K/V heads; n_heads must be a multiple of n_kv_heads"
        )
    if k.shape[-2] < q.shape[-2]:
        raise ValueError(f"{q.shape[-2]} queries but only {k.shape[-2]} keys: every query needs its own key")


def causal_mask(t_q: int, t_k: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (t_q, t_k) mask, True where query i may look at key j (j <= t_k - t_q + i). Chapter 02."""
    offset = t_k - t_q
    rows = torch.arange(t_q, device=device).unsqueeze(1)  # (t_q, 1)
    cols = torch.arange(t_k, device=device).unsqueeze(0)  # (1, t_k)
    return cols <= rows + offset


def repeat_kv(x: torch.Tensor, n_groups: int) -> torch.Tensor:
    """(B, n_kv_heads, T, D) -> (B, n_kv_heads * n_groups, T, D): each K/V head copied for the query heads it serves."""
    if n_groups == 1:
        return x
    batch, n_kv_heads, seq_len, head_dim = x.shape
    x = x[:, :, None, :, :].expand(batch, n_kv_heads, n_groups, seq_len, head_dim)
    return x.reshape(batch, n_kv_heads * n_groups, seq_len, head_dim)


def softmax(scores: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(s - max) / sum exp(s - max): the numerically safe softmax, written out. Chapter 02."""
    shifted = scores - scores.amax(dim=dim, keepdim=True)
    exp = shifted.exp()
    return exp / exp.sum(dim=dim, keepdim=True)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (output, weights): scores = q·kᵀ·scale, mask, softmax, weights·v, step by step. Chapter 02.

    `scale=None` is the standard 1/√head_dim; the worked example in chapter 02 uses scale=1.
    `mask` (boolean, broadcastable to (…, T_q, T_k), True = may attend) replaces the causal rule.
    """
    _check_shapes(q, k, v)
    if q.dim() == 4:
        n_groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_groups), repeat_kv(v, n_groups)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale                # (…, T_q, T_k)  how well each query matches each key
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))     # positions the caller hides
    elif causal:
        allowed = causal_mask(q.shape[-2], k.shape[-2], device=q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))  # the future is invisible
    weights = softmax(scores.float(), dim=-1).to(q.dtype)    # (…, T_q, T_k)  each row sums to 1
    output = weights @ v                                      # (…, T_q, head_dim)  a weighted mix of the values
    return output, weights


def fast_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                   scale: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Returns the same output as `attention`, through F.scaled_dot_product_attention (no weights). Chapter 02."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    gqa = q.dim() == 4 and q.shape[1] != k.shape[1]
    is_causal = False
    if mask is not None:
        pass                                    # the caller's mask decides (e.g. a static cache's unwritten tail)
    elif causal and t_q > 1:
        if t_q == t_k:
            is_causal = True                    # the kernel's own top-left mask is the right one here
        else:
            mask = causal_mask(t_q, t_k, device=q.device)
    # (a single query, or causal=False, needs no mask: it sees every key)
    if gqa and mask is not None and q.device.type == "cuda":
        return grouped_query_sdpa(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa)


def grouped_query_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """Masked grouped-query attention with each K/V head's query group folded into the query axis:
    q (B, H, T_q, D), k, v (B, H_kv, T_k, D), mask broadcastable to (B, H, T_q, T_k) -> (B, H, T_q, D). Chapter 02.

    On CUDA, SDPA takes a mask or GQA in a fused kernel but not both (enable_gqa with a mask runs the unfused
    math kernel). The G = H / H_kv query heads that read one K/V head are G more query rows of that head, so
    (B, H_kv, G·T_q, D) against the unrepeated K/V is plain masked attention, which the fused kernels take;
    the mask's rows repeat G times.
    """
    batch, n_heads, t_q, head_dim = q.shape
    n_kv_heads, t_k = k.shape[1], k.shape[-2]
    groups = n_heads // n_kv_heads
    folded = q.reshape(batch, n_kv_heads, groups * t_q, head_dim)             # (B, H_kv, G·T_q, D)
    while mask.dim() < 4:
        mask = mask[None]
    mask_batch, mask_heads = mask.shape[0], mask.shape[1]
    if mask_heads == 1:                                                        # one mask for every head
        rows = mask[:, :, None].expand(mask_batch, 1, groups, t_q, t_k)
    else:                                                                      # a mask per query head
        rows = mask.reshape(mask_batch, n_kv_heads, groups, mask.shape[2], mask.shape[3]).expand(
            mask_batch, n_kv_heads, groups, t_q, t_k)
    rows = rows.reshape(mask_batch, rows.shape[1], groups * t_q, t_k)          # (B, H_kv or 1, G·T_q, T_k)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=rows, scale=scale)   # (B, H_kv, G·T_q, D)
    return out.reshape(batch, n_heads, t_q, head_dim)


# --- Backends by name -------------------------------------------------------------------------------
# The model calls attention through a name so that a new kernel (chapter 07's Triton FlashAttention,
# chapter 06's paged attention) plugs in by registering itself; model.py never changes.


class AttentionBackend(Protocol):
    """fn(q (B, H, T_q, D), k, v (B, H_kv, T_k, D), causal, mask=None, scale=None) -> (B, H, T_q, D)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                 mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor: ...


def _explicit_backend(q, k, v, causal=True, mask=None, scale=None):
    return attention(q, k, v, causal=causal, scale=scale, mask=mask)[0]


class Registry:
    """Callables by name, refusing a second one under a taken name: the attention backends here and the
    paged-attention kernels (engine/paged_attention.py). Chapter 07."""

    def __init__(self, what: str, entries: dict[str, Callable], hint: str = ""):
        self.what = what                       # e.g. "attention backend", used in every message
        self.hint = hint                       # appended to the unknown-name error
        self._entries = dict(entries)

    def register(self, name: str, fn: Callable, replace: bool = False) -> None:
        """Makes fn selectable as `name`; a different fn under a taken name needs replace=True."""
        article = "an" if self.what[0] in "aeiou" else "a"
        if not isinstance(name, str) or not name:
            raise ValueError(f"{article} {self.what} needs a non-empty string name, got {name!r}")
        if not callable(fn):
            raise ValueError(f"{self.what} {name!r} must be callable, got {type(fn).__name__}")
        if name in self._entries and not replace and self._entries[name] is not fn:
            raise ValueError(f"{article} {self.what} called {name!r} is already registered; "
                             "pass replace=True to swap it")
        self._entries[name] = fn

    def get(self, name: str) -> Callable:
        """Returns the callable registered as `name`, or a ValueError listing the registered names."""
        if name not in self._entries:
            hint = f". {self.hint}" if self.hint else ""
            raise ValueError(f"unknown {self.what} {name!r}; registered: {', '.join(self.names())}{hint}")
        return self._entries[name]

    def names(self) -> list[str]:
        """Returns the registered names, sorted."""
        return sorted(self._entries)


_BACKENDS = Registry("attention backend", {"explicit": _explicit_backend, "sdpa": fast_attention},
                     hint="Import the module that registers it first (e.g. llminfer.flash for 'flash')")


def register_backend(name: str, fn: Callable, replace: bool = False) -> None:
    """Makes `fn` (an AttentionBackend) selectable as attn_backend=name. Chapter 07."""
    _BACKENDS.register(name, fn, replace)


def get_backend(name: str) -> Callable:
    """Returns the attention backend registered as `name` ('explicit', 'sdpa', ...). Chapter 02."""
    return _BACKENDS.get(name)


def backends() -> list[str]:
    """Returns the names of the registered attention backends."""
    return _BACKENDS.names()
