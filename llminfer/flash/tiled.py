"""Attention in tiles, in plain PyTorch, with its memory traffic counted by the loops themselves. Chapter 07.

    naive_attention(q, k, v, causal, traffic=...)      standard attention: S and P go to slow memory and back
    tiled_attention(q, k, v, causal, block_m, block_n)  the FlashAttention-2 forward loop -> TiledOutput
    split_kv_attention(q, k, v, num_splits, causal)     flash-decoding: K/V split, partial results combined
    combine_partials(outs, lses)                        merges (out, lse) pairs computed over disjoint keys
    HBMTraffic                                          bytes read from / written to slow memory, by tensor
    standard_io_elements(n, d), flash_io_elements(n, d, sram)  the paper's Θ bounds, for the plots

Shapes: q (B, n_heads, T_q, D); k, v (B, n_kv_heads, T_k, D). Causal masking aligns the
queries with the *last* T_q keys (query i sits at position T_k - T_q + i), the rule of
llminfer.attention, so the same call serves a prompt, a decode step and a chunk of a prefill.

The counting models a GPU kernel that runs one program per (batch, query head, query
block): every `traffic.load` is a copy from "HBM" into on-chip memory, every
`traffic.store` a copy back, and what stays in local variables between them lives in
"SRAM". Tensors may live on the meta device: the loops then count bytes without computing
anything (naive_attention at any size in milliseconds; the tiled loop still pays some Python
time per tile, more on meta than on the CPU).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from llminfer.attention import causal_mask, repeat_kv

__all__ = ["HBMTraffic", "TiledOutput", "TileStep", "naive_attention", "tiled_attention", "split_kv_attention",
           "combine_partials", "tile_grid", "standard_io_elements", "flash_io_elements"]


@dataclass
class HBMTraffic:
    """Bytes moved between slow memory and on-chip memory, per tensor, and the tiles visited. Chapter 07."""

    read: dict[str, int] = field(default_factory=dict)      # e.g. {"Q": ..., "K": ..., "V": ..., "S": ...}
    written: dict[str, int] = field(default_factory=dict)   # e.g. {"O": ..., "LSE": ..., "S": ..., "P": ...}
    tiles_computed: int = 0    # (query block × key block) tiles whose scores were computed, per batch row and head
    tiles_skipped: int = 0     # tiles wholly above the causal diagonal, never loaded (same units)

    def load(self, name: str, tile: torch.Tensor) -> torch.Tensor:
        """Counts tile as read from slow memory and returns it."""
        self.read[name] = self.read.get(name, 0) + tile.numel() * tile.element_size()
        return tile

    def store(self, name: str, destination: torch.Tensor, value: torch.Tensor) -> None:
        """Copies value into destination (a view of slow memory) and counts the bytes written."""
        destination.copy_(value)
        self.written[name] = self.written.get(name, 0) + destination.numel() * destination.element_size()

    @property
    def read_bytes(self) -> int:
        """Bytes read from slow memory, all tensors together."""
        return sum(self.read.values())

    @property
    def written_bytes(self) -> int:
        """Bytes written to slow memory, all tensors together."""
        return sum(self.written.values())

    @property
    def total_bytes(self) -> int:
        """Bytes read plus bytes written."""
        return self.read_bytes + self.written_bytes

    def snapshot(self) -> "HBMTraffic":
        """A copy of the counts as they stand now."""
        return HBMTraffic(dict(self.read), dict(self.written), self.tiles_computed, self.tiles_skipped)


class TiledOutput(NamedTuple):
    """What tiled_attention returns: the output, the log-sum-exp of each query's scores, the traffic."""

    out: torch.Tensor       # (B, H, T_q, D)
    lse: torch.Tensor       # (B, H, T_q) float32: log Σ_j exp(score_ij), -inf for a query that sees no key
    traffic: HBMTraffic


@dataclass(frozen=True)
class TileStep:
    """The state of one query block after one more K/V tile: what the chapter 07 widget draws."""

    q_block: int
    k_block: int
    row_max: torch.Tensor       # (B, H, block_m) running max of the scores, m
    row_sum: torch.Tensor       # (B, H, block_m) running sum of exp(score - m), l
    output: torch.Tensor        # (B, H, block_m, D) running output, acc / l (what it would be if keys stopped here)
    traffic: HBMTraffic         # the counts so far


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fn: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be a 4-D tensor (B, heads, T, head_dim); "
                             f"got {tuple(getattr(t, 'shape', ()))}")
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(f"{fn}: q, k, v must share one floating-point dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{fn}: k and v must have the shape (B, n_kv_heads, T_k, D) with q's B and D; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{fn}: {q.shape[1]} query heads cannot share {k.shape[1]} K/V heads; "
                         "n_heads must be a multiple of n_kv_heads")
    if k.shape[2] < q.shape[2]:
        raise ValueError(f"{fn}: {q.shape[2]} queries but only {k.shape[2]} keys; queries are aligned to the "
                         "end of the keys, so T_q must not exceed T_k")


