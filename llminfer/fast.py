"""Decode at the memory-bandwidth limit: fused projections and a compiled one-token step. Chapter 08.

A decode step on a CPU reads every weight once and does little else, so its speed is set by how close
it streams the weights to the machine's bandwidth. Two changes get it close, without touching the
model's forward or its checkpoint format:

* `fuse_projections(model)`, a module transform: each layer's q, k and v projections become one
  (dim → (H + 2·H_kv)·D) matrix and gate and up one (dim → 2·hidden) matrix, made from the loaded weights.
  Fewer, larger matrix–vector products: one pass over x instead of three, fewer kernel launches. The fused
  modules call the same cache protocol (`cache.attend`) and give the same numbers as the unfused ones.
* `compile_decode(model)`: a `StaticDecoder` (`llminfer.cuda_graphs`) whose one-token step is the model's own
  forward over a static KV cache (the one CUDA graphs use), compiled by `torch.compile` (inductor); the caller
  passes it to the token loop, `llminfer.generate(model, ids, step=decoder)`. With `freeze=True` inductor
  takes the weights as constants and prepacks them for its matmul kernels, and the whole step's small
  element-wise work (norms, RoPE, SwiGLU, the cache write) fuses into a few loops. Compiling takes tens of
  seconds; inductor's on-disk cache makes a second compile of the same model in a new process faster.

Quantized layers (`llminfer.quant.quantize`) are fused too, and run their packed int8/int4 kernels
inside the compiled step.

On a CPU, `use_native_kernels(model)` (which `compile_decode` and `optimize_decode` apply) goes further, in
three module swaps that keep every parameter name: each float linear becomes a `NativeLinear` (llminfer's
own matrix-vector kernels), each decoder layer a `NativeDecoderLayer` (norms, products, RoPE, the cache
write, attention and SwiGLU in one native call) and the layer stack a `NativeDecoderStack` (every layer in
one call). A decode step then leaves Python once for the whole stack instead of a dozen times a layer.
A prefill takes the same call, its products then done by a blocked matrix-matrix kernel that outruns
torch's matmul at a prefill's shapes (in bfloat16 several times over). Anything the one call cannot take
(autograd, another cache or attention backend, a CPU without AVX2 for a prefill) runs the modules, so the
model's forward stays the one forward. The weights are also moved onto 2 MiB pages (`use_huge_pages`),
which stream faster.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from .checkpoint import load_random
from .config import get_preset
from .cuda_graphs import StaticDecoder
from .device import huge_page_empty, on_huge_pages
from . import cpu as native_cpu
from .model import MLP, Attention, DecoderLayer, DecoderStack, RMSNorm, apply_rope
from .quant.linear import QuantizedLinear, quantize

__all__ = ["FusedAttention", "FusedMLP", "fuse_projections", "is_fused", "NativeLinear", "NativeDecoderLayer",
           "NativeDecoderStack", "use_native_kernels", "use_huge_pages",
           "uses_native_kernels", "optimize_decode", "compile_decode", "prefill_probe",
           "settle_prefill_paths"]


def _concat_linears(layers: list[nn.Module]) -> nn.Module:
    """One layer computing the outputs of `layers` side by side (their weights stacked by rows)."""
    if all(type(layer) is nn.Linear for layer in layers):
        first = layers[0]
        has_bias = [layer.bias is not None for layer in layers]
        # made on the meta device (no random init to throw away: that cost seconds at a server's start)
        fused = nn.Linear(first.in_features, sum(layer.out_features for layer in layers), bias=any(has_bias),
                          device="meta", dtype=first.weight.dtype)
        with torch.no_grad():
            stacked = torch.cat([layer.weight for layer in layers])                   # (sum of outputs, in)
            if stacked.shape[0] > stacked.shape[1] and stacked.device.type == "cpu" and stacked.dtype == torch.float32:
                # wide float32: stored column-major, as use_decode_layout() does (bfloat16 would pay a
                # reorder of the whole matrix in every call for it, about 4x slower here)
                stacked = stacked.t().contiguous().t()
            fused.weight = nn.Parameter(stacked, requires_grad=False)
            if any(has_bias):
                fused.bias = nn.Parameter(torch.cat([layer.bias if layer.bias is not None
                                                     else torch.zeros(layer.out_features, dtype=first.weight.dtype,
                                                                      device=first.weight.device) for layer in layers]),
                                          requires_grad=False)
        return fused
    if all(isinstance(layer, QuantizedLinear) for layer in layers):
        return QuantizedLinear.concat(layers, kernel=layers[0].kernel_request)
    kinds = sorted({type(layer).__name__ for layer in layers})
    raise ValueError(f"cannot fuse projections of different kinds {kinds}; fuse before or after quantizing "
                     "all of them, not some")


class FusedAttention(nn.Module):
    """Attention with q, k and v computed by one matrix; same cache protocol and numbers. Chapter 08."""

    def __init__(self, attention: Attention):
        super().__init__()
        self.layer_idx = attention.layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = attention.n_heads, attention.n_kv_heads, attention.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv_heads * self.head_dim
        self.qkv_proj = _concat_linears([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = attention.o_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, backend) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        qkv = self.qkv_proj(x)                                                   # (B, T, (H + 2·H_kv)·D)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(batch, seq_len, self.n_heads, self.head_dim).transpose(1, 2)     # (B, H, T, D)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)   # the cache stores keys *after* RoPE
        if cache is not None:
            out = cache.attend(self.layer_idx, q, k, v, backend)  # writes k, v; attends over the whole prefix
        else:
            out = backend(q, k, v, causal=True)                   # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq_len, self.q_size))


class FusedMLP(nn.Module):
    """SwiGLU with gate and up computed by one matrix: down(silu(gate) · up). Chapter 08."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.hidden_dim = mlp.gate_proj.out_features
        self.gate_up_proj = _concat_linears([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.hidden_dim, dim=-1)      # (B, T, hidden) each
        return self.down_proj(F.silu(gate) * up)


def is_fused(model: nn.Module) -> bool:
    """Whether fuse_projections has been applied to model. Chapter 08."""
    return any(isinstance(m, (FusedAttention, FusedMLP)) for m in model.modules())


@torch.no_grad()
def fuse_projections(model: nn.Module) -> nn.Module:
    """Replaces each layer's attention and MLP by fused equivalents, in place; returns model. Chapter 08.

    Applying it twice changes nothing. The parameter names change (qkv_proj, gate_up_proj);
    `llminfer.quant.save_pretrained` writes them back under the checkpoint's own names.
    """
    for layer in getattr(model, "layers", []):
        if isinstance(layer.self_attn, Attention):
            layer.self_attn = FusedAttention(layer.self_attn)
        if isinstance(layer.mlp, MLP):
            layer.mlp = FusedMLP(layer.mlp)
    return model


class NativeLinear(nn.Linear):
    """An nn.Linear whose few-token products run llminfer's native matrix-vector kernel. Chapter 08.

    Same parameters, names and numbers as the nn.Linear it was (the class is swapped in place, so tied
    weights stay tied). On a CPU, x goes to `llminfer.cpu.gemv`: its matrix-vector loops for up to
    `cpu.MAX_TOKENS` rows (a decode step), its blocked kernel for more (a prefill) where the CPU has
    AVX2; other devices, autograd and a prefill without the blocked kernel use F.linear.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // self.in_features if self.in_features else 0
        if (x.device.type != "cpu" or tokens == 0 or x.dtype != self.weight.dtype
                or (tokens > native_cpu.MAX_TOKENS and not native_cpu.blocked_prefill(self.weight.dtype, tokens))
                or not self.weight.is_contiguous()
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        y = native_cpu.gemv(x.reshape(tokens, self.in_features), self.weight)            # (tokens, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _native_parts(linear: nn.Module, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """A linear as the native kernels take it: [weight], [int8 codes, scale] or [int4 nibbles, scale, offset];
    None when it has no native kernel for activations of `dtype`."""
    if isinstance(linear, NativeLinear):
        weight = linear.weight
        return [weight] if weight.dtype == dtype and weight.is_contiguous() else None
    if isinstance(linear, QuantizedLinear) and linear.kernel == "native" and \
            linear.kernel_scale.dtype == linear._kernel_terms_dtype():
        parts = [linear.qweight, linear.kernel_scale]
        if linear.bits == 8:
            return parts
        # W4A8: a fourth tensor marks int8 activations for the native layer calls. It is the codes again: a tensor
        # made for the purpose (a slice, a small buffer) is one a compiled step materialises anew at every step
        return parts + [linear.kernel_offset] + ([linear.qweight] if linear.activations == "int8" else [])
    return None


def _weight_dtype(layer: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype a fused layer's q/k/v weight is held in (uint8 for int4, int8 for int8; x's for float layers), the
    key of its measured prefill path."""
    qkv = getattr(getattr(layer, "self_attn", None), "qkv_proj", None)
    weight = getattr(qkv, "qweight", None)
    if weight is None:
        weight = getattr(qkv, "weight", None)
    return x.dtype if weight is None else weight.dtype


def _step_fits(x: torch.Tensor, cos: torch.Tensor, backend, weight_dtype: torch.dtype | None = None) -> str | None:
    """Whether a step's input can take the one-call path at all (the same for every layer of the step):
    'decode' for up to MAX_TOKENS tokens, 'prefill' for more where the blocked kernel runs for weights of
    `weight_dtype` (default x's), else None."""
    if not (backend is native_cpu.attention_backend and native_cpu.loaded() and x.device.type == "cpu"
            and x.dim() == 3 and x.dtype in (torch.float32, torch.bfloat16) and cos.dim() == 2
            and cos.dtype == x.dtype and not (torch.is_grad_enabled() and x.requires_grad)):
        return None
    if x.shape[0] * x.shape[1] <= native_cpu.MAX_TOKENS:
        return "decode"
    rows = x.shape[0] * x.shape[1]
    return "prefill" if native_cpu.blocked_prefill(weight_dtype or x.dtype, rows) else None


class _OneNativeCall:
    """The forward of a module swapped for a native one: the op named `op` with `_native_args(...)` where they
    allow it, otherwise the forward of the class it was swapped from."""

    op: str

    def forward(self, x, cos, sin, cache, backend):
        call = self._native_args(x, cos, sin, cache, backend)
        if call is None:
            return super().forward(x, cos, sin, cache, backend)
        return getattr(torch.ops.llminfer, self.op)(*call)


class NativeDecoderLayer(_OneNativeCall, DecoderLayer):
    """A DecoderLayer whose decode steps run as one native call. Chapter 08.

    Same modules, parameter names and numbers as the DecoderLayer it was (the class is swapped in place by
    `use_native_kernels`). When the layer is fused (`fuse_projections`), its linears have native kernels,
    the model attends through the 'native' backend and the cache hands over its buffers (`cache.slots`),
    a step of up to `cpu.MAX_TOKENS` tokens on a CPU runs `torch.ops.llminfer.decode_layer`: both
    norms, the four products, RoPE, the cache write, attention, SwiGLU and both residuals in one call, so a
    step makes one call per layer instead of a dozen. A prefill of any length takes the same call where the
    blocked kernel runs (`cpu.blocked_prefill()`). Anything else (autograd, another cache, backend
    or device) runs the modules, as DecoderLayer does.
    """

    op = "decode_layer"

    def _native_args(self, x, cos, sin, cache, backend) -> tuple | None:
        fits = _step_fits(x, cos, backend, _weight_dtype(self, x))
        return self._layer_args(x, cos, sin, cache, backend) if fits else None

    def _layer_args(self, x, cos, sin, cache, backend) -> tuple | None:
        """This layer's arguments of `decode_layer`, for a step that `_step_fits`; None where the layer cannot."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(attn, FusedAttention) or not isinstance(mlp, FusedMLP):
            return None
        slots = getattr(cache, "slots", None)
        slots = slots(attn.layer_idx) if slots is not None else None
        if slots is None:
            return None
        keys, values, positions = slots
        if keys.dtype != x.dtype or keys.device.type != "cpu" or positions.dim() != 1 or positions.dtype != torch.long:
            return None
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if any(type(n) is not RMSNorm or n.weight.dtype != x.dtype for n in norms):
            return None
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()):
            return None                                     # autograd needs the modules
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        parts = [_native_parts(linear, x.dtype) for linear in linears]
        bias = attn.qkv_proj.bias
        if (any(p is None for p in parts) or any(linear.bias is not None for linear in linears[1:])
                or (bias is not None and bias.dtype != x.dtype)):
            return None
        rows = x.shape[0] * x.shape[1]
        if rows > native_cpu.MAX_TOKENS and not all(native_cpu.blocked_prefill(p[0].dtype, rows) for p in parts):
            return None                                     # a quantized format whose prefill torch runs faster
        return (x, norms[0].weight, norms[0].eps, norms[1].weight, norms[1].eps, parts[0], bias, parts[1],
                parts[2], parts[3], cos, sin, keys, values, positions, attn.n_heads, attn.head_dim ** -0.5)


class NativeDecoderStack(_OneNativeCall, DecoderStack):
    """A DecoderStack whose decode steps run every layer in one native call. Chapter 08.

    Same layers and names as the DecoderStack it was (the class is swapped in place by
    `use_native_kernels`). When every layer can take its one-call path (NativeDecoderLayer), a step runs
    `torch.ops.llminfer.decode_layers`: the whole stack, layer after layer, without returning to Python in
    between. Otherwise the layers run one by one, each taking its own fast path where it can.
    """

    op = "decode_layers"
    # set by `tracing` while a step is traced: the prepared stack's number and activation dtype (plain values,
    # which the tracer reads as constants)
    _tracing: tuple[int, torch.dtype] | None = None

    # set by `kept` around an eager forward (a decoder's prefill): the prepared stack and the cache it writes
    _kept: tuple[native_cpu.PreparedStack, object] | None = None

    def forward(self, x, cos, sin, cache, backend):
        prepared = self._tracing
        if prepared is not None and torch.compiler.is_compiling() and x.dtype == prepared[1]:
            # the step being traced: its weights and caches were kept by `prepare_step`, so the compiled step
            # hands over only x, the RoPE rows and the positions
            _, _, positions = cache.slots(self[0].self_attn.layer_idx)
            return torch.ops.llminfer.decode_layers_prepared(prepared[0], x, cos, sin, positions)
        kept = self._kept
        if (kept is not None and cache is kept[1] and x.dtype == kept[0].dtype and not torch.compiler.is_compiling()
                and self._step_fits(x, cos, backend) is not None and kept[0].runs(x.shape[0] * x.shape[1])):
            # an eager forward over the kept stack's cache (a decoder's prefill): gathering and checking the
            # layers' arguments (`_native_args`) took about a millisecond of a 30-layer model's prefill
            _, _, positions = cache.slots(self[0].self_attn.layer_idx)
            return torch.ops.llminfer.decode_layers_prepared(kept[0].id, x, cos, sin, positions)
        return super().forward(x, cos, sin, cache, backend)

    def prepare_step(self, x, cos, sin, cache, backend) -> native_cpu.PreparedStack | None:
        """Keeps the stack's weights and `cache`'s buffers in the kernels (`cpu.PreparedStack`) for steps
        shaped as x (B, 1, dim); None where such a step does not run natively. The cache must be in a forward
        (`cache.begin`) while this runs. A step traced inside `tracing(prepared)` then uses them:
        `llminfer.cuda_graphs.StaticDecoder` does so for its compiled step and keeps what was prepared (the step
        is tied to these weights and caches, as a specialised StaticDecoder's step is)."""
        call = self._native_args(x, cos, sin, cache, backend)
        if call is None:
            return None
        (_, tensors, layout, eps, _, _, keys, values, _, n_heads, scale) = call
        # each product's weight: a layer's tensors are its two norms, then per product its parts (weight first),
        # with q/k/v's bias after its parts
        weights, at = set(), 0
        for layer in range(len(layout) // 5):
            qkv, bias, o, gate_up, down = layout[5 * layer:5 * layer + 5]
            at += 2
            for count, extra in ((qkv, bias), (o, 0), (gate_up, 0), (down, 0)):
                weights.add(tensors[at].dtype)
                at += count + extra
        return native_cpu.PreparedStack(tensors, layout, eps, keys, values, n_heads, scale, x.dtype,
                                        tuple(sorted(weights, key=str)))

    @contextlib.contextmanager
    def kept(self, prepared: native_cpu.PreparedStack | None, cache):
        """Inside the block, an eager forward over `cache` that the stack runs natively runs `prepared` (from
        `prepare_step` with this cache; None: the usual call). `llminfer.cuda_graphs.StaticDecoder` prefills so:
        its prepared stack is tied to the model as it was compiled, as its compiled step is."""
        self._kept = None if prepared is None else (prepared, cache)
        try:
            yield
        finally:
            self._kept = None

    @contextlib.contextmanager
    def tracing(self, prepared: native_cpu.PreparedStack | None):
        """Inside the block, a step being traced runs `prepared` (from `prepare_step`; None: the usual call)."""
        self._tracing = None if prepared is None else (prepared.id, prepared.dtype)
        try:
            yield
        finally:
            self._tracing = None

    def _step_fits(self, x, cos, backend) -> str | None:
        """`_step_fits` for the stack's step, with the prefill path of its first layer's weights."""
        first = next(iter(self), None)
        return _step_fits(x, cos, backend, None if first is None else _weight_dtype(first, x))

    def _native_args(self, x, cos, sin, cache, backend) -> tuple | None:
        if self._step_fits(x, cos, backend) is None:         # checked once for the whole step
            return None
        tensors, layout, eps, keys, values = [], [], [], [], []
        call = None
        for layer in self:
            call = layer._layer_args(x, cos, sin, cache, backend) if isinstance(layer, NativeDecoderLayer) else None
            if call is None:
                return None
            (_, norm1, eps1, norm2, eps2, qkv, bias, o, gate_up, down, _, _, k, v, _, _, _) = call
            tensors += [norm1, norm2, *qkv, *([] if bias is None else [bias]), *o, *gate_up, *down]
            layout += [len(qkv), int(bias is not None), len(o), len(gate_up), len(down)]
            eps += [eps1, eps2]
            keys.append(k)
            values.append(v)
        if call is None:
            return None
        positions, n_heads, scale = call[14], call[15], call[16]
        return (x, tensors, layout, eps, cos, sin, keys, values, positions, n_heads, scale)


def _streamed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a decode step streams from memory: every parameter, and the integer codes and scales of
    quantized linears (buffers), each once however often it is tied."""
    seen, out = set(), []
    candidates = list(model.parameters())
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            candidates += [b for b in module.buffers(recurse=False) if b is not None]
    for tensor in candidates:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append(tensor)
    return out


@torch.no_grad()
def use_huge_pages(model: nn.Module, min_bytes: int = 8 << 20) -> nn.Module:
    """Moves a CPU model's weights into one block of memory backed by 2 MiB transparent huge pages, in place;
    returns model. Chapter 08.

    A decode step streams every weight once. With the usual 4 KiB pages that is a new page, and a page-table
    walk on a TLB miss, every 4 KiB (130,000 a step for a 135M-parameter model in float32), each walk dearer
    inside a virtual machine; with 2 MiB pages there are 512 times fewer. The tensors keep their identity,
    names, ties, values and shapes, each starting on a cache line; a tensor moves only if it is contiguous and
    the whole of its memory (a view into another keeps sharing it).
    Nothing changes where the platform cannot ask for huge pages (not Linux, or transparent huge pages
    off), for weights smaller than `min_bytes` together, or off the CPU. Applying it twice moves nothing.
    Each tensor's old memory is freed as it moves, unless something else still holds it (a state_dict
    taken before, say), in which case both copies stay until that goes.
    """
    candidates = [t for t in _streamed_tensors(model) if t.device.type == "cpu" and t.is_contiguous()
                  and t.numel() > 0 and not on_huge_pages(t)]
    # only tensors that are the whole of their memory: one that shares it with another (a view) keeps sharing it
    owners: dict[int, int] = {}
    for t in candidates:
        owners[t.untyped_storage().data_ptr()] = owners.get(t.untyped_storage().data_ptr(), 0) + 1
    tensors = [t for t in candidates if owners[t.untyped_storage().data_ptr()] == 1 and t.storage_offset() == 0
               and t.untyped_storage().nbytes() == t.nbytes]
    align = 64
    sizes = [-(-t.nbytes // align) * align for t in tensors]
    total = sum(sizes)
    if total < min_bytes:
        return model
    arena = huge_page_empty((total,), torch.uint8)
    if arena is None:
        return model
    offset = 0
    for tensor, size in zip(tensors, sizes):
        home = arena[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        home.copy_(tensor)
        tensor.data = home                     # the same Parameter or buffer object: ties and references hold
        offset += size
    return model


def uses_native_kernels(model: nn.Module) -> bool:
    """Whether any layer of model runs the native CPU kernels (use_native_kernels, or quantized). Chapter 08."""
    return any(isinstance(m, (NativeLinear, NativeDecoderLayer, NativeDecoderStack))
               or (isinstance(m, QuantizedLinear) and m.kernel == "native") for m in model.modules())


@torch.no_grad()
def use_native_kernels(model: nn.Module, strict: bool = False, huge_pages: bool = True) -> nn.Module:
    """Makes every float32/bfloat16 nn.Linear of a CPU model a NativeLinear, and a model on the default 'sdpa'
    attention backend use 'native' (the decode attention kernel), in place; returns model. Chapter 08.

    The kernels are built on first use (`llminfer.cpu`); where they cannot be (no C++ compiler,
    or `LLMINFER_NATIVE_KERNELS=0`) the model is left as it is, or with strict=True a RuntimeError says why.
    Weights are made row-major (undoing `use_decode_layout`, which serves torch's own matmul), and with
    huge_pages=True moved onto 2 MiB pages (`use_huge_pages`), which the kernels stream faster.
    """
    targets = [m for m in model.modules() if type(m) is nn.Linear and m.weight.device.type == "cpu"
               and m.weight.dtype in (torch.float32, torch.bfloat16)]
    on_cpu = any(p.device.type == "cpu" for p in model.parameters())
    if not on_cpu:
        return model
    if not native_cpu.available():
        if strict:
            raise RuntimeError(f"the native CPU kernels are unavailable ({native_cpu.why_unavailable()}); install a C++ "
                               "compiler (g++ or clang) or call with strict=False to keep torch's kernels")
        return model
    for module in targets:
        if not module.weight.is_contiguous():
            module.weight.data = module.weight.data.contiguous()
        module.__class__ = NativeLinear
    for layer in getattr(model, "layers", []):     # whole layers in one call where they qualify (decode)
        if type(layer) is DecoderLayer:
            layer.__class__ = NativeDecoderLayer
    if type(getattr(model, "layers", None)) is DecoderStack:       # and the whole stack in one call
        model.layers.__class__ = NativeDecoderStack
    if getattr(model, "attn_backend", None) == "sdpa":      # decode attention too (a prefill keeps sdpa)
        model.set_attention_backend("native")
    if huge_pages:
        use_huge_pages(model)
    return model


def optimize_decode(model: nn.Module) -> nn.Module:
    """The decode transforms that need no compiling, in place: fuse_projections, then use_native_kernels
    (quantized layers pick the native kernel themselves). Returns model. Chapter 08."""
    return use_native_kernels(fuse_projections(model))


def compile_decode(model, batch_size: int = 1, max_seq_len: int | None = None, fuse: bool = True,
                   compile: bool = True, options: dict | None = None, warmup: bool = True,
                   backend: str = "inductor", native: bool = True) -> StaticDecoder:
    """Fuses the projections and switches to the native CPU kernels (in place: products, decode attention,
    and the layer stack in one native call a step), and returns a StaticDecoder whose step is compiled
    (compile=False: left eager). Chapter 08.

    warmup=True compiles at once; `decoder.compile_s` says how long it took (a second compile of the same
    model in a new process reads inductor's on-disk cache and is faster). The model keeps no reference to
    the decoder: pass it where it should run, `llminfer.generate(model, ids, step=decoder)` or
    `decoder.generate(ids)` (a request must fit its batch size and max_seq_len, under the same thread count).
    """
    if fuse:
        fuse_projections(model)
    if native:
        use_native_kernels(model)
    decoder = StaticDecoder(model, batch_size, max_seq_len, mode="compiled" if compile else "eager",
                            options=options, backend=backend)
    if warmup:
        decoder.warmup()
    return decoder


def settle_prefill_paths(model: nn.Module, max_rows: int) -> dict[int, str]:
    """Settles now the prefill path (`cpu.prefill_path`) of every rows bucket from MAX_TOKENS + 1 to
    max_rows for the weights of model's native stack: read from the answers kept beside the kernel build, or timed
    (a fraction of a second each, once per machine), so that no request waits on a first-use timing. A server calls
    it before its first request (`llminfer.engine.LLMEngine`). Returns {bucket: path}; {} where no native stack
    runs. Chapter 08."""
    layers = getattr(model, "layers", None)
    if not (isinstance(layers, NativeDecoderStack) and len(layers) and native_cpu.available()
            and model.device.type == "cpu"):
        return {}
    dtype = _weight_dtype(layers[0], torch.empty(0, dtype=model.dtype))
    paths, rows = {}, native_cpu.MAX_TOKENS + 1
    while True:
        bucket = native_cpu.rows_bucket(rows)
        paths[bucket] = native_cpu.prefill_path(dtype, bucket)
        # done at max_rows, or at the last bucket (longer prefills share its answer)
        if bucket >= max_rows or native_cpu.rows_bucket(bucket + 1) == bucket:
            return paths
        rows = bucket + 1


def prefill_probe(dtype: torch.dtype, rows: int):
    """Returns a run that prefills `rows` random tokens through cpu.PREFILL_PROBE_LAYERS random layers of
    SmolLM2-135M's shape (a vocabulary of 256) with weights of dtype: float32, bfloat16, int8 codes, or uint8 (int4
    nibbles in groups of 32), as a model in that format runs them (`compile_decode`, its step eager), on the prefill
    path in force (`cpu.force_prefill`). What the prefill choice times at first use. Appendix A1."""
    native_cpu.check_prefill_dtypes([dtype])
    config = get_preset("smollm2-135m").replace(n_layers=native_cpu.PREFILL_PROBE_LAYERS, vocab_size=256,
                                                max_seq_len=rows)
    model = load_random(config, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32, seed=0)
    if native_cpu.PREFILL_DTYPES[dtype]:
        quantize(model, *native_cpu.PREFILL_DTYPES[dtype])
    decoder = compile_decode(model, max_seq_len=rows, compile=False)
    ids = torch.randint(0, config.vocab_size, (1, rows), generator=torch.Generator().manual_seed(0))
    return lambda: decoder.prefill(ids)


# the first use of a prefill choice times what the choice moves, a prefill through the stack or through the modules
native_cpu.set_prefill_probe(prefill_probe)
