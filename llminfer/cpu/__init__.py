"""Native matrix-vector kernels for decode on a CPU (float32, bfloat16, int8, int4 weights). Chapter 08.

A decode step is one activation row times every weight matrix. torch's own kernels for that shape leave
bandwidth unused on many CPUs: its bfloat16 path converts the whole matrix, and its packed int8/int4
kernels are written for other shapes. The C++ beside this file streams each weight row once,
widens it to float32 in registers and multiply-adds it (AVX2 and FMA where the CPU has them, portable
loops elsewhere), reading the checkpoint's own layout. It is one extension built from units by job
(`SOURCES`): `cpu_matvec.cpp` (matrix-vector), `cpu_gemm.cpp` (the blocked matrix multiply),
`cpu_attention.cpp` (decode attention), `cpu_layers.cpp` (whole layers), `cpu_ops.cpp` (the ops'
schemas), with `cpu_kernels.h` between them.

Which loops run is chosen once per process, when the kernels load (`choose_isa`), from the one
CPU-capabilities reader (`llminfer.device.cpu_capabilities`): the highest level of `KERNEL_LEVELS` the CPU has.
`LLMINFER_ISA=portable|avx2|avx_vnni|avx512|avx512_vnni|avx512_bf16` forces a level at or below that (a level
runs its own instructions and those of every lower level the CPU has); one above it is refused with an error
naming the flags the CPU lacks. `isa()` says which level runs, `isa_features()` which instruction sets. Within the
level, each weight format's decode loops are chosen by a timing when the kernels load (`matvec_choices()`): the
widest loops are not the fastest on every CPU.

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
tables, for an engine step of several sequences (`llminfer.engine`, chapter 06). `prepare_stack(...)` keeps a
stack's weights and caches once (`PreparedStack`), and `decode_layers_prepared(stack, x, cos, sin, positions)` runs
it: a compiled decoder's step then hands over four tensors, not the hundreds of weights. `round_bfloat16(x)` rounds float32
values to bfloat16 as the layers round a bfloat16 model's activations (8 at a time with AVX2). They carry fake
implementations, so `torch.compile` traces through them.

A prefill (many rows of x) runs through the same ops: from 16 rows on, products take a blocked kernel
(tiles of 6 weight rows by 16 tokens in registers, 64 with AVX-512, x repacked once per product, bfloat16 and
quantized rows widened to float32 a block of 6 at a time; with AVX512-BF16, bfloat16 rows read as stored by
`vdpbf16ps` in tiles of 12 rows, and with AMX by `tdpbf16ps` in tiles of 32) or torch's matmul, whichever ran a
prefill in the format faster: timed at first use on a few layers (`measure_prefill`), or by a benchmark on a whole
model (`remeasure_prefill`), and kept for later processes (`blocked_prefill()`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llminfer.attention import fast_attention, register_backend

__all__ = ["PreparedStack", "available", "why_unavailable", "load", "isa", "isa_features", "choose_isa", "IsaChoice",
           "ISA_ENV", "KERNEL_LEVELS", "gemv", "decode_attention", "paged_attention", "attention_backend", "loaded",
           "prefill_path", "prefill_choice", "prefill_choices", "set_prefill_probe", "prefill_probe_name",
           "check_prefill_dtypes", "PREFILL_PROBE_LAYERS", "PREFILL_LAYERS_PROBE", "measure_prefill",
           "remeasure_prefill", "force_prefill", "layer_products", "rows_bucket", "stream_read", "PREFILL_PATHS",
           "PREFILL_ENV", "PREFILL_DTYPES", "PREFILL_PRODUCTS", "MAX_TOKENS", "SPLIT_KEYS", "blocked_prefill",
           "tile_int4", "untile_int4", "cpu_flags", "bfloat16_in_hardware", "MATVEC_CANDIDATES", "MATVEC_VARIANTS",
           "MATVEC_PROBE_BYTES", "choose_fastest", "matvec_candidates", "measure_matvec", "matvec_choices",
           "remeasure_matvec", "MATVEC_STEP", "PREFILL_STEP", "SOURCES", "HEADERS", "cache_dir"]

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
# A decode step's attention is shared among its threads by K/V heads, and from this many cached positions on by
# blocks of keys (every head's, split equally: SmolLM2-135M's 3 K/V heads went 2 and 1 to 2 threads, and past a few
# thousand positions attention is a large part of a step). The same blocks, merged in order, on any number of
# threads, so the numbers do not depend on it. Compiled in as MAX_TOKENS is (-DLLMINFER_SPLIT_KEYS);
# torch.ops.llminfer.split_keys() reads it back. Appendix A1.
SPLIT_KEYS = 1024

_lock = threading.RLock()          # re-entrant: a decode step timed while it is held (remeasure_matvec) loads
_state: dict = {"loaded": False, "error": None}

ISA_ENV = "LLMINFER_ISA"
# The levels the kernels have loops for, lowest first (names of llminfer.device.ISA_LEVELS), each with the
# instruction set it adds (a bit of `Feature` in cpu_kernels.h) and any flags its loops need beyond the level's
# own. The amx level's tiles run a prefill's bfloat16 products only; decode keeps the vector loops below it.
KERNEL_LEVELS: dict[str, tuple[int, frozenset[str]]] = {
    "portable": (0, frozenset()),
    "avx2": (1, frozenset({"f16c"})),                                   # 8-lane float loops, maddubs W4A8
    "avx_vnni": (16, frozenset()),                                      # W4A8 by vpdpbusd (VEX)
    "avx512": (2, frozenset({"avx512bw", "avx512vl"})),                 # 16-lane float loops
    "avx512_vnni": (4, frozenset({"avx512bw", "avx512vl"})),            # W4A8 by vpdpbusd (EVEX)
    "avx512_bf16": (8, frozenset({"avx512bw", "avx512vl"})),            # bfloat16 by vdpbf16ps
    "amx": (32, frozenset({"avx512bw", "avx512vl", "avx512_bf16"})),    # a prefill's bfloat16 products by tdpbf16ps
}


@dataclass(frozen=True)
class IsaChoice:
    """The kernels' level and the instruction sets it runs. Appendix A1."""

    level: str                   # one of KERNEL_LEVELS
    features: tuple[str, ...]    # the levels whose instructions run, lowest first (level among them)
    forced: bool                 # chosen by LLMINFER_ISA rather than by the CPU's flags

    @property
    def bits(self) -> int:
        """Returns the feature bits the C++ takes (set_cpu_features)."""
        return sum(KERNEL_LEVELS[name][0] for name in self.features)


