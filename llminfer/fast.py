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
two module replacements that keep every parameter name: each float linear becomes a `NativeLinear` (llminfer's
own matrix-vector kernels) and the layer stack a `NativeDecoderStack`, which holds each layer's weights by name
and runs every layer (norms, products, RoPE, the cache write, attention and SwiGLU) in one native call a step
(`llminfer.cpu.stack`, the native-call contract). A decode step then leaves Python once for the whole stack
instead of a dozen times a layer.
A prefill takes the same call, its products then done by a blocked matrix-matrix kernel that outruns
torch's matmul at a prefill's shapes (in bfloat16 several times over). Anything the one call cannot take
(autograd, another cache or attention backend, a CPU without AVX2 for a prefill) runs the modules, so the
model's forward stays the one forward. The weights are also moved onto 2 MiB pages (`use_huge_pages`),
which stream faster.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from .cuda_graphs import NativeStep, StaticDecoder
from .device import huge_page_empty, on_huge_pages
from . import cpu as native_cpu
from .cpu.stack import Activations, CacheKind, LayerWeights, NativeKV, NativeWeight, PreparedStack
from .kv_cache import KVCache
from .model import MLP, Attention, DecoderLayer, DecoderStack, RMSNorm, Transformer, apply_rope, norm_qk
from .moe import MoEFeedForward
from .quant.linear import QuantizedLinear

__all__ = ["FusedAttention", "FusedMLP", "fuse_projections", "is_fused", "NativeLinear", "NativeMoEFeedForward",
           "NativeDecoderStack", "native_fallback",
           "layer_weights", "use_native_kernels", "use_huge_pages", "uses_native_kernels", "optimize_decode",
           "compile_decode"]


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
        self.q_norm, self.k_norm = attention.q_norm, attention.k_norm   # Qwen3-MoE, OLMoE (None elsewhere)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache, backend) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        qkv = self.qkv_proj(x)                                                   # (B, T, (H + 2·H_kv)·D)
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q, k = norm_qk(q, k, self.q_norm, self.k_norm, self.head_dim)
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
    for layer in model.layers if isinstance(model, Transformer) else []:
        if isinstance(layer.self_attn, Attention):
            layer.self_attn = FusedAttention(layer.self_attn)
        if isinstance(layer.mlp, MLP):
            layer.mlp = FusedMLP(layer.mlp)
    return model


