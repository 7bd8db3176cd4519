"""Native matrix-vector kernels for decode on a CPU (float32, bfloat16, int8, int4 weights). Chapter 08.

A decode step is one activation row times every weight matrix. torch's own kernels for that shape leave
bandwidth unused on many CPUs: its bfloat16 path converts the whole matrix, and its packed int8/int4
kernels are written for other shapes. The C++ beside this file streams each weight row once,
widens it to float32 in registers and multiply-adds it (AVX2 and FMA where the CPU has them, portable
loops elsewhere), reading the checkpoint's own layout. It is one extension built from units by job
(`SOURCES`): `cpu_matvec.cpp` (matrix-vector), `cpu_gemm.cpp` (the blocked matrix multiply),
`cpu_attention.cpp` (decode attention), `cpu_layers.cpp` (whole layers), `cpu_ops.cpp` (the ops'
schemas), with `cpu_kernels.h` between them.

The source is compiled the first time it is needed (about 15 s with a C++ compiler; torch's extension
builder) and kept in `LLMINFER_KERNEL_CACHE` (default `~/.cache/llminfer/kernels`). Without a compiler
`available()` is False, `why_unavailable()` says why, and the callers keep torch's kernels.
`LLMINFER_NATIVE_KERNELS=0` turns them off.

The ops are `torch.ops.llminfer.gemv_f32(x, w)`, `gemv_bf16(x, w)`, `gemv_int8(x, codes, scale)` and
`gemv_int4(x, nibbles, scale, offset, group)`: x (tokens, K) float32 or bfloat16 (any number of rows), the
weight (N, K) row-major (int4: (N, K/2) bytes, the even input in the low nibble), the result (tokens, N) in
x's dtype. Beside them,
`decode_attention(q, k, v, mask, scale)`: a few queries against the K/V cache read in place (grouped-query
heads shared, masked positions skipped), registered as the attention backend 'native'. And
`decode_layer(...)`: a whole decoder layer for a few tokens in one call (norms, the four products, RoPE,
the cache write, attention, SwiGLU, the residuals), which `llminfer.fast.NativeDecoderLayer` calls, and
`decode_layers(...)`, every layer of a stack in one call (`llminfer.fast.NativeDecoderStack`);
`paged_attention(...)` and `decode_layers_paged(...)`, the same over a paged cache's block pool and block
tables, for an engine step of several sequences (`llminfer.engine`, chapter 06). They carry
fake implementations, so `torch.compile` traces through them.

A prefill (many rows of x) runs through the same ops: from 16 rows on, products take a blocked kernel
(tiles of 6 weight rows by 16 tokens in registers, x repacked once per product, bfloat16 and quantized rows
widened to float32 a block of 6 at a time) that beats torch's matmul at a prefill's shapes on AVX2 machines
(`blocked_prefill()`).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import torch

from llminfer.attention import fast_attention

__all__ = ["available", "why_unavailable", "load", "isa", "gemv", "decode_attention", "paged_attention",
           "attention_backend", "loaded",
           "MAX_TOKENS", "blocked_prefill", "cpu_flags", "bfloat16_in_hardware", "SOURCES", "HEADERS",
           "cache_dir"]

_HERE = Path(__file__).parent
# the units of the one extension, by job, and the header they share (the build's hash covers all of them)
SOURCES = tuple(_HERE / name for name in ("cpu_matvec.cpp", "cpu_gemm.cpp", "cpu_attention.cpp", "cpu_layers.cpp",
                                          "cpu_ops.cpp"))
HEADERS = (_HERE / "cpu_kernels.h",)
# The one matrix-vector threshold: products of up to this many rows of x take the matrix-vector loops; past
# it (a prefill, a large engine batch) a blocked matmul reuses each weight many times and wins. The C++ is
# compiled with it (-DLLMINFER_MATVEC_MAX_ROWS), so Python and the kernels cannot disagree;
# torch.ops.llminfer.matvec_max_rows() reads it back.
MAX_TOKENS = 8

_lock = threading.Lock()
_state: dict = {"loaded": False, "error": None}


def cache_dir() -> Path:
    """Where the compiled kernels are kept: $LLMINFER_KERNEL_CACHE, else ~/.cache/llminfer/kernels."""
    return Path(os.environ.get("LLMINFER_KERNEL_CACHE", Path.home() / ".cache" / "llminfer" / "kernels"))


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; a venv's own (the `ninja` package) is not on it unless the venv
    is activated, so it is put there."""
    if shutil.which("ninja"):
        return
    places = [str(Path(sys.executable).parent)]
    try:
        import ninja
        places.insert(0, str(ninja.BIN_DIR))
    except ImportError:
        pass
    os.environ["PATH"] = os.pathsep.join(places + [os.environ.get("PATH", "")])