def _level_runs(name: str, flags: frozenset[str]) -> bool:
    from ..device import ISA_LEVELS

    return dict(ISA_LEVELS)[name] | KERNEL_LEVELS[name][1] <= flags


def choose_isa(capabilities=None, requested: str | None = None) -> IsaChoice:
    """Returns the IsaChoice for a CPU (default this one): `requested` (default $LLMINFER_ISA) if the CPU has it,
    else the highest level it has; ValueError for an unknown level or one above the CPU. Appendix A1."""
    from ..device import ISA_LEVELS, cpu_capabilities

    capabilities = capabilities or cpu_capabilities()
    flags = capabilities.flags
    if requested is None:
        requested = os.environ.get(ISA_ENV) or None
        if requested is None and os.environ.get("LLMINFER_CPU_KERNELS_PORTABLE") == "1":    # the older switch
            requested = "portable"
    order = list(KERNEL_LEVELS)
    runnable = [name for name in order if _level_runs(name, flags)]
    if requested is None:
        level = runnable[-1]
    else:
        requested = requested.strip().lower()
        if requested not in order:
            why = f"known levels are {', '.join(order)}"
            raise ValueError(f"{ISA_ENV}={requested!r} is not a level the kernels have ({why}); set it to one of "
                             f"{', '.join(runnable)} (what this CPU runs) or unset it")
        if requested not in runnable:
            needed = dict(ISA_LEVELS)[requested] | KERNEL_LEVELS[requested][1]
            raise ValueError(f"{ISA_ENV}={requested} needs the CPU flags {', '.join(sorted(needed - flags))}, which "
                             f"this CPU ({capabilities.model}) lacks; the highest it runs is {runnable[-1]}: set "
                             f"{ISA_ENV} to one of {', '.join(runnable)} or unset it")
        level = requested
    features = tuple(name for name in order[1:order.index(level) + 1] if name in runnable)
    return IsaChoice(level=level, features=features, forced=requested is not None)


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
    cflags, ldflags = ["-O3", "-std=c++17", "-fopenmp", f"-DLLMINFER_MATVEC_MAX_ROWS={MAX_TOKENS}",
                       f"-DLLMINFER_SPLIT_KEYS={SPLIT_KEYS}"], ["-fopenmp"]
    digest = hashlib.sha256(source + torch.__version__.encode() + " ".join(cflags + ldflags).encode()).hexdigest()[:12]
    name = f"llminfer_cpu_kernels_{digest}"
    build = cache_dir() / name
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        print(f"llminfer: compiling the CPU decode kernels once into {build} (about 15 s)", file=sys.stderr)
    _state["build"] = str(build)
    cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=cflags, extra_ldflags=ldflags,
                       build_directory=str(build), is_python_module=False, verbose=False)
    _register_fakes()


def _register_fakes() -> None:
    def dense(x, w, *rest):
        return x.new_empty((x.shape[0], w.shape[0] * (8 if w.dim() == 3 else 1)))    # int4 tiles: 8 rows each

    for op in ("gemv_f32", "gemv_bf16", "gemv_int8", "gemv_int4", "gemv_int4_a8"):
        torch.library.register_fake(f"llminfer::{op}", dense)
    torch.library.register_fake("llminfer::decode_attention",
                                lambda q, k, v, mask, scale: q.new_empty(q.shape))
    torch.library.register_fake("llminfer::decode_layer", lambda x, *rest: x.new_empty(x.shape))
    torch.library.register_fake("llminfer::decode_layers", lambda x, *rest: x.new_empty(x.shape))
    torch.library.register_fake("llminfer::decode_layers_paged", lambda x, *rest: x.new_empty(x.shape))
    torch.library.register_fake("llminfer::decode_layers_prepared", lambda stack, x, cos, sin, positions:
                                x.new_empty(x.shape))
    torch.library.register_fake("llminfer::paged_attention", lambda q, *rest: q.new_empty(q.shape))


def load() -> bool:
    """Builds (once) and loads the kernels; True when `torch.ops.llminfer.gemv_*` can be called. ValueError
    for an LLMINFER_ISA this CPU cannot run (before anything is built)."""
    with _lock:
        if _state["loaded"] or _state["error"] is not None:
            return _state["loaded"]
        if os.environ.get("LLMINFER_NATIVE_KERNELS", "1") == "0":
            _state["error"] = "turned off by LLMINFER_NATIVE_KERNELS=0"
            return False
        choice = choose_isa()                  # a bad LLMINFER_ISA is refused here, before the build
        try:
            _build()
        except Exception as error:            # no compiler, no ninja, a failed build: torch's kernels remain
            _state["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            print(f"llminfer: the native CPU decode kernels did not build ({_state['error']}); torch's kernels run "
                  "instead. A C++ compiler (g++ or clang) and ninja build them.", file=sys.stderr)
            return False
        missing = int(torch.ops.llminfer.set_cpu_features(choice.bits))
        if missing:                            # the flags said yes, the CPU itself says no
            raise RuntimeError(f"the CPU lacks instruction sets (bits {missing}) that its flags list for "
                               f"{choice.level}; set {ISA_ENV} to a lower level")
        _state["isa"] = choice
        _state["loaded"] = True
        _choose_matvec(choice)
        return True


