"""The native CPU backend: products, attention and whole layers in C++ (beside this file). Chapter 08, Appendix A1.

`gemv` multiplies float32, bfloat16, int8 or int4 weights (int4 also with int8 activations, W4A8) in their stored
layouts: the multi-row matrix-vector loops up to MAX_TOKENS rows (decode), the blocked kernel past them (prefill).
Beside it `decode_attention` (the attention backend 'native'), `paged_attention`, the layer stack (`cpu.stack`) and
`stream_read`. The loops are chosen once, at load, from the CPU's flags (`choose_isa`, the static table DECODE_LOOPS):
nothing is timed or kept. LLMINFER_ISA forces a level, LLMINFER_PREFILL a prefill's path. The source compiles on first
use (about 15 s) into LLMINFER_KERNEL_CACHE (default ~/.cache/llminfer/kernels); without a compiler `available()` is
False, `why_unavailable()` says why and callers keep torch's kernels; LLMINFER_NATIVE_KERNELS=0 turns them off.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from llminfer.attention import fast_attention, register_backend

__all__ = ["available", "why_unavailable", "load", "isa", "isa_features", "choose_isa", "IsaChoice", "ISA_ENV",
           "KERNEL_LEVELS", "DECODE_FORMATS", "DECODE_LOOPS", "decode_loops", "gemv", "decode_attention",
           "paged_attention", "attention_backend", "prefill_path", "force_prefill", "blocked_prefill", "stream_read",
           "PREFILL_PATHS", "PREFILL_ENV", "MAX_TOKENS", "SPLIT_KEYS", "tile_int4", "untile_int4", "SOURCES",
           "HEADERS"]

_HERE = Path(__file__).parent
# the units of one extension (cpu_kernels.h says what each holds; the build's hash covers them all)
SOURCES = tuple(_HERE / name for name in ("cpu_ref.cpp", "cpu_avx2.cpp", "cpu_avx512.cpp", "cpu_matvec.cpp",
                                          "cpu_gemm.cpp", "cpu_attention.cpp", "cpu_layers.cpp", "cpu_ops.cpp"))
HEADERS = (_HERE / "cpu_kernels.h", _HERE / "cpu_vec.h")
# Products of up to this many rows of x take the multi-row matrix-vector loops (each weight read once for all the
# rows), more rows the blocked kernel (`python -m llminfer.bench rows` prints a step's cost by rows). Compiled in.
MAX_TOKENS = 16
# A decode step's threads share attention by K/V heads, and from this many cached positions on by blocks of keys,
# merged in order (the numbers do not depend on the thread count). Compiled in. Appendix A1.
SPLIT_KEYS = 1024

_lock = threading.Lock()
_state: dict = {"loaded": False, "error": None}

ISA_ENV = "LLMINFER_ISA"
# The levels the kernels have loops for, lowest first (llminfer.device.ISA_LEVELS' names): the bit of `Feature`
# (cpu_kernels.h) each adds and the flags its loops need beyond the level's own. amx runs bfloat16 prefills only.
KERNEL_LEVELS: dict[str, tuple[int, frozenset[str]]] = {
    "portable": (0, frozenset()),
    "avx2": (1, frozenset({"f16c"})),                                   # 8-lane float loops, maddubs W4A8
    "avx512": (2, frozenset({"avx512bw", "avx512vl"})),                 # 16-lane float loops
    "avx512_vnni": (4, frozenset({"avx512bw", "avx512vl"})),            # int4 and W4A8 by vpdpbusd (EVEX)
    "avx512_bf16": (8, frozenset({"avx512bw", "avx512vl"})),            # bfloat16 by vdpbf16ps
    "amx": (32, frozenset({"avx512bw", "avx512vl", "avx512_bf16"})),    # a prefill's bfloat16 products by tdpbf16ps
}
# The weight formats with their own decode loops, in the C++'s order (MatvecKind in cpu_kernels.h).
DECODE_FORMATS = ("float32", "bfloat16", "int8", "int4", "int4a8")
# Each format's decode loops by CPU class (the first row whose vendor and flags the CPU has): the level that ran
# its decode steps fastest in the class's record (data/benchmarks/decode-cpu-<class>.json, "kernels" > "matvec",
# medians in seconds; docs/performance/). The widest is not the fastest everywhere (a Zen 4 halves 512-bit work).
DECODE_LOOPS: tuple[tuple[str, str, frozenset[str], dict[str, str]], ...] = (
    # decode-cpu-intel-xeon-avx512-amx.json (Intel's other AVX-512 Xeons take it too)
    ("Intel Xeon, AVX-512", "GenuineIntel", frozenset({"avx512f"}),
     {"float32": "avx512", "bfloat16": "avx512_bf16", "int8": "avx512", "int4": "avx512_vnni", "int4a8": "avx512_vnni"}),
    # decode-cpu-amd-epyc-zen5-avx512.json (a Zen 5 has AVX-VNNI, a Zen 4 does not)
    ("AMD Zen 5, AVX-512", "AuthenticAMD", frozenset({"avx512f", "avx_vnni"}),
     {"float32": "avx2", "bfloat16": "avx512", "int8": "avx2", "int4": "avx512", "int4a8": "avx2"}),
    # decode-cpu-amd-epyc-zen4-avx512.json
    ("AMD Zen 4, AVX-512", "", frozenset({"avx512f"}),
     {"float32": "avx2", "bfloat16": "avx2", "int8": "avx512", "int4": "avx512", "int4a8": "avx2"}),
    # decode-cpu-amd-epyc.json: the one vector level
    ("AVX2", "", frozenset({"avx2"}), {name: "avx2" for name in DECODE_FORMATS}),
)


@dataclass(frozen=True)
class IsaChoice:
    """The kernels' level, the instruction sets it runs and each format's decode loops. Appendix A1."""

    level: str                   # one of KERNEL_LEVELS
    features: tuple[str, ...]    # the levels whose instructions run, lowest first (level among them)
    forced: bool                 # chosen by LLMINFER_ISA rather than by the CPU's flags
    decode: tuple[tuple[str, str], ...] = ()    # (format, level) of DECODE_FORMATS: the level its decode loops run
    cpu_class: str = ""          # the row of DECODE_LOOPS that chose them ("" where forced or none applies)

    @property
    def bits(self) -> int:
        """The feature bits of the level (set_cpu_features)."""
        return self.level_bits(self.level)

    def level_bits(self, level: str) -> int:
        """Returns the feature bits (set_cpu_features) of `level` and every lower level this choice runs."""
        order = list(KERNEL_LEVELS)
        return sum(KERNEL_LEVELS[name][0] for name in self.features if order.index(name) <= order.index(level))


def _level_runs(name: str, flags: frozenset[str]) -> bool:
    from ..device import ISA_LEVELS

    return dict(ISA_LEVELS)[name] | KERNEL_LEVELS[name][1] <= flags


def choose_isa(capabilities=None, requested: str | None = None) -> IsaChoice:
    """Returns the IsaChoice for a CPU (default this one): `requested` (default $LLMINFER_ISA) if the CPU has it,
    else the highest level it has, with each format's decode loops from DECODE_LOOPS (a forced level: its own);
    ValueError for an unknown level or one above the CPU. Appendix A1."""
    from ..device import ISA_LEVELS, cpu_capabilities

    capabilities = capabilities or cpu_capabilities()
    flags = capabilities.flags
    requested = os.environ.get(ISA_ENV) or None if requested is None else requested
    order = list(KERNEL_LEVELS)
    runnable = [name for name in order if _level_runs(name, flags)]
    level = runnable[-1]
    if requested is not None:
        level = requested.strip().lower()
        if level not in order:
            raise ValueError(f"{ISA_ENV}={level!r} is not a level the kernels have (known levels are "
                             f"{', '.join(order)}); set it to one of {', '.join(runnable)} (what this CPU runs) or "
                             "unset it")
        if level not in runnable:
            needed = dict(ISA_LEVELS)[level] | KERNEL_LEVELS[level][1]
            raise ValueError(f"{ISA_ENV}={level} needs the CPU flags {', '.join(sorted(needed - flags))}, which "
                             f"this CPU ({capabilities.model}) lacks; the highest it runs is {runnable[-1]}: set "
                             f"{ISA_ENV} to one of {', '.join(runnable)} or unset it")
    features = tuple(name for name in order[1:order.index(level) + 1] if name in runnable)
    decode, cpu_class = {name: features[-1] if features else "portable" for name in DECODE_FORMATS}, ""
    for name, vendor, needed, loops in DECODE_LOOPS if requested is None else ():
        if needed <= flags and vendor in ("", capabilities.vendor):
            cpu_class = name
            decode.update({fmt: loop for fmt, loop in loops.items() if loop in features})
            break
    return IsaChoice(level=level, features=features, forced=requested is not None,
                     decode=tuple(decode.items()), cpu_class=cpu_class)


def decode_loops() -> dict[str, str]:
    """Returns, per weight format of DECODE_FORMATS, the level whose decode loops run in this process. Appendix A1."""
    return dict(_state["isa"].decode) if load() else {}


def _ninja_on_path() -> None:
    """Puts a venv's own `ninja` (not on PATH unless the venv is activated) on PATH for torch's builder."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
        places = [str(ninja.BIN_DIR), str(Path(sys.executable).parent)]
    except ImportError:
        places = [str(Path(sys.executable).parent)]
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
    build = Path(os.environ.get("LLMINFER_KERNEL_CACHE", Path.home() / ".cache" / "llminfer" / "kernels")) / name
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        print(f"llminfer: compiling the CPU decode kernels once into {build} (about 15 s)", file=sys.stderr)
    _state["build"] = str(build)
    # torch marks a build in progress with a file, `lock`, that a killed build leaves behind, and every later start
    # would wait on it forever. An flock dies with its process: holding it, no other build runs, so a `lock` is stale.
    with open(build / "llminfer.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        cpp_extension.load(name=name, sources=[str(path) for path in SOURCES], extra_cflags=cflags,
                           extra_ldflags=ldflags, build_directory=str(build), is_python_module=False, verbose=False)
    torch.library.register_fake("llminfer::gemv", lambda x, parts, *rest: x.new_empty(   # int4 tiles: 8 rows each
        (x.shape[0], parts[0].shape[0] * (8 if parts[0].dim() == 3 else 1))))
    for op in ("decode_attention", "paged_attention"):
        torch.library.register_fake(f"llminfer::{op}", lambda q, *rest: q.new_empty(q.shape))
    torch.library.register_fake("llminfer::run_stack", lambda stack, x, *rest: x.new_empty(x.shape))


