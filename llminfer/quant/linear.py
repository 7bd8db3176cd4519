"""Weight-only quantized linear layers and `quantize(model, ...)`, the module transform. Chapter 08.

`quantize` replaces every `nn.Linear` of a model, in place, by a `QuantizedLinear` that holds its weight as
integer codes with float scales, the way gpt-fast does; the model's forward does not change. Activations
stay in the model's dtype: only the bytes of the weights shrink, which is what a memory-bound decode step
reads.

    int8   one scale per output channel, symmetric:          w = q · scale,              q in -127..127
    int4   one scale and zero point per group of inputs:     w = (q - 8) · scale + zero, q in 0..15
    int3, int2 the same with 2^b levels (for the accuracy study; dequantized on the fly)

Kernels, for a few tokens (a decode step):
* `native` (CPU, int8 per channel or per group, as GGUF's Q8_0, and int4): llminfer's own matrix-vector loops
  (`llminfer.cpu`), which read the canonical codes as they are and widen them in registers. `auto`
  takes it wherever it builds. With `activations="int8"` (int4 only, W4A8) the native kernel rounds each block
  of 32 inputs of x to int8 and multiplies in integers (maddubs, or VNNI's vpdpbusd), as llama.cpp's Q4_0 dot
  product does: faster, and it changes the numbers (chapter 08 measures by how much).
* `packed`: torch's `_weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` (weights repacked once, at
  quantize or load time). `kernel="packed"` insists on it and refuses, before any work, a device without it.
* `dequantize`: the weight is dequantized to the model's dtype on the fly; the same numbers, more slowly.
Longer inputs (a prefill) dequantize once and run one float matmul.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..generate import check_flag
from .. import cpu as native_cpu
from ..moe import MoEFeedForward
from .weights import check_scheme, quantize_tensor

__all__ = ["QuantizedLinear", "quantize", "quantization_targets", "SCHEMES", "KERNELS", "has_kernel",
           "quantized_modules", "quantized_weight_bytes"]

SCHEMES = {"int8": 8, "int4": 4, "int3": 3, "int2": 2}
KERNELS = ("auto", "native", "packed", "dequantize")
ACTIVATIONS = ("float", "int8")                # int8: W4A8 on the native kernel (changes the numbers)
_INT4_KERNEL_GROUPS = (256, 128, 64, 32)       # the group sizes `_weight_int4pack_mm_for_cpu` takes
# The packed and native kernels are matrix-vector products: past a few rows (a prefill) one dequantization
# and a float matmul is far faster, so longer inputs take that path.
KERNEL_MAX_TOKENS = native_cpu.MAX_TOKENS


def has_kernel(bits: int, device: torch.device | str) -> bool:
    """Whether this torch has a packed low-precision matmul for `bits`-bit weights on device. Chapter 08."""
    device_type = torch.device(device).type
    if bits == 8:
        return device_type in ("cpu", "cuda") and hasattr(torch.ops.aten, "_weight_int8pack_mm")
    if bits == 4:
        return device_type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    return False


def _int4_kernel_group(in_features: int, group_size: int | None) -> int | None:
    """The group the int4 kernel runs with: group_size, or for one scale per channel the widest group
    that divides in_features (the scale repeated over each group of the row)."""
    if group_size is not None:
        return group_size if group_size in _INT4_KERNEL_GROUPS else None
    return next((g for g in _INT4_KERNEL_GROUPS if in_features % g == 0), None)


def _native_fits(bits: int, group_size: int | None, in_features: int, device) -> bool:
    """Whether llminfer's native CPU kernel takes this layer (building the kernels if need be)."""
    if torch.device(device).type != "cpu":
        return False
    shape_ok = (group_size is None or group_size % 16 == 0) if bits == 8 else bits == 4 and in_features % 32 == 0
    return shape_ok and native_cpu.available()