class PreparedStack:
    """A layer stack's weights and caches kept by the kernels under a number (`torch.ops.llminfer.prepare_stack`),
    for `decode_layers_prepared(number, x, cos, sin, positions)`: the tensors (as `decode_layers` takes them, with
    its layout and epsilons) are checked at the first step and then only referred to, and each step writes its
    K/V into these caches. The number is released when this object goes. Chapter 08.
    """

    def __init__(self, tensors: list[torch.Tensor], layout: list[int], eps: list[float],
                 k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], n_heads: int, scale: float,
                 dtype: torch.dtype, weight_dtypes: tuple[torch.dtype, ...] = ()):
        self.dtype = dtype                     # the activations' dtype it was prepared for
        self.weight_dtypes = weight_dtypes     # its products' weights' (float, int8 codes, int4 nibbles)
        self.id = int(torch.ops.llminfer.prepare_stack(list(tensors), layout, eps, list(k_caches), list(v_caches),
                                                       n_heads, scale))
        self._release = torch.ops.llminfer.release_stack

    def runs(self, rows: int) -> bool:
        """Whether a step of `rows` rows of x runs natively: a decode step's few rows always; a prefill's where the
        blocked kernel runs for each of its weights' dtypes (`blocked_prefill`), as the layers' own path decides."""
        return rows <= MAX_TOKENS or all(blocked_prefill(dtype, rows) for dtype in self.weight_dtypes)

    def __del__(self):
        try:
            self._release(self.id)
        except (RuntimeError, AttributeError, TypeError):   # interpreter shutdown: the table goes with the process
            pass


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
    """Returns the level of KERNEL_LEVELS whose loops run in this process ('unavailable' without the kernels).
    Appendix A1."""
    return _state["isa"].level if load() else "unavailable"


def isa_features() -> tuple[str, ...]:
    """Returns the instruction sets the kernels run here, lowest first (empty for the portable loops). Appendix A1."""
    return _state["isa"].features if load() else ()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (empty where there is no such file)."""
    from ..device import cpu_capabilities

    return cpu_capabilities().flags


def bfloat16_in_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 itself (AVX512-BF16 or AMX), which torch's bfloat16 matmul (oneDNN)
    then uses."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


def _kept_file(name: str) -> Path | None:
    """Where answers measured on this machine are kept: beside the kernel build (None before it exists)."""
    build = _state.get("build")
    return None if build is None else Path(build) / name


def _read_kept(path: Path | None) -> dict:
    """The answers kept in `path` ({} where there are none, or they cannot be read)."""
    try:
        return json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (OSError, ValueError):
        return {}


def _write_kept(path: Path | None, answers: dict) -> None:
    """Keeps `answers` in `path`, where it can be written (a read-only cache just measures again next time)."""
    if path is not None:
        try:
            path.write_text(json.dumps(answers, indent=1, sort_keys=True))
        except OSError:
            pass


def _machine_key(level: str) -> str:
    """The start of a measured answer's key: the CPU, the kernels' level and torch's thread count."""
    from ..device import cpu_slug

    return f"{cpu_slug()}|{level}|{torch.get_num_threads()} threads"


# A layer's products, (N, K) each: SmolLM2-135M's fused qkv, o, gate_up and down. The decode loops' probe and the
# prefill's (below) both time them, as a step runs them.
PREFILL_PROBE_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))

# The decode loops' choice. Each weight format's matrix-vector loops exist at several levels, and the widest is not
# always the fastest: on a Zen 4 (512-bit operations run as two 256-bit halves) the AVX2 loops stream float32 and
# bfloat16 weights faster than the AVX-512 ones. So when the kernels load, each format's candidate loops (those of
# MATVEC_CANDIDATES that this process runs) take turns on about MATVEC_PROBE_BYTES of weights, about twice a server's
# last-level cache, and the fastest median of MATVEC_REPEATS turns wins (`choose_fastest`). The bytes are read as a
# decode step reads them: a layer's four products (PREFILL_PROBE_SHAPES, SmolLM2-135M's), layer after layer on
# fresh weights. A loop can win on one large matrix and lose on a step's small ones (each starts a new stream cold,
# and a call's fixed work, such as rounding x to int8 for W4A8, weighs more): on a Zen 5 the 1 MiB products picked
# a float32 loop that lost the step by 8 %. The W4A8 loop on 512-bit registers still edges this probe there (by
# 2-5 %) and loses the step by 6 %. The answers are kept beside the kernel
# build, keyed by CPU class (`llminfer.device.cpu_slug`), level and thread count at load, so a machine measures once.
# With LLMINFER_ISA set, nothing is measured: every format runs the forced level's own loops (so each level's loops
# can be tested on any machine that has it).
# A candidate is a level's loops, or one of MATVEC_VARIANTS: another loop at a level (its name, the level's and
# the loop's). int4 with float x has two on AVX2: x widened against the codes in float32 ('avx2'), or x as three int8
# planes by maddubs ('avx2_planes', as 'avx512_vnni' does with vpdpbusd): on a Zen 3 the float loop's conversions
# and FMAs bound it at about 17 GB/s of a 34 GB/s read.
MATVEC_CANDIDATES: dict[str, tuple[int, tuple[str, ...]]] = {     # format -> (MatvecKind in C++, candidates)
    "float32": (0, ("avx2", "avx512")),
    "bfloat16": (1, ("avx2", "avx512", "avx512_bf16")),
    "int8": (2, ("avx2", "avx512")),
    "int4": (3, ("avx2", "avx2_planes", "avx512", "avx512_vnni")),   # the planes loops: float x as three int8 planes
    "int4a8": (4, ("avx2", "avx_vnni", "avx512_vnni")),
}
# candidate -> (the level it runs at, the C++ loop's bit: LoopVariant in cpu_kernels.h)
MATVEC_VARIANTS: dict[str, tuple[str, int]] = {"avx2_planes": ("avx2", 1 << 16)}
MATVEC_PROBE_BYTES = 64 << 20
MATVEC_REPEATS = 15                     # turns of each candidate: about 2 ms each, so 0.1-0.2 s a format
# what a kept answer was timed on: an answer timed otherwise (an earlier version's probe) is timed again
MATVEC_PROBE = (f"{MATVEC_PROBE_BYTES >> 20} MiB as layers of products "
                + ", ".join(f"{n}x{k}" for n, k in PREFILL_PROBE_SHAPES))
