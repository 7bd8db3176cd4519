"""Absmax and min–max quantization of a weight matrix, per tensor, per channel or per group. Chapter 08.

A b-bit integer code stands for a float by one affine map per block of weights:

    symmetric  (int8):        w ≈ q · scale,            q in [-(2^(b-1) - 1), 2^(b-1) - 1], scale = absmax / qmax
    asymmetric (int4/3/2):    w ≈ q · scale + offset,   q in [0, 2^b - 1],    scale = (max - min) / (2^b - 1), offset = min

The block is the whole tensor, one output row (a channel), or a group of `group_size` consecutive inputs
of one row. Rounding to the nearest code moves each weight by at most half a step (scale / 2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import is_int

__all__ = ["QuantizedTensor", "quantize_tensor", "dequantize", "qrange", "SUPPORTED_BITS", "SUPPORTED_GROUPS",
           "check_scheme"]

SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_GROUPS = (None, 32, 64, 128, 256)
_TINY = 1e-12        # the smallest scale: a block whose values are all equal still gets a usable step


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """Returns the (lowest, highest) integer code of a b-bit format. Chapter 08."""
    if symmetric:
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1     # int8: -127..127, so that 0 sits in the middle
    return 0, 2 ** bits - 1                                    # int4: 0..15


def check_scheme(bits, group_size, in_features: int | None = None, granularity: str | None = None) -> None:
    """Raise ValueError, before any compute, for a bit width or group size that cannot be used. Chapter 08."""
    if not is_int(bits) or bits not in SUPPORTED_BITS:
        raise ValueError(f"bits={bits!r} is not supported; choose one of {SUPPORTED_BITS} "
                         "(int8 per channel, int4/int3/int2 per group or per channel)")
    if granularity is not None and granularity not in ("tensor", "channel", "group"):
        raise ValueError(f"granularity={granularity!r} must be 'tensor', 'channel' or 'group'")
    if granularity == "group" or (granularity is None and group_size is not None):
        if not is_int(group_size) or group_size not in SUPPORTED_GROUPS[1:]:
            raise ValueError(f"group_size={group_size!r} is not supported; choose one of "
                             f"{', '.join(map(str, SUPPORTED_GROUPS[1:]))}, or None for one scale per output channel")
        if in_features is not None and in_features % group_size:
            raise ValueError(f"group_size={group_size} does not divide the input width {in_features} "
                             f"({in_features} = {in_features // group_size} × {group_size} + "
                             f"{in_features % group_size}); choose a group size that divides {in_features}, "
                             "e.g. 32 or 64, or None for per-channel scales")


@dataclass
class QuantizedTensor:
    """Integer codes of a (rows, cols) matrix with one scale (and offset) per block. Chapter 08."""
    codes: torch.Tensor            # (rows, cols) int8 (symmetric) or uint8 (asymmetric)
    scales: torch.Tensor           # (rows, n_blocks) float32; n_blocks = 1 per channel, cols // group per group
    offsets: torch.Tensor | None   # (rows, n_blocks) float32 block minimum, None when symmetric
    bits: int
    block: int                     # consecutive inputs that share one scale (cols for per channel)
    per_tensor: bool = False

    @property
    def step(self) -> torch.Tensor:
        """The distance between neighbouring codes, per weight (rows, cols)."""
        return self.scales.repeat_interleave(self.block, dim=1)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes packed at `bits` per weight, plus the float32 scales and offsets."""
        packed = (self.codes.numel() * self.bits + 7) // 8
        extra = 1 if self.per_tensor else self.scales.numel() * (1 if self.offsets is None else 2)
        return packed + 4 * extra


def _rounded_to(values: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """values rounded to the nearest values of dtype (kept in their own dtype); where rounding would give 0 or
    overflow (outside dtype's range), the value is kept."""
    if dtype is None:
        return values
    rounded = values.to(dtype).to(values.dtype)
    return torch.where(torch.isfinite(rounded) & ((rounded != 0) | (values == 0)), rounded, values)


def quantize_tensor(weight: torch.Tensor, bits: int = 8, granularity: str = "channel", group_size: int | None = None,
                    symmetric: bool | None = None, terms_dtype: torch.dtype | None = None) -> QuantizedTensor:
    """Returns the b-bit codes of weight (rows, cols), rounded to the nearest step, and their scales. Chapter 08.

    granularity: 'tensor' (one scale), 'channel' (one per output row) or 'group' (one per group_size inputs).
    symmetric defaults to True for 8 bits (absmax) and False below (min–max with an offset).
    terms_dtype (e.g. torch.float16, as GGUF stores them): scales and offsets are rounded to values of that dtype
    before the codes are chosen, so the codes fit the terms as kept; a value outside its range stays as it is.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"quantize_tensor takes a 2-D (out_features, in_features) weight, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if granularity == "group" and group_size is None:
        raise ValueError("granularity='group' needs a group_size, e.g. 32")
    check_scheme(bits, group_size if granularity == "group" else None, weight.shape[1], granularity)
    symmetric = bits == 8 if symmetric is None else symmetric
    rows, cols = weight.shape
    w = weight.detach().float()
    block = {"tensor": cols, "channel": cols, "group": group_size}[granularity]
    blocks = w.reshape(rows, cols // block, block)                               # (rows, n_blocks, block)
    lo, hi = qrange(bits, symmetric)
    if symmetric:
        absmax = blocks.abs().amax(-1) if granularity != "tensor" else w.abs().amax().expand(rows, 1)
        scales = _rounded_to((absmax / hi).clamp(min=_TINY), terms_dtype)        # (rows, n_blocks)
        codes = torch.round(blocks / scales[..., None]).clamp(lo, hi).to(torch.int8)
        offsets = None
    else:
        if granularity == "tensor":
            low, high = w.amin().expand(rows, 1), w.amax().expand(rows, 1)
        else:
            low, high = blocks.amin(-1), blocks.amax(-1)                         # (rows, n_blocks)
        scales = _rounded_to(((high - low) / hi).clamp(min=_TINY), terms_dtype)
        offsets = _rounded_to(low.clone(), terms_dtype)
        codes = torch.round((blocks - offsets[..., None]) / scales[..., None]).clamp(lo, hi).to(torch.uint8)
    return QuantizedTensor(codes.reshape(rows, cols), scales.contiguous(), offsets, bits, block,
                           per_tensor=granularity == "tensor")


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Returns the float weights (rows, cols) that the codes stand for: q · scale (+ offset). Chapter 08."""
    rows, cols = qt.codes.shape
    blocks = qt.codes.reshape(rows, cols // qt.block, qt.block).float()
    w = blocks * qt.scales[..., None]
    if qt.offsets is not None:
        w = w + qt.offsets[..., None]
    return w.reshape(rows, cols).to(dtype)