def _build() -> None:
    from torch.utils import cpp_extension

    _ninja_on_path()
    source = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in SOURCES + HEADERS)
    # OpenMP: at::parallel_for splits the rows over torch's threads only in code compiled with it
    cflags, ldflags = ["-O3", "-std=c++17", "-fopenmp", f"-DLLMINFER_MATVEC_MAX_ROWS={MAX_TOKENS}"], ["-fopenmp"]
    digest = hashlib.sha256(source + torch.__version__.encode() + " ".join(cflags + ldflags).encode()).hexdigest()[:12]
    name = f"llminfer_cpu_kernels_{digest}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        print(f"llminfer: compiling the CPU decode kernels once into {build} (about 15 s)", file=sys.stderr)
    cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=cflags, extra_ldflags=ldflags,
                       build_directory=str(build), is_python_module=False, verbose=False)
    _register_fakes()


def _register_fakes() -> None:
    def dense(x, w, *rest):
        return x.new_empty((x.shape[0], w.shape[0]))

    for op in ("gemv_f32", "gemv_bf16", "gemv_int8", "gemv_int4"):
        torch.library.register_fake(f"llminfer::{op}", dense)
    torch.library.register_fake("llminfer::decode_attention",
                                lambda q, k, v, mask, scale: q.new_empty(q.shape))
    torch.library.register_fake("llminfer::decode_layer", lambda x, *rest: x.new_empty(x.shape))
    torch.library.register_fake("llminfer::decode_layers", lambda x, *rest: x.new_empty(x.shape))
    torch.library.register_fake("llminfer::decode_layers_paged", lambda x, *rest: x.new_empty(x.shape))
    torch.library.register_fake("llminfer::paged_attention", lambda q, *rest: q.new_empty(q.shape))


def load() -> bool:
    """Builds (once) and loads the kernels; True when `torch.ops.llminfer.gemv_*` can be called."""
    with _lock:
        if _state["loaded"] or _state["error"] is not None:
            return _state["loaded"]
        if os.environ.get("LLMINFER_NATIVE_KERNELS", "1") == "0":
            _state["error"] = "turned off by LLMINFER_NATIVE_KERNELS=0"
            return False
        try:
            _build()
        except Exception as error:            # no compiler, no ninja, a failed build: torch's kernels remain
            _state["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            print(f"llminfer: the native CPU decode kernels did not build ({_state['error']}); torch's kernels run "
                  "instead. A C++ compiler (g++ or clang) and ninja build them.", file=sys.stderr)
            return False
        _state["loaded"] = True
        return True


def loaded() -> bool:
    """Whether the kernels are loaded already (a dict read: cheap enough for every forward)."""
    return _state["loaded"]


def available() -> bool:
    """Whether the native CPU kernels are built and loaded (building them now if need be)."""
    return load()


def why_unavailable() -> str | None:
    """None when the kernels load; otherwise the reason (no compiler, turned off, ...)."""
    load()
    return _state["error"]


def _require() -> None:
    if not (_state["loaded"] or load()):
        raise RuntimeError(f"the native CPU kernels are unavailable ({_state['error']}); install a C++ compiler "
                           "(g++ or clang), or use torch's kernels")