# what an answer timed on a real decode step was timed on (`remeasure_matvec(steps=...)`, as the decode benchmark
# times each format's loops on its own contender): a step and the probe can disagree (on a Zen 5 the probe put the
# W4A8 loop on 512-bit registers, and the step ran 6 % faster on the 256-bit one), and the step is what is served
MATVEC_STEP = "the decode step of a model in the format"
MATVEC_STEP_REPEATS = 5                 # turns of each candidate on a step's run (a few tens of tokens each)
_matvec: dict = {"choices": {}}


def choose_fastest(timings: dict[str, list[float]]) -> str:
    """Returns the key of `timings` {level: [s, ...]} with the lowest median; on a tie, the first. Appendix A1."""
    if not timings or not all(timings.values()):
        raise ValueError(f"choose_fastest needs some timings for every candidate, got {timings}")
    medians = {key: statistics.median(times) for key, times in timings.items()}
    return min(medians, key=lambda key: (medians[key], list(medians).index(key)))


def matvec_candidates(name: str, choice: IsaChoice | None = None) -> tuple[str, ...]:
    """Returns the levels whose matrix-vector loops for weight format `name` (a key of MATVEC_CANDIDATES) this
    process can run: those among its features (default: the process's own choice). Appendix A1."""
    if name not in MATVEC_CANDIDATES:
        raise ValueError(f"format {name!r} is not one of {', '.join(MATVEC_CANDIDATES)}")
    choice = choice or _state["isa"]
    return tuple(candidate for candidate in MATVEC_CANDIDATES[name][1]
                 if MATVEC_VARIANTS.get(candidate, (candidate,))[0] in choice.features)


def _level_bits(level: str, choice: IsaChoice) -> int:
    """The feature bits of `level` (a level, or a candidate of MATVEC_VARIANTS: its level's bits and its loop's) and
    every lower level the process runs."""
    level, loop = MATVEC_VARIANTS.get(level, (level, 0))
    order = list(KERNEL_LEVELS)
    return loop + sum(KERNEL_LEVELS[name][0] for name in choice.features if order.index(name) <= order.index(level))


