"""FlashAttention as a Triton kernel: interpreted on CPU tensors, compiled on CUDA. Chapter 07.

    flash_attention(q, k, v, causal=True, block_m=None, block_n=None)   -> FlashOutput(out, lse)
    flash_decode(q, k, v, num_splits, causal=True)                   split-K (flash-decoding) -> FlashOutput
    flash_tile_counts(q, k, v, causal=True, block_m=None, block_n=None)  K/V tiles each program computed
    flash_backend(q, k, v, causal=True, mask=None, scale=None)       the 'flash' attention backend
    default_blocks(head_dim, dtype), padded_head_dim(head_dim)       the tile sizes the kernel uses
    launch_config(head_dim, dtype, block_m, block_n)                 its num_warps and num_stages

One program handles one block of block_m query rows of one (batch, head) and walks the keys in
tiles of block_n, keeping the running max and sum of the online softmax in registers. The kernel
addresses memory with plain pointer arithmetic (base + offsets × strides, masked loads) rather
than block pointers or tensor descriptors: that form runs unchanged under Triton's interpreter
and through its compiler.

Interpreter or compiler is one choice per process, made when triton is first imported: with
TRITON_INTERPRET=1 in the environment then, numpy executes each program in turn on the CPU (slow,
meant for checking correctness; CUDA tensors are copied to the host and back); without it, triton
compiles for the GPU and CPU tensors are refused. On a machine without CUDA the first call sets
TRITON_INTERPRET=1 itself if nothing has imported triton yet. Libraries that import triton on their
own (torch._dynamo and transformers do) fix the mode too: a notebook sets the variable in its first cell.

Head sizes that are not powers of two (80, 96, ...) are padded to the next one inside the
kernel: the extra lanes load zeros and are never stored. Sequence lengths need not be
multiples of the block sizes. GQA: query head h reads K/V head h // (n_heads // n_kv_heads).
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import NamedTuple

import torch

from llminfer.device import dtype_bytes

__all__ = ["FlashOutput", "flash_attention", "flash_decode", "flash_tile_counts", "flash_backend",
           "triton_available", "interpreted", "default_blocks", "padded_head_dim", "launch_config",
           "SUPPORTED_DTYPES", "MAX_HEAD_DIM"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256          # the padded head must fit on chip next to a K and a V tile
MIN_BLOCK, MAX_BLOCK = 16, 256   # tl.dot needs tiles of at least 16 along each side
LOG2_E = 1.4426950408889634
SHARED_MEMORY_BUDGET = 96 * 1024   # bytes of on-chip memory the default tiles may fill (most GPUs have more)
TRITON_PIN = "triton==3.7.1"


class FlashOutput(NamedTuple):
    """The kernel's results: the attention output and each query's log-sum-exp."""

    out: torch.Tensor   # (B, H, T_q, D), q's dtype
    lse: torch.Tensor   # (B, H, T_q) float32, natural log; -inf for a query that sees no key


def triton_available() -> bool:
    """True when the triton package is installed here (it is not imported)."""
    return importlib.util.find_spec("triton") is not None


# --- loading the kernel --------------------------------------------------------------------------------

def _triton_error(exc: Exception) -> ImportError:
    return ImportError(f"the Triton kernel needs the triton package ({exc}); install it with "
                       f"`pip install {TRITON_PIN}` (Linux; the CUDA build of torch 2.13 brings that version)")


def _load_kernel():
    """Imports flash_kernel (and with it triton) once; on a machine without CUDA, in interpreter mode."""
    if "triton" not in sys.modules and not torch.cuda.is_available():
        # Without a GPU the interpreter is the only way Triton runs. The mode is fixed when triton is
        # first imported, so it has to be chosen now, before anything else imports triton.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from . import flash_kernel
    except ImportError as exc:
        raise _triton_error(exc) from None
    return flash_kernel.flash_forward


def interpreted() -> bool:
    """True when this process runs Triton kernels under the interpreter (imports triton if needed)."""
    return type(_load_kernel()).__name__ == "InterpretedFunction"


def padded_head_dim(head_dim: int) -> int:
    """The head width the kernel computes with: the next power of two, at least 16 (80 -> 128). Chapter 07."""
    return max(MIN_BLOCK, 1 << (head_dim - 1).bit_length())


def default_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """Returns (block_m, block_n): the largest tiles, up to 64 × 64, that fit the on-chip budget. Chapter 07."""
    # a Q tile, plus K and V tiles for two pipeline stages, within SHARED_MEMORY_BUDGET bytes
    width = padded_head_dim(head_dim) * dtype_bytes(dtype)                            # bytes of one row
    for block_m, block_n in ((64, 64), (64, 32), (64, 16), (32, 16), (16, 16)):
        if block_m * width + 2 * 2 * block_n * width <= SHARED_MEMORY_BUDGET:
            return block_m, block_n
    return MIN_BLOCK, MIN_BLOCK


# (num_warps, num_stages) of each tile the kernel uses by itself: default_blocks' tiles and flash_decode's
# (block_m 16), keyed by (float32?, padded head size, block_m, block_n). Chosen from ptxas's resource report for
# sm_90 (Triton 3.7.1, the causal kernel compiled for each of 4, 8, 16 warps and 1, 2, 3 stages): the fewest warps,
# then the most stages, at which no register spills to the stack. Float16 and bfloat16 run tl.dot on tensor
# cores and their stages change nothing; float32 (IEEE, no TF32) runs it as FMAs, holding far more a thread.
#   key                     chosen    at 4 warps, 2 stages: registers / spill stack (bytes a thread)
LAUNCH_CONFIGS = {
    (True, 16, 64, 64): (4, 2),       # 196 / 0
    (True, 16, 16, 64): (4, 1),       # 80 / 8
    (True, 32, 64, 64): (8, 1),       # 255 / 120; 8 warps, 2 stages: 255 / 208; 1 stage: 162 / 0
    (True, 32, 16, 64): (4, 2),       # 128 / 0
    (True, 64, 64, 64): (16, 2),      # 32 / 9296; 8 warps: 32 / 4792
    (True, 64, 16, 64): (4, 2),       # 187 / 0
    (True, 128, 64, 32): (8, 2),      # 32 / 8880 (the stack the fixed 4 warps spilled); 8 warps: 192 / 0
    (True, 128, 16, 32): (4, 2),      # 234 / 0
    (True, 256, 32, 16): (8, 2),      # 32 / 8088; 8 warps: 194 / 0
    (True, 256, 16, 16): (8, 2),      # 255 / 16; 8 warps: 147 / 0
    (False, 16, 64, 64): (4, 2),      # 160 / 0
    (False, 16, 16, 64): (4, 2),      # 179 / 0
    (False, 32, 64, 64): (4, 2),      # 233 / 0
    (False, 32, 16, 64): (4, 2),      # 254 / 0
    (False, 64, 64, 64): (4, 2),      # 255 / 0 (float16 too)
    (False, 64, 16, 64): (4, 2),      # 255 / 0
    (False, 128, 64, 64): (8, 2),     # 255 / 336 (float16 too); 8 warps: 255 / 8, the least (16: 200)
    (False, 128, 16, 64): (8, 2),     # 255 / 304; 8 warps: 255 / 0
    (False, 256, 64, 32): (8, 2),     # 255 / 712; 8 warps: 255 / 128, the least (16: 688)
    (False, 256, 16, 32): (8, 2),     # 255 / 152; 8 warps: 252 / 0
}


def launch_config(head_dim: int, dtype: torch.dtype, block_m: int, block_n: int) -> tuple[int, int]:
    """Returns (num_warps, num_stages) for a launch on tiles of block_m × block_n and this head size. Chapter 07.

    The threads of a program share its tiles, so more warps mean fewer registers a thread; a thread that needs
    more than its 255 registers spills them to local memory (correct, slow). The tiles the kernel picks itself
    have their measured choice in LAUNCH_CONFIGS. Tiles a caller chooses get an estimate: the 32-bit registers
    a thread holds through the key loop at 4 warps (the Q tile, the float32 accumulator and scores, and with
    float32, whose dot is a loop of FMAs, the K and V tiles too) are kept within 128, half of what a thread has,
    or 8 warps split them; 2 stages where a Q tile and two stages of K and V fit SHARED_MEMORY_BUDGET, else 1.
    Under the interpreter both are ignored.
    """
    d = padded_head_dim(head_dim)
    fp32 = dtype == torch.float32
    if (fp32, d, block_m, block_n) in LAUNCH_CONFIGS:
        return LAUNCH_CONFIGS[fp32, d, block_m, block_n]
    elem = dtype_bytes(dtype)
    resident = block_m * d * elem + block_m * d * 4 + block_m * block_n * 4      # Q, accumulator, scores
    if fp32:
        resident += 2 * block_n * d * elem                                        # K and V, for the FMA loop
    num_warps = 4 if resident / 4 / (32 * 4) <= 128 else 8
    num_stages = 2 if block_m * d * elem + 2 * 2 * block_n * d * elem <= SHARED_MEMORY_BUDGET else 1
    return num_warps, num_stages


# --- checks and launch ----------------------------------------------------------------------------------

def _check_block(name: str, value) -> None:
    if (not isinstance(value, int) or isinstance(value, bool) or not MIN_BLOCK <= value <= MAX_BLOCK
            or value & (value - 1)):
        raise ValueError(f"{name}={value!r} must be a power of two from {MIN_BLOCK} to {MAX_BLOCK} "
                         "(tl.arange needs a power of two, tl.dot at least 16); try 16, 32, 64 or 128")


def _check(q, k, v, mask, block_m, block_n) -> tuple[int, int]:
    """Refuses bad inputs before any work; returns the block sizes to use (defaults filled in)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or min(t.shape[:2]) < 1:
            raise ValueError(f"flash_attention: {name} must be a 4-D tensor (B, heads, T, head_dim) with B and "
                             f"heads >= 1; got {tuple(getattr(t, 'shape', ()))}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash_attention: q, k, v must share one dtype of float32, float16 or bfloat16; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device) or q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"flash_attention: q, k, v must be on one CPU or CUDA device; got {q.device}, "
                         f"{k.device}, {v.device}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"flash_attention: k and v must have the shape (B, n_kv_heads, T_k, D) with q's B and D; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention: {q.shape[1]} query heads cannot share {k.shape[1]} K/V heads; "
                         "n_heads must be a multiple of n_kv_heads")
    if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
        raise ValueError(f"flash_attention: head_dim={q.shape[3]} is outside 1..{MAX_HEAD_DIM}; "
                         "use the sdpa backend for larger heads")
    if q.shape[2] < 1 or k.shape[2] < q.shape[2]:
        raise ValueError(f"flash_attention: {q.shape[2]} queries against {k.shape[2]} keys; need at least one "
                         "query and no more queries than keys (queries align with the last keys)")
    default_m, default_n = default_blocks(q.shape[3], q.dtype)
    block_m = default_m if block_m is None else block_m
    block_n = default_n if block_n is None else block_n
    _check_block("block_m", block_m)
    _check_block("block_n", block_n)
    if mask is not None:
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ValueError(f"flash_attention: mask must be a boolean tensor (True = may attend), broadcastable "
                             f"to (B, H, T_q, T_k) = {target}; got {getattr(mask, 'dtype', type(mask).__name__)}")
        try:
            fits = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, target) == target
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(f"flash_attention: mask of shape {tuple(mask.shape)} does not broadcast to "
                             f"(B, H, T_q, T_k) = {target}")
    return block_m, block_n