def load() -> bool:
    """Builds (once) and loads the kernels; True when they can be called. ValueError for an LLMINFER_ISA this CPU
    cannot run (before anything is built)."""
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
            lines = str(error).strip().splitlines()
            _state["error"] = f"{type(error).__name__}: {lines[-1] if lines else ''}"
            print(f"llminfer: the native CPU decode kernels did not build ({_state['error']}); torch's kernels run "
                  "instead. A C++ compiler (g++ or clang) and ninja build them.", file=sys.stderr)
            return False
        decode = [choice.level_bits(level) for _, level in choice.decode]
        missing = int(torch.ops.llminfer.set_cpu_features(choice.bits, decode))
        if missing:                            # the flags said yes, the CPU itself says no
            raise RuntimeError(f"the CPU lacks instruction sets (bits {missing}) that its flags list for "
                               f"{choice.level}; set {ISA_ENV} to a lower level")
        _state["isa"] = choice
        _state["loaded"] = True
        return True


def loaded() -> bool:
    """Whether the kernels are loaded already (a dict read: cheap enough for every forward)."""
    return _state["loaded"]


available = load                               # whether the kernels are built and loaded (building them if need be)


def why_unavailable() -> str | None:
    """None when the kernels load; otherwise the reason (no compiler, turned off, ...)."""
    return None if load() else _state["error"]