def _matvec_probe(name: str) -> tuple[list[tuple[torch.Tensor, list]], str]:
    """Random weights of about MATVEC_PROBE_BYTES in all in format `name`, as a decode step's products: layers of
    PREFILL_PROBE_SHAPES on fresh weights (views of one block a shape, on 2 MiB pages); returns each product's x
    and gemv's arguments after x, in the order a step runs them, and the activations."""
    from ..device import huge_page_copy

    generator = torch.Generator().manual_seed(0)

    def per_row(K: int) -> int:
        return {"float32": 4 * K, "bfloat16": 2 * K, "int8": K + 4}.get(name, K // 2 + 4 * (K // 32))

    layer_bytes = sum(N * per_row(K) for N, K in PREFILL_PROBE_SHAPES)
    layers = max(1, -(-MATVEC_PROBE_BYTES // layer_bytes))

    by_shape = []
    for N, K in PREFILL_PROBE_SHAPES:                             # every layer's (N, K) product: one block
        rows = layers * N
        if name in ("float32", "bfloat16"):
            dense = (torch.rand(rows, K, generator=generator) - 0.5).to(getattr(torch, name))
            whole, steps = [huge_page_copy(dense)], (1,)
            extra: tuple = ()
        elif name == "int8":
            whole = [huge_page_copy(torch.randint(-127, 128, (rows, K), dtype=torch.int8, generator=generator)),
                     torch.rand(rows, generator=generator)]
            steps, extra = (1, 1), ()
        else:                                                     # int4 tiles, float16 terms as the layers keep
            nibbles = torch.randint(0, 256, (rows, K // 2), dtype=torch.uint8, generator=generator)
            scale, offset = (torch.rand(rows, K // 32, generator=generator).half() for _ in range(2))
            whole, steps, extra = [huge_page_copy(t) for t in tile_int4(nibbles, scale, offset)], (8, 8, 8), (32,)
        x = torch.randn(1, K, generator=generator)
        x = x.to(getattr(torch, name)) if name in ("float32", "bfloat16") else x
        by_shape.append([(x, [t[n // step:(n + N) // step] for t, step in zip(whole, steps)] + list(extra))
                         for n in range(0, rows, N)])
    products = [by_shape[s][layer] for layer in range(layers) for s in range(len(PREFILL_PROBE_SHAPES))]
    return products, "int8" if name == "int4a8" else "float"


def measure_matvec(name: str, levels: tuple[str, ...], repeats: int = MATVEC_REPEATS,
                   run: Callable[[], float] | None = None) -> dict[str, list[float]]:
    """Returns the seconds to multiply one row by about MATVEC_PROBE_BYTES of weights in format `name` (layers of a
    decode step's products, one after the other), by level, the levels taking turns (after one warm-up each); the
    format's loops are left as they were. With `run`, the seconds it returns are timed instead (decode steps of a
    model in the format, say). Appendix A1."""
    _require()
    choice, (kind, _) = _state["isa"], MATVEC_CANDIDATES[name]
    unknown = [level for level in levels if level not in matvec_candidates(name, choice)]
    if unknown:
        raise ValueError(f"{unknown} are not levels this process runs {name} loops at; choose from "
                         f"{matvec_candidates(name, choice)}")
    before = int(torch.ops.llminfer.matvec_features(kind))
    if run is None:
        products, activations = _matvec_probe(name)

        def run() -> float:
            start = time.perf_counter()
            for x, parts in products:
                gemv(x, *parts, activations=activations)
            return time.perf_counter() - start
    timings: dict[str, list[float]] = {level: [] for level in levels}
    try:
        with torch.inference_mode():
            for round_index in range(repeats + 1):
                for level in levels:
                    torch.ops.llminfer.set_matvec_features(kind, _level_bits(level, choice))
                    seconds = run()
                    if round_index:                          # the first round warms up
                        timings[level].append(seconds)
    finally:
        torch.ops.llminfer.set_matvec_features(kind, before)
    return timings


def _choose_matvec(choice: IsaChoice, fresh: bool = False, steps: dict[str, Callable[[], float]] | None = None) -> None:
    """Sets each format's matrix-vector loops: measured (or read from the kept answers unless `fresh`), or the forced
    level's; the formats in `steps` timed on their run (`measure_matvec`'s run) rather than on the probe."""
    steps = steps or {}
    _matvec["choices"] = {}
    path = _kept_file("matvec_choices.json")
    kept = {} if choice.forced else _read_kept(path)
    changed = False
    for name, (kind, _) in MATVEC_CANDIDATES.items():
        torch.ops.llminfer.set_matvec_features(kind, -1)            # the process's own loops, unless measured
        levels = matvec_candidates(name, choice)
        if not levels:
            continue
        if choice.forced or len(levels) == 1:
            _matvec["choices"][name] = {"level": levels[-1], "measured": False}
            continue
        key = f"{_machine_key(choice.level)}|{name}"
        if (fresh or key not in kept or kept[key].get("level") not in levels
                or kept[key].get("probe") not in (MATVEC_PROBE, MATVEC_STEP)):
            if name in steps:
                timings, probe = measure_matvec(name, levels, MATVEC_STEP_REPEATS, run=steps[name]), MATVEC_STEP
            else:
                timings, probe = measure_matvec(name, levels), MATVEC_PROBE
            kept[key] = {"level": choose_fastest(timings), "probe": probe,
                         "median_s": {level: statistics.median(t) for level, t in timings.items()}}
            changed = True
        torch.ops.llminfer.set_matvec_features(kind, _level_bits(kept[key]["level"], choice))
        _matvec["choices"][name] = dict(kept[key], measured=True)
    if changed:
        _write_kept(path, kept)


def remeasure_matvec(steps: dict[str, Callable[[], float]] | None = None) -> dict[str, dict]:
    """Times each format's candidate decode loops again now (a benchmark does, so that its choice is made under the
    same conditions as its rounds, not at load), sets and keeps the winners; returns `matvec_choices()`. `steps`
    maps formats (keys of MATVEC_CANDIDATES) to a run that returns the seconds of some decode steps of a model in
    that format: those formats are timed on their steps, the rest on the probe. With LLMINFER_ISA set, nothing is
    measured. Appendix A1."""
    _require()
    unknown = sorted(set(steps or {}) - set(MATVEC_CANDIDATES))
    if unknown:
        raise ValueError(f"steps for {unknown}: formats are {', '.join(MATVEC_CANDIDATES)}")
    with _lock:
        _choose_matvec(_state["isa"], fresh=True, steps=steps)
    return matvec_choices()


def matvec_choices() -> dict[str, dict]:
    """Returns, per weight format, the level whose matrix-vector loops run here ('level'), whether it was measured
    here (else forced by LLMINFER_ISA, or the only candidate) and the median seconds of each candidate. Appendix
    A1."""
    load()
    return {name: dict(entry) for name, entry in _matvec["choices"].items()}


# The prefill choice. For each (weight dtype, rows) the first prefill asks: does the blocked kernel or torch's matmul
# (after dequantizing, for int8/int4 weights: what the modules do) run a prefill of that many rows faster on this
# machine? A short timing answers, once per process, each path in turn, the lower median winning (the blocked
# kernel on a tie), on what the choice moves. With `llminfer.fast` imported (`set_prefill_probe`), that is a
# prefill of a few random layers of SmolLM2-135M's shape with weights in the format: through the native stack (the
# layers in one call, the products by the blocked kernel) or through the modules (the products by torch's matmul).
# Without it, no stack runs, only the products of quantized layers (`quant.QuantizedLinear`), and the probe is a
# layer's products (PREFILL_PROBE_SHAPES) alone. The answers are also kept beside the kernel build, keyed by CPU
# class, level and threads (`prefill_choices()` reports them).
# The probe once timed a layer's products even for the stack, and took torch's matmul where they ran more than 25 %
# faster. On an Intel Xeon with AMX at 2 threads, oneDNN's bfloat16 products ran 1.43 times as fast as the blocked
# kernel's (1.18 against 1.69 ms), so a fresh process took torch's path for bfloat16; yet a 128-token prefill of
# SmolLM2-135M ran 1.9 times as fast through the stack (49 against 93 ms): the modules' norms, RoPE, attention and
# SwiGLU, bfloat16 ops one after another, outweighed the products.
PREFILL_PATHS = ("blocked", "torch")
# the weight dtypes with a prefill choice, and the scheme a probe's weights are quantized with (`quant.quantize`)
PREFILL_DTYPES = {torch.float32: None, torch.bfloat16: None, torch.int8: ("int8", None), torch.uint8: ("int4", 32)}
# what a kept answer was timed on (an answer timed otherwise, by an earlier version, is timed again)
PREFILL_PRODUCTS = "products " + ", ".join(f"{n}x{k}" for n, k in PREFILL_PROBE_SHAPES)
PREFILL_PROBE_LAYERS = 2
PREFILL_LAYERS_PROBE = f"the prefill of {PREFILL_PROBE_LAYERS} layers of SmolLM2-135M's shape in the format"
# what an answer timed on a whole model's prefill was timed on (`remeasure_prefill`, as the decode benchmark times
# each format's own prefill both ways), decided by the same rule. On an Intel Xeon with AMX, the first-use probe of
# the time (a layer's products) took torch's matmul for float32, and the whole 128-token prefill ran 1.22 times
# faster on the blocked path (131 against 160 ms).
PREFILL_STEP = "the prefill of a model in the format"
PREFILL_STEP_REPEATS = 5                # turns of each path on a whole prefill
PREFILL_ENV = "LLMINFER_PREFILL"           # 'blocked' or 'torch' forces the path (for comparisons); unset: measured
_prefill: dict = {"choices": {}, "forced": None, "loaded_from_disk": False, "probe": None}


def rows_bucket(rows: int) -> int:
    """Returns the rows a prefill's timing stands for: the power of two at or above rows, from 16 to 512."""
    bucket = 16
    while bucket < rows and bucket < 512:
        bucket *= 2
    return bucket


def check_prefill_dtypes(dtypes) -> None:
    """Raises ValueError naming any of dtypes that has no prefill choice (PREFILL_DTYPES)."""
    unknown = [dtype for dtype in dtypes if dtype not in PREFILL_DTYPES]
    if unknown:
        raise ValueError(f"prefills for {unknown}: the weight dtypes with a prefill choice are float32, bfloat16, "
                         "int8 and uint8 (int4)")


def _probe_weight(dtype: torch.dtype, shape: tuple[int, int], seed: int) -> tuple[list[torch.Tensor], callable]:
    """A random (N, K) = `shape` weight of dtype as the kernel takes it, and the modules' product for x."""
    import torch.nn.functional as F

    generator = torch.Generator().manual_seed(seed)
    N, K = shape
    if dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(N, K, generator=generator).to(dtype)
        return [weight], lambda x: F.linear(x, weight)
    if dtype == torch.int8:
        codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=generator)
        scale = torch.rand(N, generator=generator)
        return [codes, scale], lambda x: F.linear(x, codes.to(x.dtype) * scale[:, None].to(x.dtype))
    if dtype == torch.uint8:
        group = 32
        nibbles = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=generator)
        scale, offset = torch.rand(N, K // group, generator=generator), torch.rand(N, K // group, generator=generator)

        def modules(x):
            codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(N, K // group, group).float()
            weight = (codes * scale[..., None] + offset[..., None]).reshape(N, K)
            return F.linear(x, weight.to(x.dtype))
        return [nibbles, scale, offset, group], modules
    check_prefill_dtypes([dtype])


def layer_products(dtype: torch.dtype, rows: int, shapes=PREFILL_PROBE_SHAPES) -> tuple[dict, int]:
    """Returns ({path: run}, FLOPs): `rows` rows of x times a random weight of dtype for each (N, K) of shapes (a
    layer's products, one after the other), by the blocked kernel and by torch's matmul on the modules' weights.
    x is bfloat16 for bfloat16 weights, float32 for the others. The prefill choice's probe where no stack runs
    (`set_prefill_probe`), and the benchmark's native matmul probe. Appendix A1."""
    _require()
    x_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    products = []
    for seed, shape in enumerate(shapes):
        parts, modules = _probe_weight(dtype, shape, seed)
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(100 + seed)).to(x_dtype)
        products.append((parts, modules, x))
    run = {"blocked": lambda: [gemv(x, *parts) for parts, _, x in products],
           "torch": lambda: [modules(x) for _, modules, x in products]}
    return run, sum(2 * rows * n * k for n, k in shapes)


def _time_paths(run: Callable[[], float], repeats: int) -> dict[str, list[float]]:
    """{path: seconds} of `run` (which returns its seconds) forced onto each prefill path in turn, `repeats` turns
    each after a warm-up turn."""
    timings: dict[str, list[float]] = {path: [] for path in PREFILL_PATHS}
    for round_index in range(repeats + 1):
        for path in PREFILL_PATHS:
            with force_prefill(path):
                seconds = run()
            if round_index:                      # the first round warms up
                timings[path].append(seconds)
    return timings


def set_prefill_probe(make_run: Callable[[torch.dtype, int], Callable[[], None]] | None) -> None:
    """Sets how the first use of a (weight dtype, rows) times a prefill: make_run(dtype, rows) returns a run of a
    prefill of that many rows through PREFILL_PROBE_LAYERS layers with weights of dtype, on the path in force
    (`force_prefill`; PREFILL_LAYERS_PROBE). `llminfer.fast` sets one (`fast.prefill_probe`) when it is imported;
    None restores the default, a layer's products (`layer_products`). Choices made on the products are dropped where
    a prefill probe is set, to be timed again at their next use. Appendix A1."""
    with _lock:
        _prefill["probe"] = make_run
        kept = _prefill_kept_probes()
        _prefill["choices"] = {k: v for k, v in _prefill["choices"].items() if v.get("probe") in kept}


def prefill_probe_name() -> str:
    """What the first use of a prefill choice times here (`set_prefill_probe`)."""
    return PREFILL_LAYERS_PROBE if _prefill["probe"] else PREFILL_PRODUCTS


def _prefill_kept_probes() -> tuple[str, ...]:
    """The probes whose kept answers this process takes: those timed on prefills always, the products only where no
    prefill is timed here."""
    return (PREFILL_STEP, PREFILL_LAYERS_PROBE) + (() if _prefill["probe"] else (PREFILL_PRODUCTS,))


def measure_prefill(dtype: torch.dtype, rows: int, repeats: int = 5) -> dict[str, list[float]]:
    """Returns the seconds of the probe (`prefill_probe_name()`) with `rows` rows and weights of dtype, by path:
    the blocked kernel (in the native stack, with `llminfer.fast`) and torch's matmul (in the modules), taking
    turns after one warm-up each. Appendix A1."""
    check_prefill_dtypes([dtype])
    if _prefill["probe"]:
        run = _prefill["probe"](dtype, rows)
    else:
        products, _ = layer_products(dtype, rows)

        def run():
            products[_prefill["forced"]]()

    def timed() -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    return _time_paths(timed, repeats)


def _choice_key(dtype: torch.dtype, rows: int) -> str:
    return f"{_machine_key(isa())}|{str(dtype).removeprefix('torch.')}|{rows}"


def prefill_path(weight_dtype: torch.dtype = torch.float32, rows: int = 128) -> str:
    """Returns 'blocked' or 'torch': the path a prefill of `rows` rows with weights of weight_dtype takes here,
    measured at first use (`prefill_choice`) and cached; 'torch' without the vector loops. LLMINFER_PREFILL or
    `force_prefill` overrides it. Appendix A1."""
    forced = _prefill["forced"] or os.environ.get(PREFILL_ENV) or None
    if forced is not None and forced not in PREFILL_PATHS:
        raise ValueError(f"{PREFILL_ENV}={forced!r} must be one of {PREFILL_PATHS}, or unset to measure")
    if not ((_state["loaded"] or load()) and isa() != "portable"):
        return "torch"
    return forced or prefill_choice(weight_dtype, rows)["path"]


def prefill_choice(weight_dtype: torch.dtype = torch.float32, rows: int = 128) -> dict:
    """Returns the measured choice for a prefill of `rows` rows with weights of weight_dtype, {'path', 'probe',
    'median_s': {path: seconds}}: kept from an earlier process, or timed now (`measure_prefill`, `choose_fastest`)
    and kept. A forced path (`force_prefill`, LLMINFER_PREFILL) is not consulted. Appendix A1."""
    check_prefill_dtypes([weight_dtype])
    _require()
    if isa() == "portable":
        raise RuntimeError("no prefill choice to make: the kernels run portable loops here, so prefills take torch's "
                           f"matmul (the blocked kernel needs AVX2; {ISA_ENV} may have lowered the level)")
    key = _choice_key(weight_dtype, rows_bucket(rows))
    choices = _prefill["choices"]
    if key not in choices:
        with _lock:
            _read_kept_prefill()
            if key not in choices:
                timings = measure_prefill(weight_dtype, rows_bucket(rows))
                choices[key] = {"path": choose_fastest(timings), "probe": prefill_probe_name(),
                                "median_s": {p: statistics.median(t) for p, t in timings.items()}}
                _write_kept(_kept_file("prefill_choices.json"), choices)
    return dict(choices[key])


def _read_kept_prefill() -> None:
    """Adds the kept prefill answers to the process's, once, each decided by today's rule: the lower median
    (`choose_fastest`); an answer timed on a probe this process does not take (`_prefill_kept_probes`: an earlier
    version's, or the products where a prefill is timed here) is left out, to be timed again. Called under _lock."""
    choices = _prefill["choices"]
    if _prefill["loaded_from_disk"]:
        return
    for k, v in _read_kept(_kept_file("prefill_choices.json")).items():
        if k not in choices and set(v.get("median_s", {})) == set(PREFILL_PATHS):
            medians = {p: [v["median_s"][p]] for p in PREFILL_PATHS}
            if v.get("probe") in _prefill_kept_probes():
                choices[k] = dict(v, path=choose_fastest(medians))
    _prefill["loaded_from_disk"] = True


def remeasure_prefill(prefills: dict[torch.dtype, Callable[[], float]], rows: int,
                      repeats: int = PREFILL_STEP_REPEATS) -> dict[str, dict]:
    """Times each weight dtype's prefill path on a whole prefill and keeps the faster: `prefills` maps weight dtypes
    (float32, bfloat16, int8, uint8 for int4) to a run that prefills `rows` rows through a model with such weights
    and returns its seconds. Each run takes its turn forced onto the blocked kernel and onto torch's matmul
    (`force_prefill`), after one warm-up each; the lower median wins (the blocked kernel on a tie), is set for
    (dtype, rows' bucket) and kept beside the kernel build, as the first use's probe would be (a benchmark does
    this, so that the path served is the one that ran its own model's prefill faster, where the first use times a
    few layers, `measure_prefill`). Returns `prefill_choices()`. Without the vector loops nothing is measured.
    Appendix A1."""
    check_prefill_dtypes(prefills)
    if not (_state["loaded"] or load()) or isa() == "portable":
        return prefill_choices()
    with _lock:
        _read_kept_prefill()                             # the kept answers read first, so these replace theirs
        for dtype, run in prefills.items():
            timings = _time_paths(run, repeats)
            _prefill["choices"][_choice_key(dtype, rows_bucket(rows))] = {
                "path": choose_fastest(timings), "probe": PREFILL_STEP,
                "median_s": {p: statistics.median(t) for p, t in timings.items()}}
        _write_kept(_kept_file("prefill_choices.json"), _prefill["choices"])
    return prefill_choices()


def prefill_choices() -> dict[str, dict]:
    """Returns the prefill choices made so far: key (CPU|level|threads|dtype|rows) -> path and median seconds."""
    return dict(_prefill["choices"])


class force_prefill:
    """Context manager: every prefill takes `path` ('blocked' or 'torch'; None: measured) inside it. Appendix A1."""

    def __init__(self, path: str | None):
        if path is not None and path not in PREFILL_PATHS:
            raise ValueError(f"path={path!r} must be one of {PREFILL_PATHS} or None")
        self.path = path

    def __enter__(self):
        self.before, _prefill["forced"] = _prefill["forced"], self.path
        return self

    def __exit__(self, *exc):
        _prefill["forced"] = self.before


def blocked_prefill(weight_dtype: torch.dtype | None = None, rows: int = 128) -> bool:
    """Whether products of `rows` rows of x (a prefill) with weights of `weight_dtype` (float32 when None) run
    the blocked kernel rather than torch's matmul: as measured here (`prefill_path`). Chapter 08."""
    return prefill_path(torch.float32 if weight_dtype is None else weight_dtype, rows) == "blocked"


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         offset: torch.Tensor | None = None, group: int | None = None, activations: str = "float") -> torch.Tensor:
    """x (tokens, K) times the weight's transpose, by the kernel for the weight's dtype. Chapter 08.

    float32 and bfloat16 weights (N, K); int8 codes (N, K) with `scale` (N,) or (N, K/group) (GGUF's Q8_0:
    groups of 32); int4 nibbles (N, K/2) uint8 with `scale` and `offset` (N, K/group) float32, where
    w = q·scale + offset, or the same in tiles of 8 rows (`tile_int4`: codes (N/8, K/8, 32), scale and offset
    (N/8, K/group, 8), float32 or float16), the layout the fastest int4 loops read. activations="int8" (int4 only,
    W4A8) rounds x to int8 per block of 32 inputs and multiplies in integers: faster, and it changes the numbers.
    """
    _require()
    if activations not in ("float", "int8"):
        raise ValueError(f"activations={activations!r} must be 'float' or 'int8'")
    if activations == "int8":
        if weight.dtype != torch.uint8:
            raise ValueError(f"activations='int8' is for int4 weights (uint8 nibbles), got {weight.dtype}")
        return torch.ops.llminfer.gemv_int4_a8(x, weight, scale, offset, group)
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


def tile_int4(nibbles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-major int4 (nibbles (N, K/2), scale and offset (N, G)) in tiles of 8 rows: codes (N/8, K/8, 32), where
    tile t, chunk c holds rows 8t..8t+7's 4 bytes for inputs 8c..8c+7 side by side, and scale, offset (N/8, G, 8)
    in their own dtype (float32, or float16: 2 bytes a term, as GGUF's Q4_0 and Q4_1 keep theirs). Chapter 08."""
    n, half = nibbles.shape
    if n % 8 or half % 4:
        raise ValueError(f"tiles of 8 rows need N a multiple of 8 and K a multiple of 8, got a ({n} x {half * 2}) "
                         "weight; keep it row-major")
    codes = nibbles.reshape(n // 8, 8, half // 4, 4).permute(0, 2, 1, 3).reshape(n // 8, half // 4, 32)
    tiles = [t.reshape(n // 8, 8, t.shape[1]).transpose(1, 2) for t in (scale, offset)]
    return codes.contiguous(), tiles[0].contiguous(), tiles[1].contiguous()


def untile_int4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `tile_int4`: row-major nibbles (N, K/2), scale and offset (N, G). Chapter 08."""
    tiles, chunks, _ = codes.shape
    nibbles = codes.reshape(tiles, chunks, 8, 4).permute(0, 2, 1, 3).reshape(tiles * 8, chunks * 4)
    rows = [t.transpose(1, 2).reshape(tiles * 8, t.shape[1]) for t in (scale, offset)]
    return nibbles.contiguous(), rows[0].contiguous(), rows[1].contiguous()


def stream_read(data: torch.Tensor, width: int = 0) -> int:
    """Reads every byte of a contiguous CPU tensor once, on every thread, with loads of `width` bytes (64 with
    AVX-512, 32 with AVX2, 8; 0: the widest in use); returns a checksum. The decode benchmark's native bandwidth
    probes. Chapter 08."""
    _require()
    return int(torch.ops.llminfer.stream_read(data, width))


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


# importing the backend registers its decode attention as the attention backend "native"
register_backend("native", attention_backend)