def _check_block(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer (rows or keys per tile)")


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, traffic: HBMTraffic | None = None) -> tuple[torch.Tensor, HBMTraffic]:
    """Returns (out, traffic) of standard attention: S = QKᵀ and P = softmax(S) round-trip slow memory. Chapter 07.

    The steps of Algorithm 0 in the FlashAttention paper: read Q, K, write S; read S, write P;
    read P and V, write O. The score matrix is stored in the inputs' dtype.
    """
    _check_inputs(q, k, v, "naive_attention")
    traffic = HBMTraffic() if traffic is None else traffic
    n_groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_groups), repeat_kv(v, n_groups)   # one program per query head reads its K/V head
    t_q, t_k = q.shape[2], k.shape[2]
    scores_hbm = torch.empty(*q.shape[:3], t_k, dtype=q.dtype, device=q.device)    # (B, H, T_q, T_k) in HBM
    probs_hbm = torch.empty_like(scores_hbm)
    out = torch.empty_like(q)                                                      # (B, H, T_q, D)

    s = traffic.load("Q", q) @ traffic.load("K", k).transpose(-2, -1) * _scale(q, scale)
    traffic.store("S", scores_hbm, s)                                             # the T_q × T_k matrix goes out
    s = traffic.load("S", scores_hbm).float()                                     # ... and comes back
    if causal:
        s = s.masked_fill(~causal_mask(t_q, t_k, device=q.device), float("-inf"))
    traffic.store("P", probs_hbm, torch.softmax(s, dim=-1))                      # again for the probabilities
    o = traffic.load("P", probs_hbm) @ traffic.load("V", v)
    traffic.store("O", out, o)
    return out, traffic


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    block_m: int = 64, block_n: int = 64, scale: float | None = None,
                    traffic: HBMTraffic | None = None,
                    on_tile: Callable[[TileStep], None] | None = None) -> TiledOutput:
    """Returns TiledOutput(out, lse, traffic): the FlashAttention-2 forward in torch, tile by tile. Chapter 07.

    For each block of block_m queries, the loop walks K and V in tiles of block_n keys and keeps, per
    query row, a running max m, a running sum l and an unnormalised output acc, all in float32. A new
    tile raises the max to m'; acc and l are multiplied by exp(m - m') and the tile's contribution added.
    Only after the last tile is acc divided by l and written out, once. Under causal masking, tiles
    wholly above the diagonal are skipped and counted in traffic.tiles_skipped.

    on_tile, if given, is called after every computed tile with a TileStep (copies of the running state).
    """
    _check_inputs(q, k, v, "tiled_attention")
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    traffic = HBMTraffic() if traffic is None else traffic
    n_groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_groups), repeat_kv(v, n_groups)    # views: each query head reads its K/V head's tiles
    batch, n_heads, t_q, head_dim = q.shape
    t_k = k.shape[2]
    offset = t_k - t_q                                       # query i sits at key position offset + i
    scale = _scale(q, scale)
    out = torch.empty_like(q)                                                         # (B, H, T_q, D) in HBM
    lse = torch.empty(batch, n_heads, t_q, dtype=torch.float32, device=q.device)      # (B, H, T_q) in HBM
    n_key_blocks = -(-t_k // block_n)

    for q_block, m0 in enumerate(range(0, t_q, block_m)):
        m1 = min(m0 + block_m, t_q)
        q_tile = traffic.load("Q", q[:, :, m0:m1])                                    # (B, H, bm, D) into SRAM
        row_max = torch.full((batch, n_heads, m1 - m0), float("-inf"), device=q.device)  # m  (B, H, bm)
        row_sum = torch.zeros(batch, n_heads, m1 - m0, device=q.device)                  # l  (B, H, bm)
        acc = torch.zeros(batch, n_heads, m1 - m0, head_dim, device=q.device)            # (B, H, bm, D)
        last_visible = offset + m1 - 1          # the furthest key any row of this block may see
        for k_block, n0 in enumerate(range(0, t_k, block_n)):
            if causal and n0 > last_visible:    # this tile and every later one lie above the diagonal
                traffic.tiles_skipped += (n_key_blocks - k_block) * batch * n_heads
                break
            n1 = min(n0 + block_n, t_k)
            k_tile = traffic.load("K", k[:, :, n0:n1])                                # (B, H, bn, D)
            v_tile = traffic.load("V", v[:, :, n0:n1])                                # (B, H, bn, D)
            s = (q_tile @ k_tile.transpose(-2, -1)).float() * scale                   # (B, H, bm, bn)
            if causal and n1 - 1 > offset + m0:  # the tile crosses the diagonal: mask inside it
                rows = torch.arange(m0, m1, device=q.device)[:, None] + offset
                cols = torch.arange(n0, n1, device=q.device)[None, :]
                s = s.masked_fill(cols > rows, float("-inf"))
            new_max = torch.maximum(row_max, s.amax(dim=-1))                          # m'
            ref = torch.where(torch.isneginf(new_max), torch.zeros_like(new_max), new_max)
            p = torch.exp(s - ref[..., None])                                         # (B, H, bm, bn)
            rescale = torch.exp(row_max - ref)                                        # exp(m - m'), 0 at the start
            row_sum = row_sum * rescale + p.sum(dim=-1)
            acc = acc * rescale[..., None] + p @ v_tile.float()
            row_max = new_max
            traffic.tiles_computed += batch * n_heads    # the kernel runs one program per (batch, head)
            if on_tile is not None:
                shown = acc / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)[..., None]
                on_tile(TileStep(q_block, k_block, row_max.clone(), row_sum.clone(), shown,
                                 traffic.snapshot()))
        safe_sum = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)   # a row that saw no key: 0
        traffic.store("O", out[:, :, m0:m1], (acc / safe_sum[..., None]).to(q.dtype))  # written once
        traffic.store("LSE", lse[:, :, m0:m1], row_max + torch.log(row_sum))
    return TiledOutput(out, lse, traffic)