def choose_kernel(bits: int, group_size: int | None, in_features: int, out_features: int, device,
                  kernel: str) -> str:
    """'native', 'int8pack', 'int4pack' or 'dequantize' for a layer; ValueError if kernel='packed' or
    'native' cannot be had. Chapter 08."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    if kernel in ("auto", "native") and bits in (8, 4) and _native_fits(bits, group_size, in_features, device):
        return "native"
    if kernel == "native":
        why = (f"it is unavailable here ({native_cpu.why_unavailable()})" if torch.device(device).type == "cpu"
               and bits in (8, 4) and native_cpu.why_unavailable() else
               "it takes int8 per channel or in groups, and int4 with in_features a multiple of 32, on a CPU")
        raise ValueError(f"no native kernel for a ({out_features} x {in_features}) int{bits} weight"
                         f"{'' if group_size is None else f' in groups of {group_size}'} on {torch.device(device)}: "
                         f"{why}; pass kernel='auto' to use torch's kernels or dequantize on the fly")
    available = has_kernel(bits, device)
    if bits == 4:
        available = available and _int4_kernel_group(in_features, group_size) is not None \
            and in_features % 32 == 0 and out_features % 16 == 0
    if bits == 8:
        available = available and group_size is None
    if kernel == "packed" and not available:
        raise ValueError(f"no packed int{bits} kernel for a ({out_features} x {in_features}) weight on "
                         f"{torch.device(device)} in this torch {torch.__version__}"
                         f"{' (the int4 kernel runs on CPU only)' if bits == 4 else ''}; pass kernel='auto' "
                         "to dequantize on the fly instead, or load on a CPU")
    if kernel == "dequantize" or not available:
        return "dequantize"
    return "int8pack" if bits == 8 else "int4pack"


_choose_kernel = choose_kernel


def _check_activations(activations: str, bits: int, group_size: int | None, kernel: str) -> None:
    """ValueError, before any compute, for activations other than 'float' and 'int8', or 'int8' off int4."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations={activations!r} must be one of {ACTIVATIONS}")
    if activations == "int8" and (bits != 4 or kernel in ("packed", "dequantize")):
        raise ValueError(f"activations='int8' (W4A8) is for int4 weights on the native kernel; got int{bits} with "
                         f"kernel={kernel!r}. Pass scheme='int4' with kernel='auto' or 'native', or "
                         "activations='float'")


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes 0..15 -> (N, K/2) uint8: the even column in the low nibble, the odd one in the high."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) codes 0..15 (uint8)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


_PACK_ORDERS: dict[tuple, torch.Tensor] = {}


