"""Number formats side by side: bit layouts, ranges, steps and rounding error on real weights. Chapter 08.

Floating-point formats split their bits into sign, exponent and mantissa: the exponent sets the range,
the mantissa the relative step (so the error is relative to each value). Integer formats have one step
for a whole block, set by a scale (so the error is absolute within the block).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .weights import dequantize, quantize_tensor

__all__ = ["FloatFormat", "FLOAT_FORMATS", "bit_layout", "float_roundtrip", "format_table", "roundtrip"]


@dataclass(frozen=True)
class FloatFormat:
    """A floating-point format: its torch dtype and its bits. Chapter 08."""
    name: str
    dtype: torch.dtype
    exponent_bits: int
    mantissa_bits: int

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def max(self) -> float:
        """The largest finite value."""
        return float(torch.finfo(self.dtype).max)

    @property
    def relative_step(self) -> float:
        """The gap between 1 and the next value (machine epsilon): the relative rounding step."""
        return float(torch.finfo(self.dtype).eps)


FLOAT_FORMATS = {
    "fp32": FloatFormat("fp32", torch.float32, 8, 23),
    "bf16": FloatFormat("bf16", torch.bfloat16, 8, 7),
    "fp16": FloatFormat("fp16", torch.float16, 5, 10),
    "fp8 e4m3": FloatFormat("fp8 e4m3", torch.float8_e4m3fn, 4, 3),
    "fp8 e5m2": FloatFormat("fp8 e5m2", torch.float8_e5m2, 5, 2),
}

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bit_layout(value: float, name: str) -> str:
    """The bits of `value` stored in a float format, as 'sign exponent mantissa'. Chapter 08."""
    if name not in FLOAT_FORMATS:
        raise ValueError(f"unknown format {name!r}; choose one of {', '.join(FLOAT_FORMATS)}")
    fmt = FLOAT_FORMATS[name]
    stored = torch.tensor([value], dtype=torch.float32).to(fmt.dtype)
    element = stored.element_size()
    raw = int(stored.view(_INT_VIEW[element]).item()) & ((1 << (8 * element)) - 1)
    bits = format(raw, f"0{8 * element}b")
    return f"{bits[0]} {bits[1:1 + fmt.exponent_bits]} {bits[1 + fmt.exponent_bits:]}"


def float_roundtrip(weight: torch.Tensor, name: str, scaled: bool = True) -> torch.Tensor:
    """weight stored in a float format and read back as float32. Chapter 08.

    scaled=True first divides by one per-tensor scale that maps absmax to the format's largest value, as
    fp8 weights are stored in practice (the tiny weights would otherwise fall below fp8's normal range).
    """
    fmt = FLOAT_FORMATS[name]
    w = weight.detach().float()
    scale = (w.abs().amax() / fmt.max).clamp(min=1e-30) if scaled and fmt.bits == 8 else torch.tensor(1.0)
    return (w / scale).to(fmt.dtype).float() * scale


def roundtrip(weight: torch.Tensor, name: str) -> torch.Tensor:
    """weight through any format of the chapter's table (floats, int8 per channel, int4 per group of 32)."""
    if name in FLOAT_FORMATS:
        return float_roundtrip(weight, name)
    if name == "int8":
        return dequantize(quantize_tensor(weight, 8, "channel"))
    if name == "int4":
        return dequantize(quantize_tensor(weight, 4, "group", 32))
    raise ValueError(f"unknown format {name!r}; choose one of {', '.join([*FLOAT_FORMATS, 'int8', 'int4'])}")


def format_table(weight: torch.Tensor) -> list[dict]:
    """For each format: bits per weight, largest value, relative step, and the error on `weight`. Chapter 08."""
    w = weight.detach().float()
    rows = []
    for name in [*FLOAT_FORMATS, "int8", "int4"]:
        error = roundtrip(w, name) - w
        fmt = FLOAT_FORMATS.get(name)
        if fmt:
            bits = fmt.bits
        else:                                            # codes plus their float32 scales (and offsets)
            qt = quantize_tensor(w, 8, "channel") if name == "int8" else quantize_tensor(w, 4, "group", 32)
            bits = 8 * qt.nbytes / w.numel()
        rows.append({"format": name, "bits_per_weight": bits,
                     "max": fmt.max if fmt else (127 if name == "int8" else 15),
                     "relative_step": fmt.relative_step if fmt else None,
                     "rms_relative_error": float(error.pow(2).mean().sqrt() / w.pow(2).mean().sqrt()),
                     "max_abs_error": float(error.abs().max())})
    return rows