def _require() -> None:
    if not (_state["loaded"] or load()):
        raise RuntimeError(f"the native CPU kernels are unavailable ({_state['error']}); install a C++ compiler "
                           "(g++ or clang), or use torch's kernels")


def isa() -> str:
    """Returns the level of KERNEL_LEVELS whose loops run here ('unavailable' without the kernels). Appendix A1."""
    return _state["isa"].level if load() else "unavailable"


def isa_features() -> tuple[str, ...]:
    """Returns the instruction sets the kernels run here, lowest first (empty for the portable loops). Appendix A1."""
    return _state["isa"].features if load() else ()


# A prefill (more than MAX_TOKENS rows) runs by the blocked kernel wherever the vector loops run (every class's record
# shows it faster than torch's matmul for every format); the portable loops keep torch's (dequantized) matmul.
PREFILL_PATHS = ("blocked", "torch")
PREFILL_ENV = "LLMINFER_PREFILL"           # 'blocked' or 'torch' forces the path (for comparisons)
_prefill: dict = {"forced": None}


def prefill_path(weight_dtype: torch.dtype = torch.float32, rows: int = 128) -> str:
    """Returns 'blocked' or 'torch', the path a prefill takes here (the same for every dtype and row count);
    LLMINFER_PREFILL or `force_prefill` overrides it. Appendix A1."""
    forced = _prefill["forced"] or os.environ.get(PREFILL_ENV) or None
    if forced is not None and forced not in PREFILL_PATHS:
        raise ValueError(f"{PREFILL_ENV}={forced!r} must be one of {PREFILL_PATHS}, or unset for the blocked kernel")
    if not ((_state["loaded"] or load()) and isa() != "portable"):
        return "torch"
    return forced or "blocked"


@contextmanager
def force_prefill(path: str | None):
    """Context manager: every prefill inside takes `path` ('blocked', 'torch' or None: the default). Appendix A1."""
    if path is not None and path not in PREFILL_PATHS:
        raise ValueError(f"path={path!r} must be one of {PREFILL_PATHS} or None")
    before, _prefill["forced"] = _prefill["forced"], path
    try:
        yield
    finally:
        _prefill["forced"] = before