def tile_grid(t_q: int, t_k: int, block_m: int, block_n: int, causal: bool = True) -> list[list[str]]:
    """Rows of 'full', 'diagonal' or 'skipped' for each (query block, key block) tile. Chapter 07."""
    for name, value in (("t_q", t_q), ("t_k", t_k), ("block_m", block_m), ("block_n", block_n)):
        _check_block(name, value)
    if t_k < t_q:
        raise ValueError(f"t_q={t_q} exceeds t_k={t_k}; queries are aligned to the end of the keys")
    offset = t_k - t_q
    grid = []
    for m0 in range(0, t_q, block_m):
        m1 = min(m0 + block_m, t_q)
        row = []
        for n0 in range(0, t_k, block_n):
            n1 = min(n0 + block_n, t_k)
            if causal and n0 > offset + m1 - 1:
                row.append("skipped")
            elif causal and n1 - 1 > offset + m0:
                row.append("diagonal")
            else:
                row.append("full")
        grid.append(row)
    return grid


def _partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of q over one slice of keys; a row that sees none of them gets out 0 and lse -inf."""
    s = (q @ k.transpose(-2, -1)).float() * scale                 # (B, H, T_q, n)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                              # (B, H, T_q); -inf where nothing is visible
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = torch.exp(s - ref[..., None]) @ v.float()               # (B, H, T_q, D), already normalised
    return out, lse


def combine_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse) over all keys from per-split (outs (S, ..., D), lses (S, ...)). Chapter 07.

    Each split's output is normalised over its own keys; weighting it by exp(lse_s - lse) turns
    that into its share of the whole softmax. A split whose keys a row cannot see has lse -inf: weight 0.
    """
    if outs.dim() != lses.dim() + 1 or outs.shape[:-1] != lses.shape:
        raise ValueError(f"combine_partials needs outs (S, ..., D) and lses (S, ...); got {tuple(outs.shape)} "
                         f"and {tuple(lses.shape)}")
    lse = torch.logsumexp(lses, dim=0)                                    # (...)
    ref = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses - ref)                                       # (S, ...), sums to 1 over S
    return (weights[..., None] * outs).sum(dim=0), lse


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int, causal: bool = True,
                       scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, lse): flash-decoding, with K/V cut into num_splits slices combined at the end. Chapter 07.

    On a GPU each slice goes to its own block of threads, so a single query against a long cache
    still fills the chip; here the slices run one after the other and the point is the combine step.
    """
    _check_inputs(q, k, v, "split_kv_attention")
    t_q, t_k = q.shape[2], k.shape[2]
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= t_k:
        raise ValueError(f"num_splits={num_splits!r} must be an integer from 1 to the number of keys ({t_k})")
    n_groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_groups), repeat_kv(v, n_groups)
    chunk = -(-t_k // num_splits)
    visible = causal_mask(t_q, t_k, device=q.device) if causal else None    # (T_q, T_k)
    outs, lses = [], []
    for start in range(0, t_k, chunk):
        stop = min(start + chunk, t_k)
        allowed = None if visible is None else visible[:, start:stop]
        out, lse = _partial_attention(q, k[:, :, start:stop], v[:, :, start:stop], allowed, _scale(q, scale))
        outs.append(out)
        lses.append(lse)
    out, lse = combine_partials(torch.stack(outs), torch.stack(lses))
    return out.to(q.dtype), lse


def standard_io_elements(seq_len: int, head_dim: int) -> float:
    """N·d + N²: the paper's Θ bound on standard attention's slow-memory accesses, in elements. Chapter 07."""
    return seq_len * head_dim + seq_len ** 2


def flash_io_elements(seq_len: int, head_dim: int, sram_elements: float) -> float:
    """N²·d²/M: the paper's Θ bound on FlashAttention's slow-memory accesses, M the SRAM in elements. Chapter 07."""
    if sram_elements <= 0:
        raise ValueError(f"sram_elements={sram_elements} must be positive")
    return seq_len ** 2 * head_dim ** 2 / sram_elements
