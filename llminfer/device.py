"""Where tensors live and how much room is left there: the one home for device facts. Chapter 00.

    resolve_device(device)              None -> CUDA when present, else the CPU; a clear error otherwise
    synchronize(device)                 wait for queued work (a no-op on the CPU)
    dtype_bytes(dtype)                  bytes of one element
    free_memory_bytes(device)           what can still be allocated there
    check_fits(nbytes, device, what)    the one memory guard: MemoryError before anything is allocated
    huge_page_empty(shape, dtype)       CPU memory on 2 MiB pages (what decode's weights and bandwidth probe use)
    huge_page_copy(tensor)              a copy of a CPU tensor on such pages, or the tensor itself where none
    on_huge_pages(tensor)               whether a tensor lies in such memory
    cpu_capabilities()                  the CPU's name, flags, ISA level and core counts (read once)
    parse_cpuinfo(text)                 the same from the text of a /proc/cpuinfo
    last_level_cache_bytes()            the largest-level cache's size (what a streaming probe must outgrow)
"""
from __future__ import annotations

import functools
import mmap
import os
import platform
import re
import weakref
from dataclasses import dataclass

import torch

__all__ = ["as_device", "resolve_device", "synchronize", "dtype_bytes", "free_memory_bytes", "check_fits",
           "huge_page_empty", "on_huge_pages", "UNKNOWN_FREE_BYTES", "CpuCapabilities", "ISA_LEVELS",
           "parse_cpuinfo", "cpu_capabilities", "cpu_slug"]

UNKNOWN_FREE_BYTES = 1 << 62   # what free_memory_bytes returns when it cannot tell: never refuse on a guess


def as_device(device) -> torch.device:
    """Returns device as a torch.device (accepts strings)."""
    return device if isinstance(device, torch.device) else torch.device(device)


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """None picks CUDA when present, else the CPU; asking for CUDA without it is a clear error. Chapter 00."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{device!r} is not a device torch knows ({exc}); use 'cpu' or 'cuda'") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA is not available on this machine (torch.cuda.is_available() is False); "
                               "pass device='cpu' (or device=None to pick automatically)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise RuntimeError(f"cuda:{device.index} does not exist: this machine has "
                               f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def synchronize(device) -> None:
    """Waits until every kernel queued on device has finished (a no-op on CPU). Chapter 04."""
    device = as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def dtype_bytes(dtype: torch.dtype) -> int:
    """Returns the bytes of one element of dtype."""
    return torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device) -> int:
    """Returns the memory that can still be allocated on device (MemAvailable on CPU)."""
    device = as_device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "meta":
        return UNKNOWN_FREE_BYTES
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return UNKNOWN_FREE_BYTES


def check_fits(nbytes: int, device, what: str, fraction: float = 0.8, fix: str = "choose a smaller size") -> None:
    """Raises MemoryError, before allocating, if nbytes is more than `fraction` of the free memory on device."""
    free = free_memory_bytes(device)
    if nbytes > fraction * free:
        raise MemoryError(
            f"{what} needs {nbytes / 2**30:.2f} GiB but only {free / 2**30:.2f} GiB is free on "
            f"{as_device(device)} (limit {fraction:.0%} of free); {fix}")


_HUGE_PAGE = 2 << 20
_ARENAS: set[int] = set()               # where the blocks made by huge_page_empty start


def _huge_page_arena(nbytes: int) -> torch.Tensor | None:
    """`nbytes` of fresh memory as a uint8 tensor starting on a 2 MiB boundary, with the kernel asked to back it
    by transparent huge pages (madvise); None where the platform has no such request."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not hasattr(mmap.mmap, "madvise") or nbytes <= 0:
        return None
    size = nbytes + _HUGE_PAGE              # room to start on a boundary; untouched pages cost no memory
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(advice)
    except OSError:                         # a kernel without transparent huge pages
        area.close()
        return None
    memory = torch.frombuffer(area, dtype=torch.uint8)        # the tensor keeps the mapping alive
    _ARENAS.add(memory.data_ptr())
    weakref.finalize(area, _ARENAS.discard, memory.data_ptr())  # forgotten once the last tensor in it is freed
    start = (-memory.data_ptr()) % _HUGE_PAGE
    return memory[start:start + nbytes]