def _launch(q, k, v, causal, mask, scale, block_m, block_n, num_splits, count_tiles):
    """Runs the kernel; returns (out (S, B, H, T_q, D) or (B, H, T_q, D), lse, counts or None)."""
    batch, n_heads, seq_q, head_dim = q.shape
    n_kv_heads, seq_k = k.shape[1], k.shape[2]
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= seq_k:
        raise ValueError(f"num_splits={num_splits!r} must be an integer from 1 to the number of keys ({seq_k})")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    kernel = _load_kernel()
    if q.device.type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("flash_attention got CPU tensors, but triton was imported in compiled mode, which "
                           "runs on GPUs only. Set os.environ['TRITON_INTERPRET'] = '1' before anything imports "
                           "triton (transformers does), e.g. in the first cell, and restart; or pass CUDA tensors")
    # Triton 3.7's interpreter gets tl.dot of two bfloat16 tiles wrong; a product of two bfloat16 numbers
    # is exact in float32, so widening the tiles first gives what the compiled kernel computes
    widen = q.dtype == torch.bfloat16 and type(kernel).__name__ == "InterpretedFunction"
    # each slice of keys is a whole number of tiles, so no tile straddles two slices
    split_len = -(-(-(-seq_k // num_splits)) // block_n) * block_n
    num_splits = -(-seq_k // split_len)      # rounding up the slices can leave fewer of them
    grid = (-(-seq_q // block_m), batch * n_heads, num_splits)
    if num_splits == 1:
        out = torch.empty_like(q)                                                          # (B, H, T_q, D)
        lse = torch.empty(batch, n_heads, seq_q, device=q.device, dtype=torch.float32)    # (B, H, T_q)
        o_strides, l_strides = (0, *out.stride()), (0, *lse.stride())
    else:   # partial results per slice, in float32, combined afterwards
        out = torch.empty(num_splits, batch, n_heads, seq_q, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(num_splits, batch, n_heads, seq_q, device=q.device, dtype=torch.float32)
        o_strides, l_strides = out.stride(), lse.stride()
    if mask is not None:    # uint8 before expanding, so broadcast dimensions keep stride 0 and nothing is copied
        mask_arg = mask.to(torch.uint8).expand(batch, n_heads, seq_q, seq_k)
        m_strides = mask_arg.stride()
    else:
        mask_arg, m_strides = q, (0, 0, 0, 0)
    counts = torch.zeros(grid[2] * grid[1] * grid[0], dtype=torch.int32, device=q.device) if count_tiles else lse
    num_warps, num_stages = launch_config(head_dim, q.dtype, block_m, block_n)
    kernel[grid](
        q, k, v, out, lse, mask_arg, counts,
        *q.stride(), *k.stride(), *v.stride(), *o_strides, *l_strides, *m_strides,
        n_heads, n_heads // n_kv_heads, seq_q, seq_k, head_dim, split_len, scale * LOG2_E,
        CAUSAL=bool(causal), HAS_MASK=mask is not None, COUNT_TILES=count_tiles,
        IEEE_DOT=q.dtype == torch.float32 or widen, WIDEN=widen, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=padded_head_dim(head_dim),
        num_warps=num_warps, num_stages=num_stages,
    )
    tiles = counts.view(grid[2], grid[1], grid[0]) if count_tiles else None
    return out, lse, tiles


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    block_m: int | None = None, block_n: int | None = None, scale: float | None = None,
                    mask: torch.Tensor | None = None) -> FlashOutput:
    """Returns FlashOutput(out, lse) of the Triton FlashAttention kernel. Chapter 07.

    q (B, H, T_q, D); k, v (B, H_kv, T_k, D) with T_q <= T_k. causal aligns the queries with the
    last T_q keys; a boolean mask (True = may attend), broadcastable to (B, H, T_q, T_k), replaces
    the causal rule. scale defaults to 1/√D. A query that sees no key gets a zero output and lse -inf.
    block_m, block_n default to default_blocks(D, dtype).
    """
    block_m, block_n = _check(q, k, v, mask, block_m, block_n)
    out, lse, _ = _launch(q, k, v, causal, mask, scale, block_m, block_n, 1, False)
    return FlashOutput(out, lse)


def flash_tile_counts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """Returns (B·H, query blocks) int32: the K/V tiles each program of the kernel computed. Chapter 07."""
    block_m, block_n = _check(q, k, v, None, block_m, block_n)
    _, _, tiles = _launch(q, k, v, causal, None, None, block_m, block_n, 1, True)
    return tiles[0]


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_splits: int, causal: bool = True,
                 block_m: int = 16, block_n: int | None = None, scale: float | None = None) -> FlashOutput:
    """Returns FlashOutput(out, lse): split-K flash-decoding, each key slice its own program. Chapter 07.

    The kernel runs with a third grid dimension over num_splits slices of the keys and writes one
    partial (out, lse) per slice; combine_partials weighs them into the exact result.
    """
    from .tiled import combine_partials

    block_m, block_n = _check(q, k, v, None, block_m, block_n)
    outs, lses, _ = _launch(q, k, v, causal, None, scale, block_m, block_n, num_splits, False)
    if outs.dim() == 4:   # a single slice: already the final result
        return FlashOutput(outs, lses)
    out, lse = combine_partials(outs, lses)
    return FlashOutput(out.to(q.dtype), lse)


def flash_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                  mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The 'flash' attention backend: flash_attention's output alone, (B, H, T_q, D). Chapter 07."""
    return flash_attention(q, k, v, causal=causal, mask=mask, scale=scale).out