def isa() -> str:
    """'avx2+fma' when the vector loops run, 'portable' otherwise (or 'unavailable')."""
    if "isa" not in _state:
        _state["isa"] = str(torch.ops.llminfer.cpu_kernel_isa()) if load() else "unavailable"
    return _state["isa"]


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (empty where there is no such file)."""
    from ..device import cpu_capabilities

    return cpu_capabilities().flags


def bfloat16_in_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 itself (AVX512-BF16 or AMX), which torch's bfloat16 matmul (oneDNN)
    then uses."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def blocked_prefill(weight_dtype: torch.dtype | None = None) -> bool:
    """Whether products of many rows of x (a prefill) with weights of `weight_dtype` (any format when None)
    run the blocked AVX2 kernel. It outruns torch's matmul at a prefill's shapes in every format on CPUs
    without bfloat16 arithmetic (in bfloat16 by about 8x); on CPUs with it (`bfloat16_in_hardware()`) torch's
    bfloat16 matmul is the faster (1.6x on a Zen 4), so bfloat16 weights keep it. Without AVX2 only the
    matrix-vector loops exist, and a prefill keeps torch's matmul in every format."""
    if not (_state["loaded"] and isa() == "avx2+fma"):
        return False
    return weight_dtype != torch.bfloat16 or not bfloat16_in_hardware()


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         offset: torch.Tensor | None = None, group: int | None = None) -> torch.Tensor:
    """x (tokens, K) times the weight's transpose, by the kernel for the weight's dtype. Chapter 08.

    float32 and bfloat16 weights (N, K); int8 codes (N, K) with `scale` (N,); int4 nibbles (N, K/2) uint8
    with `scale` and `offset` (N, K/group) float32, where w = q·scale + offset.
    """
    _require()
    if weight.dtype == torch.float32:
        return torch.ops.llminfer.gemv_f32(x, weight)
    if weight.dtype == torch.bfloat16:
        return torch.ops.llminfer.gemv_bf16(x, weight)
    if weight.dtype == torch.int8:
        return torch.ops.llminfer.gemv_int8(x, weight, scale)
    if weight.dtype == torch.uint8:
        return torch.ops.llminfer.gemv_int4(x, weight, scale, offset, group)
    raise ValueError(f"no native kernel for {weight.dtype} weights; float32, bfloat16, int8 and int4 (uint8 "
                     "nibbles) have one")


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale, masked)·v for q (B, H, T_q, D) against k, v (B, H_kv, T_k, D); causal without a
    mask (query i sees keys up to T_k - T_q + i). The native kernel; float32 or bfloat16. Chapter 08."""
    _require()
    return torch.ops.llminfer.decode_attention(q, k, v, mask, q.shape[-1] ** -0.5 if scale is None else scale)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    token_seq: torch.Tensor, positions: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of the new tokens of several sequences, q (1, H, N, D), over K/V read in place from a block pool
    (num_blocks, block_size, H_kv, D): token t sees positions 0..positions[t] of sequence token_seq[t], whose
    blocks are row token_seq[t] of block_tables (S, max_blocks). The native kernel; float32 or bfloat16.
    Chapters 06 and 08."""
    _require()
    return torch.ops.llminfer.paged_attention(q, k_pool, v_pool, block_tables, token_seq, positions,
                                              q.shape[-1] ** -0.5 if scale is None else scale)


def attention_backend(q, k, v, causal: bool = True, mask: torch.Tensor | None = None, scale: float | None = None):
    """The 'native' attention backend: the decode_attention kernel for a few queries on a CPU (a decode
    step), F.scaled_dot_product_attention for everything else (a prefill, a GPU, autograd)."""
    if (q.device.type == "cpu" and q.dim() == 4 and q.shape[-2] <= MAX_TOKENS and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float32, torch.bfloat16) and (mask is not None or causal)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and (_state["loaded"] or load())):       # (a dict read, not the lock, inside a compiled step)
        return decode_attention(q, k, v, mask, scale)
    return fast_attention(q, k, v, causal=causal, scale=scale, mask=mask)