def blocked_prefill(weight_dtype: torch.dtype | None = None, rows: int = 128) -> bool:
    """Whether a prefill's products run the blocked kernel rather than torch's matmul (`prefill_path`)."""
    return prefill_path(torch.float32 if weight_dtype is None else weight_dtype, rows) == "blocked"


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
         offset: torch.Tensor | None = None, group: int | None = None, activations: str = "float") -> torch.Tensor:
    """x (tokens, K) times the weight's transpose, by the kernel for the weight's dtype. Chapter 08.

    float32 and bfloat16 weights (N, K); int8 codes (N, K) with `scale` (N,) or (N, K/group); int4 in tiles of 8 rows
    (`tile_int4`) with scale and offset, w = q·scale + offset. activations="int8" (int4 only, W4A8) rounds x to int8
    per block of 32 inputs and multiplies in integers: faster, and it changes the numbers."""
    _require()
    if activations not in ("float", "int8"):
        raise ValueError(f"activations={activations!r} must be 'float' or 'int8'")
    if weight.dtype == torch.uint8 and weight.dim() != 3:
        raise ValueError(f"int4 weights are read in tiles of 8 rows, got nibbles of shape {tuple(weight.shape)}; "
                         "pass tile_int4(nibbles, scale, offset)")
    if activations == "int8" and weight.dtype != torch.uint8:
        raise ValueError(f"activations='int8' is for int4 weights (uint8 tiles), got {weight.dtype}")
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.int8, torch.uint8):
        raise ValueError(f"no native kernel for {weight.dtype} weights; float32, bfloat16, int8 and int4 (uint8 "
                         "tiles) have one")
    parts = [t for t in (weight, scale, offset) if t is not None]
    return torch.ops.llminfer.gemv(x, parts, group or 0, activations == "int8")


def tile_int4(nibbles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row-major int4 (nibbles (N, K/2), the even input in the low nibble; scale and offset (N, G)) in tiles of 8
    rows, the layout the kernels read: codes (N'/8, K/8, 32), where tile t, chunk c holds rows 8t..8t+7's 4 bytes for
    inputs 8c..8c+7 side by side, and scale, offset (N'/8, G, 8) in their own dtype (float32, or float16 as GGUF's
    Q4_0 and Q4_1 keep theirs). N is padded with zero rows to N', a multiple of 8 (their outputs are 0). Chapter 08."""
    n, half = nibbles.shape
    if half % 4:
        raise ValueError(f"tiles of 8 rows need K a multiple of 8, got a ({n} x {half * 2}) weight")
    pad = -n % 8
    if pad:
        nibbles, scale, offset = (torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (nibbles, scale, offset))
    tiles = (n + pad) // 8
    codes = nibbles.reshape(tiles, 8, half // 4, 4).permute(0, 2, 1, 3).reshape(tiles, half // 4, 32)
    terms = [t.reshape(tiles, 8, t.shape[1]).transpose(1, 2) for t in (scale, offset)]
    return codes.contiguous(), terms[0].contiguous(), terms[1].contiguous()


def untile_int4(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `tile_int4`: row-major nibbles (N', K/2), scale and offset (N', G). Chapter 08."""
    tiles, chunks, _ = codes.shape
    nibbles = codes.reshape(tiles, chunks, 8, 4).permute(0, 2, 1, 3).reshape(tiles * 8, chunks * 4)
    rows = [t.transpose(1, 2).reshape(tiles * 8, t.shape[1]) for t in (scale, offset)]
    return nibbles.contiguous(), rows[0].contiguous(), rows[1].contiguous()


def stream_read(data: torch.Tensor, width: int = 0) -> int:
    """Reads every byte of a contiguous CPU tensor once, on every thread, with loads of `width` bytes (64, 32, 8; 0:
    the widest in use); returns a checksum. The benchmark's bandwidth probes. Chapter 08."""
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
    """Attention of several sequences' new tokens, q (1, H, N, D), over K/V in a block pool (num_blocks, block_size,
    H_kv, D): token t sees positions 0..positions[t] of sequence token_seq[t] through its row of block_tables.
    Chapters 06 and 08."""
    _require()
    return torch.ops.llminfer.paged_attention(q, k_pool, v_pool, block_tables, token_seq, positions,
                                              q.shape[-1] ** -0.5 if scale is None else scale)


def attention_backend(q, k, v, causal: bool = True, mask: torch.Tensor | None = None, scale: float | None = None):
    """The 'native' attention backend: decode_attention for a few queries on a CPU, SDPA otherwise."""
    if (q.device.type == "cpu" and q.dim() == 4 and q.shape[-2] <= MAX_TOKENS and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.float32, torch.bfloat16) and (mask is not None or causal)
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and (_state["loaded"] or load())):       # (a dict read, not the lock, inside a compiled step)
        return decode_attention(q, k, v, mask, scale)
    return fast_attention(q, k, v, causal=causal, scale=scale, mask=mask)


# importing the backend registers its decode attention as the attention backend "native"
register_backend("native", attention_backend)