def huge_page_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """An uninitialised CPU tensor on fresh memory backed by 2 MiB transparent huge pages, or None where the
    platform has no such request (not Linux, or transparent huge pages off). `llminfer.fast.use_huge_pages`
    moves a model's weights into such memory; the decode benchmark's read probe reads from it. Chapter 08."""
    numel = 1
    for size in shape:
        numel *= int(size)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    memory = _huge_page_arena(nbytes)
    return None if memory is None else memory.view(dtype).view(tuple(shape))


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor on 2 MiB pages (`huge_page_empty`), or the tensor itself where the platform gives
    none: weights for a probe placed as the fast path keeps its own. Chapter 08."""
    out = huge_page_empty(tuple(tensor.shape), tensor.dtype)
    return tensor if out is None else out.copy_(tensor)


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether tensor lies in a block that `huge_page_empty` made (`llminfer.fast.use_huge_pages` too). Chapter 08."""
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _ARENAS


# The CPU's vector instruction sets, lowest first, with the flags (as /proc/cpuinfo names them) each needs.
# A level needs its own flags and AVX2 + FMA: what the native kernels' vector loops use. Chapter 08.
ISA_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("portable", frozenset()),
    ("avx2", frozenset({"avx2", "fma"})),
    ("avx_vnni", frozenset({"avx2", "fma", "avx_vnni"})),                          # int8 dot products, VEX
    ("avx512", frozenset({"avx2", "fma", "avx512f"})),
    ("avx512_vnni", frozenset({"avx2", "fma", "avx512f", "avx512_vnni"})),         # int8 dot products
    ("avx512_bf16", frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})),         # bfloat16 dot products
    ("amx", frozenset({"avx2", "fma", "avx512f", "amx_tile", "amx_bf16"})),       # tile matrix units
)
# The flags a report names: what decides which kernel runs fastest here.
_REPORTED_PREFIXES = ("avx", "fma", "f16c", "amx")
# Cores by (vendor, family) and model ranges, for CPUs whose name does not say (a virtual machine's "AMD EPYC"
# is a Zen 3, a Zen 4 or a Zen 5). Parts sold under one name differ in width: a Zen 4 runs 512-bit operations
# in two halves, a Zen 5 (server) at full width. Intel family 6 model 85 is Skylake, Cascade or Cooper Lake by
# stepping: left unnamed. Chapter 08.
_MICROARCHITECTURES: tuple[tuple[str, int, tuple[range, ...], str], ...] = (
    ("AuthenticAMD", 23, (range(0x00, 0x30),), "zen"),
    ("AuthenticAMD", 23, (range(0x30, 0x100),), "zen2"),
    ("AuthenticAMD", 25, (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0)), "zen4"),
    ("AuthenticAMD", 25, (range(0x00, 0x100),), "zen3"),
    ("AuthenticAMD", 26, (range(0x00, 0x100),), "zen5"),
    ("GenuineIntel", 6, (range(106, 107), range(108, 109)), "icelake"),
    ("GenuineIntel", 6, (range(143, 144),), "sapphirerapids"),
    ("GenuineIntel", 6, (range(207, 208),), "emeraldrapids"),
    ("GenuineIntel", 6, (range(173, 175),), "graniterapids"),
)


@dataclass(frozen=True)
class CpuCapabilities:
    """The CPU's name, feature flags and core counts; `isa_level` names its vector class. Chapter 08."""

    model: str                   # e.g. "AMD EPYC 9R14 96-Core Processor"
    flags: frozenset[str]        # as /proc/cpuinfo lists them: "avx2", "avx512f", "avx512_bf16", "amx_tile", ...
    logical_cpus: int            # processors the OS lists (hyperthreads count)
    physical_cores: int          # distinct (socket, core) pairs; logical_cpus where the file does not say
    vendor: str = ""             # "AuthenticAMD", "GenuineIntel"; "" where the file does not say
    family: int | None = None    # "cpu family": 25 for a Zen 3 or Zen 4, 26 for a Zen 5, 6 for Intel's
    model_number: int | None = None   # "model": with the family, which core it is

    @property
    def microarchitecture(self) -> str | None:
        """Returns the core's name ('zen4', 'zen5', 'sapphirerapids', ...) from the vendor, family and model,
        or None for one the table above does not know."""
        for vendor, family, models, name in _MICROARCHITECTURES:
            if (self.vendor, self.family) == (vendor, family) and any(self.model_number in r for r in models):
                return name
        return None

    @property
    def isa_level(self) -> str:
        """Returns the highest of ISA_LEVELS whose flags this CPU has ('portable' without AVX2 and FMA)."""
        return [name for name, needed in ISA_LEVELS if needed <= self.flags][-1]

    @property
    def bfloat16_in_hardware(self) -> bool:
        """Whether the CPU multiplies bfloat16 itself (AVX512-BF16 or AMX), which torch's bfloat16 matmul uses."""
        return not self.flags.isdisjoint({"avx512_bf16", "amx_bf16"})

    def vector_flags(self) -> list[str]:
        """Returns the sorted flags a report names: AVX*, FMA, F16C and AMX."""
        return sorted(f for f in self.flags if f.startswith(_REPORTED_PREFIXES))

    def as_dict(self) -> dict:
        """Returns the JSON a report stores: model, ISA level, core counts and the vector flags."""
        return {"model": self.model, "microarchitecture": self.microarchitecture, "family": self.family,
                "model_number": self.model_number, "isa_level": self.isa_level, "logical_cpus": self.logical_cpus,
                "physical_cores": self.physical_cores, "vector_flags": self.vector_flags()}