class NativeLinear(nn.Linear):
    """An nn.Linear whose few-token products run llminfer's native matrix-vector kernel. Chapter 08.

    Same parameters, names and numbers as the nn.Linear it replaces (`of`: the same Parameter objects, so tied
    weights stay tied). On a CPU, x goes to `llminfer.cpu.gemv`: its matrix-vector loops for up to
    `cpu.MAX_TOKENS` rows (a decode step), its blocked kernel for more (a prefill) where the CPU has
    AVX2; other devices, autograd and a prefill without the blocked kernel use F.linear.
    """

    @classmethod
    def of(cls, linear: nn.Linear) -> "NativeLinear":
        """Returns a NativeLinear holding `linear`'s own weight and bias (the same Parameters)."""
        native = cls(linear.in_features, linear.out_features, bias=False, device="meta", dtype=linear.weight.dtype)
        native.weight, native.bias = linear.weight, linear.bias
        return native.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // self.in_features if self.in_features else 0
        if not _runs_native(x, self.weight, tokens):
            return F.linear(x, self.weight, self.bias)
        y = native_cpu.gemv(x.reshape(tokens, self.in_features), self.weight)            # (tokens, out)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def _runs_native(x: torch.Tensor, weight: torch.Tensor, tokens: int) -> bool:
    """Whether `tokens` rows of x times weight (N, K) take the native kernels: on the CPU, in the weight's dtype, a
    contiguous weight, no autograd, and past MAX_TOKENS rows only where the blocked prefill kernel runs."""
    return not (x.device.type != "cpu" or tokens == 0 or x.dtype != weight.dtype
                or (tokens > native_cpu.MAX_TOKENS and not native_cpu.blocked_prefill(weight.dtype, tokens))
                or not weight.is_contiguous()
                or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


class NativeMoEFeedForward(MoEFeedForward):
    """An MoEFeedForward whose experts' products run llminfer's native kernels. Chapters 08, 14.

    Same parameters, names and numbers as the module it replaces (`of`: the same Parameters and submodules). Each
    expert's product over its tokens (a contiguous slice when grouped) goes to `llminfer.cpu.gemv` with the
    expert's own contiguous (I, D) or (D, I) view of the stacked weight, under NativeLinear's rules."""

    @classmethod
    def of(cls, moe: MoEFeedForward) -> "NativeMoEFeedForward":
        """Returns a NativeMoEFeedForward holding `moe`'s own router, experts and shared expert."""
        with torch.device("meta"):
            native = cls(moe.router.in_features, moe.n_experts, moe.top_k, moe.expert_dim,
                         softmax_before_topk=moe.softmax_before_topk, normalize=moe.normalize, impl=moe.impl)
        native.router, native.shared_expert, native.shared_expert_gate = \
            moe.router, moe.shared_expert, moe.shared_expert_gate
        native.w_gate, native.w_up, native.w_down = moe.w_gate, moe.w_up, moe.w_down
        return native.train(moe.training)

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if not _runs_native(x, weight, x.shape[0]):
            return F.linear(x, weight)
        return native_cpu.gemv(x.contiguous(), weight)


def _native_weight(linear: nn.Module, dtype: torch.dtype) -> NativeWeight | None:
    """A product as the native stack takes it (float weight, int8 codes and scale, int4 nibbles, scale and offset, with
    its activations' format); None where it has no native kernel for activations of `dtype`."""
    if isinstance(linear, NativeLinear):
        weight = linear.weight
        return NativeWeight(weight) if weight.dtype == dtype and weight.is_contiguous() else None
    if isinstance(linear, QuantizedLinear) and linear.kernel == "native" and \
            linear.kernel_scale.dtype == linear._kernel_terms_dtype():
        activations = Activations.INT8 if linear.activations == "int8" else Activations.FLOAT
        return NativeWeight(linear.qweight, linear.kernel_scale, linear.kernel_offset if linear.bits == 4 else None,
                            activations)
    return None


def layer_weights(layer: nn.Module, dtype: torch.dtype) -> LayerWeights | None:
    """Returns a decoder layer's weights by name for a native stack whose activations are of `dtype`, or None where the
    layer cannot run in it (not fused, a norm or product without a native kernel, a bias off qkv). Chapter 08."""
    if type(layer) is not DecoderLayer:
        return None
    attn, mlp = layer.self_attn, layer.mlp
    if not isinstance(attn, FusedAttention) or not isinstance(mlp, FusedMLP) or attn.q_norm is not None:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if any(type(norm) is not RMSNorm or norm.weight.dtype != dtype or not norm.weight.is_contiguous()
           for norm in norms):
        return None
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    products = [_native_weight(linear, dtype) for linear in linears]
    bias = attn.qkv_proj.bias
    if (any(p is None for p in products) or any(linear.bias is not None for linear in linears[1:])
            or (bias is not None and bias.dtype != dtype)):
        return None
    qkv, o, gate_up, down = products
    return LayerWeights(input_norm=norms[0].weight, input_eps=norms[0].eps, qkv=qkv, qkv_bias=bias, o=o,
                        post_norm=norms[1].weight, post_eps=norms[1].eps, gate_up=gate_up, down=down)


def native_fallback(layers) -> str | None:
    """Why a layer stack runs its modules instead of the one native call (None where it can take it): the layers
    the native layer kernel has no code for, by what they hold. Chapters 08, 14."""
    for i, layer in enumerate(layers):
        if type(layer) is not DecoderLayer:
            return f"layer {i} is a {type(layer).__name__}, not a DecoderLayer"
        if isinstance(layer.mlp, MoEFeedForward):
            return (f"layer {i}'s feed-forward is a mixture of experts, which the native layer kernel does not run; "
                    "the layers run their modules, the experts' products on the native matrix-vector kernels")
        if layer.self_attn.q_norm is not None:
            return f"layer {i} normalises q and k (qk_norm), which the native layer kernel does not"
    return None


def _kv_storage(cache) -> tuple[CacheKind, list[torch.Tensor], list[torch.Tensor]] | None:
    """The K/V a native step over `cache` writes and reads, by the cache's type: a KVCache's contiguous buffers, a
    NativeKV's own (the engine's paged pool); None for any other cache (the int8 cache: the modules run)."""
    if isinstance(cache, KVCache):
        return CacheKind.CONTIGUOUS, cache.k, cache.v
    if isinstance(cache, NativeKV):
        return cache.native_storage()
    return None


def _step_positions(cache, kind: CacheKind) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
    """The forward in flight's positions over `cache` (and, paged, each token's sequence and the block tables)."""
    if kind is CacheKind.CONTIGUOUS:
        slots = cache.slots(0)
        return None if slots is None else (slots[2], None, None)
    return cache.native_step()


class NativeDecoderStack(DecoderStack, NativeStep):
    """A DecoderStack whose steps run every layer in one native call. Chapter 08.

    Same layers, parameter names and numbers as the DecoderStack it replaces (`use_native_kernels` makes it from the
    model's own layers). It reads each layer's weights by name once (`load_weights`, into `cpu.stack.LayerWeights`),
    and for a cache it runs over, prepares them with the cache's buffers in the kernels (`prepare`: contiguous
    buffers of a KVCache, or the engine's paged pool), so that a step (`cpu.stack.PreparedStack.step`) hands over x,
    the RoPE rows and the positions alone: the whole stack, layer after layer, without returning to Python, its
    products by the matrix-vector loops for a decode step's few tokens and by the blocked kernel for a prefill.
    Anything the one call cannot take (autograd, another cache or attention backend, a layer without native
    kernels) runs the modules, as DecoderStack does.

    A weight changed after `load_weights` (a transform such as quantize, a rebound `.data`, weights moved onto huge
    pages) is not seen until the caller calls `load_weights()` again (`use_native_kernels(model)` does); a step over
    weights whose memory moved is refused with an error that says so.
    """

    _pinned: tuple[PreparedStack, object] | None = None       # set by `pinned`

    def __init__(self, layers=None):
        super().__init__(layers)
        self.load_weights()

    def load_weights(self) -> "NativeDecoderStack":
        """Reads every layer's weights from its modules and drops what was prepared from earlier ones; returns self.
        Call it again after changing the weights. Chapter 08."""
        first = next(iter(self), None)
        dtype = first.input_layernorm.weight.dtype if type(first) is DecoderLayer else None
        layers = [layer_weights(layer, dtype) for layer in self] if dtype in (torch.float32, torch.bfloat16) else []
        self.weights: list[LayerWeights] | None = layers if layers and all(w is not None for w in layers) else None
        # why the steps run the modules, where that is known from the layers (MoE, q/k norms)
        self.fallback: str | None = native_fallback(self) if self.weights is None else None
        self.dtype = dtype                                     # the activations' dtype
        self.weight_dtypes = tuple(sorted({p.weight.dtype for w in self.weights or () for p in w.products()}, key=str))
        self.trainable = any(p.requires_grad for p in self.parameters())
        attn = first.self_attn if self.weights else None
        self.heads = (attn.n_heads, attn.head_dim) if attn is not None else None
        self._prepared: tuple[PreparedStack, weakref.ref] | None = None
        return self

    def supports(self, x: torch.Tensor, cos: torch.Tensor, backend) -> bool:
        """Whether a step of x (B, T, dim) runs in the one call: loaded kernels, the 'native' attention backend, x in
        the weights' activation dtype on the CPU, no autograd, and for a prefill (more than MAX_TOKENS rows) the
        blocked kernel for every weight format of the stack. Chapter 08."""
        if not (self.weights is not None and backend is native_cpu.attention_backend and native_cpu.loaded()
                and x.device.type == "cpu" and x.dim() == 3 and x.dtype == self.dtype and cos.dim() == 2
                and cos.dtype == x.dtype and not (torch.is_grad_enabled() and (x.requires_grad or self.trainable))):
            return False
        rows = x.shape[0] * x.shape[1]
        return rows <= native_cpu.MAX_TOKENS or all(native_cpu.blocked_prefill(d, rows) for d in self.weight_dtypes)

    def prepare(self, cache) -> PreparedStack | None:
        """Returns the stack's weights and `cache`'s buffers kept in the kernels (made once per cache, and again
        after `load_weights`); None where the cache has no storage the kernels read (`_kv_storage`). Chapter 08."""
        storage = _kv_storage(cache)
        if storage is None or self.weights is None:
            return None
        kind, keys, values = storage
        if keys[0].dtype != self.dtype or keys[0].device.type != "cpu" or len(keys) != len(self.weights):
            return None
        kept = self._prepared
        if kept is not None and kept[1]() is cache and kept[0].kind is kind and kept[0].holds(keys, values):
            return kept[0]
        prepared = PreparedStack(self.weights, *self.heads, kind, keys, values)
        stack = weakref.ref(self)
        # dropped with its cache, whose buffers it holds
        self._prepared = (prepared, weakref.ref(cache, lambda _: NativeDecoderStack._forget(stack, prepared)))
        return prepared

    @staticmethod
    def _forget(stack: weakref.ref, prepared: PreparedStack) -> None:
        owner = stack()
        if owner is not None and owner._prepared is not None and owner._prepared[0] is prepared:
            owner._prepared = None

    @contextlib.contextmanager
    def pinned(self, prepared: PreparedStack | None, cache):
        """Inside the block, a forward over `cache` that the stack can take runs `prepared` (from `prepare(cache)`)
        without looking it up: what a compiled step is traced with (`llminfer.cuda_graphs.StaticDecoder`)."""
        self._pinned = None if prepared is None else (prepared, cache)
        try:
            yield
        finally:
            self._pinned = None

    def native_step(self, x, cos, sin, cache, backend) -> torch.Tensor | None:
        """x through every layer in one native call over `cache`; None where the call cannot take the step."""
        if cache is None or not self.supports(x, cos, backend):
            return None
        pinned = self._pinned
        prepared = pinned[0] if pinned is not None and pinned[1] is cache else self.prepare(cache)
        if prepared is None or (prepared.kind is CacheKind.PAGED and x.shape[0] != 1):
            return None                                       # a pool takes a step's tokens side by side, (1, N, dim)
        where = _step_positions(cache, prepared.kind)
        return None if where is None else prepared.step(x, cos, sin, *where)

    def forward(self, x, cos, sin, cache, backend):
        out = self.native_step(x, cos, sin, cache, backend)
        return super().forward(x, cos, sin, cache, backend) if out is None else out


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
    return any(isinstance(m, (NativeLinear, NativeMoEFeedForward, NativeDecoderStack))
               or (isinstance(m, QuantizedLinear) and m.kernel == "native") for m in model.modules())


@torch.no_grad()
def use_native_kernels(model: nn.Module, strict: bool = False, huge_pages: bool = True) -> nn.Module:
    """Replaces every float32/bfloat16 nn.Linear of a CPU model by a NativeLinear and a Transformer's layer stack by a
    NativeDecoderStack (every layer in one native call a step), and makes a model on the default 'sdpa' attention
    backend use 'native' (the decode attention kernel), in place; returns model (a bare nn.Linear: its
    NativeLinear). Chapter 08.

    The kernels are built on first use (`llminfer.cpu`); where they cannot be (no C++ compiler,
    or `LLMINFER_NATIVE_KERNELS=0`) the model is left as it is, or with strict=True a RuntimeError says why.
    Weights are made row-major (undoing `use_decode_layout`, which serves torch's own matmul), and with
    huge_pages=True moved onto 2 MiB pages (`use_huge_pages`), which the kernels stream faster. Called again (after a
    transform that changed weights), it reads the stack's weights again (`NativeDecoderStack.load_weights`).
    """
    def native(linear: nn.Module) -> bool:
        return (type(linear) is nn.Linear and linear.weight.device.type == "cpu"
                and linear.weight.dtype in (torch.float32, torch.bfloat16))

    on_cpu = any(p.device.type == "cpu" for p in model.parameters())
    if not on_cpu:
        return model
    if not native_cpu.available():
        if strict:
            raise RuntimeError(f"the native CPU kernels are unavailable ({native_cpu.why_unavailable()}); install a C++ "
                               "compiler (g++ or clang) or call with strict=False to keep torch's kernels")
        return model
    replaced: dict[int, NativeLinear] = {}             # by module: a linear used in two places stays one
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if native(child):
                if not child.weight.is_contiguous():
                    child.weight.data = child.weight.data.contiguous()
                setattr(parent, name, replaced.setdefault(id(child), NativeLinear.of(child)))
    for parent in list(model.modules()):               # after the linears: the experts' products too
        for name, child in list(parent.named_children()):
            if type(child) is MoEFeedForward and child.w_gate.device.type == "cpu" \
                    and child.w_gate.dtype in (torch.float32, torch.bfloat16):
                setattr(parent, name, NativeMoEFeedForward.of(child))
    if native(model):
        if not model.weight.is_contiguous():
            model.weight.data = model.weight.data.contiguous()
        model = NativeLinear.of(model)
    if isinstance(model, Transformer):
        if model.attn_backend == "sdpa":                    # decode attention too (a prefill keeps sdpa)
            model.set_attention_backend("native")
        if type(model.layers) is DecoderStack:            # the whole stack in one call a step
            model.layers = NativeDecoderStack(model.layers)
    if huge_pages:
        use_huge_pages(model)
    if isinstance(model, Transformer) and isinstance(model.layers, NativeDecoderStack):
        model.layers.load_weights()                       # as they are now (moved onto huge pages, transformed)
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