def _int4_pack_order(out_features: int, in_features: int, device) -> torch.Tensor:
    """For each 4-bit slot of the kernel's packed (N, K/2) layout, the flat index n·K + k it holds.

    The layout is the kernel's own (it differs between CPU instruction sets). Packing the base-16 digits
    of every weight's own index, one digit at a time, reads it off without knowing it.
    """
    key = (out_features, in_features, str(device))
    if key not in _PACK_ORDERS:
        total = out_features * in_features
        index = torch.arange(total, dtype=torch.int64, device=device)
        order = torch.zeros(total, dtype=torch.int64, device=device)
        place = 1
        while place < total:
            digit = ((index // place) % 16).to(torch.int32).view(out_features, in_features)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(digit, 2)
            order += _unpack_nibbles(packed).reshape(-1).long() * place
            place *= 16
        if not torch.equal(torch.bincount(order, minlength=total), torch.ones(total, dtype=torch.int64,
                                                                                device=device)):
            raise RuntimeError("this torch's int4 packing is not a permutation of the codes; save with "
                               "kernel='dequantize' layers instead")
        _PACK_ORDERS[key] = order
    return _PACK_ORDERS[key]


def _half_terms(scale: torch.Tensor, offset: torch.Tensor, zeros: torch.Tensor | None, bits: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The native kernel's int4 terms (float32 scale and offset, w = q·scale + offset) as float16, where that
    changes nothing: every scale a float16 value, and every offset one, or one that gives back the layer's own
    zero point (zero = offset + 2^(b-1)·scale, as the layer rounds it). None otherwise (the terms stay float32)."""
    s16, o16 = scale.half(), offset.half()
    if not torch.equal(s16.float(), scale) or not torch.isfinite(o16).all():
        return None
    if not torch.equal(o16.float(), offset):
        if zeros is None or zeros.dtype != torch.float32 or \
                not torch.equal(o16.float() + 2 ** (bits - 1) * scale, zeros):
            return None
    return s16.contiguous(), o16.contiguous()


class QuantizedLinear(nn.Module):
    """y = x · Wᵀ (+ bias) with W held as b-bit integer codes and float scales. Chapter 08.

    Held as canonical data (what a checkpoint stores): `codes` (N, K) ints, `scales` (N, n_groups) and, for
    the asymmetric formats, `zeros` (N, n_groups), all in the model's dtype; w = q·scale for int8 and
    w = (q - 2^(b-1))·scale + zero below. The kernel keeps them in its own packed layout.

    A format stored as w = q·scale + minimum (GGUF's Q4_1) passes `offsets` (the minimums) instead of zeros: the
    layer then computes exactly q·scale + offset, with zero = offset + 2^(b-1)·scale kept for the checkpoint and
    the packed kernel (one rounding there).
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int | None,
                 codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bias: torch.Tensor | None = None, kernel: str = "auto", offsets: torch.Tensor | None = None,
                 activations: str = "float"):
        super().__init__()
        check_scheme(bits, group_size, in_features)
        _check_activations(activations, bits, group_size, kernel)
        if offsets is not None:
            if bits == 8 or zeros is not None:
                raise ValueError("offsets (w = q·scale + offset) are for the asymmetric formats and replace zeros; "
                                 f"got bits={bits} with{'' if zeros is None else ' zeros and'} offsets")
            zeros = offsets + 2 ** (bits - 1) * scales
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.kernel = _choose_kernel(bits, group_size, in_features, out_features, codes.device, kernel)
        self.kernel_request = kernel           # what was asked for ('auto', 'packed', 'dequantize')
        if activations == "int8" and self.kernel != "native":
            raise ValueError(f"activations='int8' runs on the native CPU kernel only, and this ({out_features} x "
                             f"{in_features}) layer on {codes.device} gets kernel={self.kernel!r}; pass "
                             "activations='float', or load on a CPU where the native kernels build")
        self.activations = activations
        n_groups = 1 if group_size is None else in_features // group_size
        if tuple(codes.shape) != (out_features, in_features) or tuple(scales.shape) != (out_features, n_groups):
            raise ValueError(f"codes {tuple(codes.shape)} and scales {tuple(scales.shape)} do not fit a "
                             f"({out_features} x {in_features}) int{bits} weight with {n_groups} group(s) per row")
        self.dtype = scales.dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        if self.kernel == "int8pack":
            self.register_buffer("qweight", codes.to(torch.int8).contiguous())             # (N, K) int8
            self.register_buffer("scales", scales[:, 0].contiguous())                      # (N,)
        elif self.kernel == "int4pack":
            kernel_group = _int4_kernel_group(in_features, group_size)
            repeat = (in_features // kernel_group) // n_groups       # per channel: the scale over every group
            scale_k = scales.repeat_interleave(repeat, dim=1)        # (N, K / kernel_group)
            zero_k = zeros.repeat_interleave(repeat, dim=1)
            self.kernel_group = kernel_group
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32).contiguous(), 2))                                    # opaque packed uint8
            self.register_buffer("scales_and_zeros", torch.stack((scale_k, zero_k), dim=-1)
                                 .transpose(0, 1).contiguous())                            # (K / G, N, 2)
        else:
            stored = _pack_nibbles(codes) if bits == 4 else codes.to(torch.int8 if bits == 8 else torch.uint8)
            self.register_buffer("qweight", stored.contiguous())    # (N, K), (N, K/2) nibbles for int4 (tiled below)
            self.register_buffer("scales", scales.contiguous())     # (N, n_groups)
            self.register_buffer("zeros", None if zeros is None else zeros.contiguous())
        self.register_buffer("offsets", None if offsets is None or self.kernel == "int4pack" else
                             offsets.contiguous())                  # (N, n_groups): w = q·scale + offset exactly
        if self.kernel == "native":
            # the kernel's float32 terms: w = q·scale (int8) or q·scale + offset, offset = zero - 8·scale (int4)
            scale32 = scales.float()
            self.kernel_group = in_features if group_size is None else group_size
            self.register_buffer("kernel_scale", (scale32[:, 0] if bits == 8 and group_size is None else
                                                  scale32).contiguous(), persistent=False)
            self.register_buffer("kernel_offset", None if bits == 8 else offsets.float().contiguous()
                                 if offsets is not None else
                                 (zeros.float() - 2 ** (bits - 1) * scale32).contiguous(), persistent=False)
            if bits == 4:
                # int4 in tiles of 8 rows, the layout the kernels read (native_cpu.tile_int4: N padded to a multiple
                # of 8, the extra outputs cut off after each product), with the terms in float16 where they are
                # float16 values (as `quantize` makes them, and GGUF stores them)
                terms = _half_terms(self.kernel_scale, self.kernel_offset, zeros, bits)
                self.qweight, self.kernel_scale, self.kernel_offset = native_cpu.tile_int4(
                    self.qweight, *(terms or (self.kernel_scale, self.kernel_offset)))

    # --- building ------------------------------------------------------------------------------------

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int | None = None,
                    kernel: str = "auto", activations: str = "float") -> "QuantizedLinear":
        """Quantizes an nn.Linear's weight (absmax for int8, min–max per group below). Chapter 08."""
        weight = linear.weight
        granularity = "channel" if group_size is None else "group"
        # int4's scales and minimums are rounded to float16 values before the codes are chosen, as GGUF's Q4_1
        # keeps them: the native kernel then reads 2 bytes a term instead of 4 (20 bytes a group of 32, not 24)
        qt = quantize_tensor(weight, bits, granularity, group_size,
                             terms_dtype=torch.float16 if bits == 4 else None)
        dtype = weight.dtype
        if bits == 8:
            zeros = None
            scales = qt.scales.to(dtype)
        else:
            middle = 2 ** (bits - 1)
            scales = qt.scales.to(dtype)
            zeros = (qt.offsets + middle * qt.scales).to(dtype)      # w = (q - middle) · scale + zero
        return cls(linear.in_features, linear.out_features, bits, group_size, qt.codes, scales, zeros,
                   linear.bias, kernel, activations=activations)

    @classmethod
    def from_state(cls, state: dict, bits: int, group_size: int | None, kernel: str = "auto",
                   device=None, activations: str = "float") -> "QuantizedLinear":
        """Rebuilds a layer from `state()` (codes as stored in a checkpoint). Chapter 08."""
        codes = state["qweight"]
        if device is not None:
            state = {name: None if t is None else t.to(device) for name, t in state.items()}
            codes = state["qweight"]
        if bits == 4:
            codes = _unpack_nibbles(codes)
        out_features, in_features = codes.shape
        return cls(in_features, out_features, bits, group_size, codes, state["scales"], state.get("zeros"),
                   state.get("bias"), kernel, activations=activations)

    @staticmethod
    def concat(layers: list["QuantizedLinear"], kernel: str = "auto") -> "QuantizedLinear":
        """One layer whose output rows are those of `layers` in turn (fused q/k/v, gate/up). Chapter 08."""
        first = layers[0]
        if any((l.bits, l.group_size, l.in_features, l.dtype, l.activations) !=
               (first.bits, first.group_size, first.in_features, first.dtype, first.activations) for l in layers):
            raise ValueError("only layers of one format, group size, input width, dtype and activations can be fused")
        states = [l.state() for l in layers]
        merged = {name: None if states[0][name] is None else torch.cat([s[name] for s in states])
                  for name in states[0]}
        if any(s["bias"] is None for s in states):
            merged["bias"] = None if all(s["bias"] is None for s in states) else torch.cat(
                [s["bias"] if s["bias"] is not None else torch.zeros(l.out_features, dtype=first.dtype,
                                                                     device=l.qweight.device)
                 for s, l in zip(states, layers)])
        return QuantizedLinear.from_state(merged, first.bits, first.group_size, kernel,
                                          activations=first.activations)

    # --- reading back --------------------------------------------------------------------------------

    @torch.no_grad()
    def codes(self) -> torch.Tensor:
        """The integer codes (N, K): int8 for int8, 0..2^b-1 (uint8) below."""
        if self.kernel == "int4pack":
            nibbles = _unpack_nibbles(self.qweight).reshape(-1)          # in the kernel's packed order
            codes = torch.empty_like(nibbles)
            codes[_int4_pack_order(self.out_features, self.in_features, self.qweight.device)] = nibbles
            return codes.view(self.out_features, self.in_features)      # (N, K)
        if self.bits == 4:
            nibbles = self.qweight
            if nibbles.dim() == 3:                                       # tiles of 8 rows
                nibbles = native_cpu.untile_int4(nibbles, self.kernel_scale, self.kernel_offset)[0][:self.out_features]
            return _unpack_nibbles(nibbles)
        return self.qweight

    def scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scales, zeros) as (N, n_groups) in the layer's dtype (zeros None for int8)."""
        if self.kernel == "int8pack":
            return self.scales[:, None], None
        if self.kernel == "int4pack":
            n_groups = 1 if self.group_size is None else self.in_features // self.group_size
            step = self.scales_and_zeros.shape[0] // n_groups
            picked = self.scales_and_zeros[::step].transpose(0, 1)    # (N, n_groups, 2)
            return picked[..., 0].contiguous(), picked[..., 1].contiguous()
        return self.scales, self.zeros

    def state(self) -> dict:
        """The canonical tensors a checkpoint stores: qweight (int4 as nibbles), scales, zeros, bias."""
        codes = self.codes()
        scales, zeros = self.scales_zeros()
        return {"qweight": _pack_nibbles(codes) if self.bits == 4 else codes.contiguous(),
                "scales": scales, "zeros": zeros,
                "bias": None if self.bias is None else self.bias.detach()}

    @torch.no_grad()
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight (N, K) that the codes stand for, in dtype (default: the layer's)."""
        scales, zeros = self.scales_zeros()
        n_groups = scales.shape[1]
        codes = self.codes().float().reshape(self.out_features, n_groups, -1)
        if zeros is None:
            w = codes * scales.float()[..., None]
        elif self.offsets is not None:
            w = codes * scales.float()[..., None] + self.offsets.float()[..., None]
        else:
            w = (codes - 2 ** (self.bits - 1)) * scales.float()[..., None] + zeros.float()[..., None]
        return w.reshape(self.out_features, self.in_features).to(dtype or self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads: codes at `bits` per weight plus scales, zeros and bias."""
        n_groups = 1 if self.group_size is None else self.in_features // self.group_size
        element = torch.empty((), dtype=self.dtype).element_size()
        if self.kernel == "native" and self.bits == 4:          # the terms as the kernel keeps them
            element = self.kernel_scale.element_size()
        per_group = 1 if self.bits == 8 else 2
        bias = 0 if self.bias is None else self.bias.numel() * element
        return self.out_features * self.in_features * self.bits // 8 + \
            self.out_features * n_groups * per_group * element + bias

    # --- the product ---------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)                                            # (tokens, K)
        few = x2.shape[0] <= KERNEL_MAX_TOKENS        # decode: the matrix-vector kernels
        native = self.kernel == "native" and x2.device.type == "cpu"
        if native and (few or native_cpu.blocked_prefill(self.qweight.dtype, x2.shape[0])):
            # (.to(): a no-op unless the model was cast after quantizing, which casts these buffers too)
            terms = self._kernel_terms_dtype()
            offset = None if self.kernel_offset is None else self.kernel_offset.to(terms)
            y = native_cpu.gemv(x2, self.qweight, self.kernel_scale.to(terms), offset, self.kernel_group,
                                activations=self.activations if few else "float")[:, :self.out_features]
        elif self.kernel == "int8pack" and few:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scales)         # (tokens, N)
        elif self.kernel == "int4pack" and few:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.kernel_group,
                                                           self.scales_and_zeros)        # (tokens, N)
        elif self.kernel != "dequantize":              # prefill: dequantize once, then one float matmul
            y = F.linear(x2, self.dequantized_weight(x2.dtype))
        elif self.bits == 8 and self.scales.shape[1] == 1:
            y = F.linear(x2, self.qweight.to(x2.dtype)) * self.scales[:, 0]              # scale per output
        else:
            y = F.linear(x2, self._dequantize_fallback(x2.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _kernel_terms_dtype(self) -> torch.dtype:
        """float16 for int4 tiles whose terms the layer made float16, float32 otherwise (the native kernel's)."""
        return torch.float16 if self.qweight.dim() == 3 and self.kernel_scale.dtype != torch.float32 else torch.float32

    def _dequantize_fallback(self, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantized_weight(dtype)

    def extra_repr(self) -> str:
        group = "per channel" if self.group_size is None else f"group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, {group}, "
                f"kernel={self.kernel}, dtype={str(self.dtype).removeprefix('torch.')}"
                + (", activations=int8" if self.activations == "int8" else ""))


def quantized_modules(model: nn.Module) -> dict[str, QuantizedLinear]:
    """name -> QuantizedLinear for every quantized layer of model. Chapter 08."""
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: quantized layers at their bits, float matrices in full, one
    embedding row (an untied table is only gathered). Chapter 08."""
    total = sum(m.nbytes for m in quantized_modules(model).values())
    seen = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding):                   # one row gathered per token
            total += module.weight.shape[1] * module.weight.element_size()
    for module in model.modules():
        if isinstance(module, (nn.Embedding, QuantizedLinear)):
            continue
        for param in module.parameters(recurse=False):     # a tied float head is read in full, once
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel() * param.element_size()
    return total


def quantization_targets(model: nn.Module, include_head: bool = True) -> list[tuple[str, nn.Linear]]:
    """(name, layer) for each nn.Linear that `quantize` replaces: all of them but the head with include_head=False,
    and never an MoE layer's router or shared-expert gate, whose rounding would change which experts a token goes
    to. Chapters 08 and 14."""
    gates = {id(gate) for moe in model.modules() if isinstance(moe, MoEFeedForward)
             for gate in (moe.router, moe.shared_expert_gate) if gate is not None}
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and (include_head or name != "lm_head") and id(module) not in gates]


def _parse_scheme(scheme) -> int:
    if isinstance(scheme, str) and scheme.lower() in SCHEMES:
        return SCHEMES[scheme.lower()]
    raise ValueError(f"scheme={scheme!r} is not supported; choose one of {', '.join(SCHEMES)} "
                     "(int8 per channel; int4, int3, int2 per group or per channel)")


@torch.no_grad()
def quantize(model: nn.Module, scheme: str = "int8", group_size: int | None = None, kernel: str = "auto",
             include_head: bool = True, activations: str = "float") -> nn.Module:
    """Replaces each nn.Linear of model in place by a QuantizedLinear; returns the model. Chapter 08.

    scheme: 'int8' (one scale per output channel), 'int4', 'int3' or 'int2' (group-wise scales and zero
    points with group_size 32, 64, 128 or 256, or one per channel with None). include_head=False keeps the
    output head in floating point. activations='int8' (int4, native CPU kernel) is W4A8: x rounded to int8 per
    block of 32 in decode steps, integer dot products; it changes the numbers. Everything is checked before any
    layer is touched. An MoE layer's router and shared-expert gate stay in floating point (rounding the router's
    scores would change which experts a token goes to, for a matrix a fraction of the layer's bytes), and so do
    its experts, 3-D weights rather than nn.Linear layers (chapter 14).
    """
    bits = _parse_scheme(scheme)
    check_flag("include_head", include_head)
    if bits == 8 and group_size is not None:
        raise ValueError(f"int8 uses one scale per output channel; got group_size={group_size}. "
                         "Pass group_size=None, or choose int4 for group-wise scales")
    check_scheme(bits, group_size)
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} must be one of {KERNELS}")
    _check_activations(activations, bits, group_size, kernel)
    already = quantized_modules(model)
    if already or getattr(model, "quantization", None):
        first = next(iter(already), "the model")
        raise ValueError(f"the model is already quantized ({first} is a QuantizedLinear); quantizing twice would "
                         "round rounded weights again. Load or build the float model and quantize it once")
    targets = quantization_targets(model, include_head)
    for name, module in targets:                                   # every check before the first change
        check_scheme(bits, group_size, module.in_features)
        if module.weight.device.type == "meta":
            raise ValueError(f"{name} has no weights yet (meta device); load the model first")
        chosen = _choose_kernel(bits, group_size, module.in_features, module.out_features, module.weight.device,
                                kernel)
        if activations == "int8" and chosen != "native":
            raise ValueError(f"activations='int8' runs on the native CPU kernel only, and {name} on "
                             f"{module.weight.device} gets kernel={chosen!r}; pass activations='float', or "
                             "quantize on a CPU where the native kernels build")
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantizedLinear.from_linear(module, bits, group_size, kernel, activations))
    model.quantization = {"scheme": f"int{bits}", "bits": bits, "group_size": group_size,
                          "include_head": include_head}
    if activations != "float":
        model.quantization["activations"] = activations
    return model