def parse_cpuinfo(text: str, fallback_model: str = "unknown", fallback_cpus: int = 1) -> CpuCapabilities:
    """Returns the CpuCapabilities that the text of a Linux /proc/cpuinfo describes; a file without x86 fields
    (an ARM's, or none) gives fallback_model, no flags and fallback_cpus. Chapter 08."""
    model, flags, processors, cores = "", None, 0, set()
    physical_id = vendor = family = number = None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key == "processor":
            processors += 1
        elif key == "model name" and not model:
            model = value
        elif key == "vendor_id" and vendor is None:
            vendor = value
        elif key == "cpu family" and family is None and value.isdigit():
            family = int(value)
        elif key == "model" and number is None and value.isdigit():
            number = int(value)
        elif key == "flags" and flags is None:
            flags = frozenset(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    logical = processors or fallback_cpus
    return CpuCapabilities(model=model or fallback_model, flags=flags or frozenset(), logical_cpus=logical,
                           physical_cores=len(cores) or logical, vendor=vendor or "", family=family,
                           model_number=number)


@functools.lru_cache(maxsize=1)
def cpu_capabilities() -> CpuCapabilities:
    """Returns this machine's CpuCapabilities, read once from /proc/cpuinfo (the platform's names elsewhere). The
    one CPU-capabilities reader: kernels, benchmarks and chapters ask it. Chapter 08."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            text = cpuinfo.read()
    except OSError:
        text = ""
    return parse_cpuinfo(text, fallback_model=platform.processor() or platform.machine() or "unknown",
                         fallback_cpus=os.cpu_count() or 1)


_CACHE_SIZE = re.compile(r"(\d+)\s*([KMG]?)", re.IGNORECASE)


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Returns the size in bytes of the largest-level cache of CPU 0 as Linux lists it (`root`/index*/level and
    size, such as "32768K"), 0 where the files are missing or unreadable. Probes that must stream from memory size
    their working set from it (the decode benchmark's native read, appendix A1's streamed products). Chapter 08."""
    best_level, best_size = 0, 0
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return 0
    for entry in entries:
        if not entry.startswith("index"):
            continue
        try:
            with open(os.path.join(root, entry, "level")) as f:
                level = int(f.read().strip())
            with open(os.path.join(root, entry, "size")) as f:
                match = _CACHE_SIZE.fullmatch(f.read().strip())
        except (OSError, ValueError):
            continue
        if match is None:
            continue
        size = int(match.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[match.group(2).upper()]
        if (level, size) > (best_level, best_size):
            best_level, best_size = level, size
    return best_size


@functools.lru_cache(maxsize=None)
def cpu_slug(capabilities: CpuCapabilities | None = None) -> str:
    """Returns a CPU's class as a file name part, for its reports in data/benchmarks/ (default this CPU): its
    name, its core where the table knows it, '-avx512' where it has AVX-512 and '-amx' where it has AMX tiles, e.g.
    'cpu-amd-epyc-zen5-avx512' or 'cpu-intel-xeon-platinum-8488c-sapphirerapids-avx512-amx'. Parts sold under one
    name ('AMD EPYC', 'Intel Xeon') differ in core and in width, and llama.cpp and oneDNN, built or dispatched for
    the machine they run on, use what they find (oneDNN's bfloat16 matmul runs on AMX tiles), so their runs are
    kept apart; under a hypervisor the model number may name no core, and the flags still part them. The one namer: every benchmark asks it. Chapter 08."""
    capabilities = capabilities or cpu_capabilities()
    name = re.sub(r"\(r\)|\(tm\)|processor|\d+-core|cpu @.*", "", "cpu " + capabilities.model.lower())
    parts = [re.sub(r"[^a-z0-9]+", "-", name).strip("-").replace("cpu-cpu", "cpu")]
    core = capabilities.microarchitecture
    if core and core not in parts[0]:
        parts.append(core)
    if "avx512f" in capabilities.flags:
        parts.append("avx512")
    if "amx_tile" in capabilities.flags:
        parts.append("amx")
    return "-".join(parts)
