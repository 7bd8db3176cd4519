"""Where tensors live and how much room is left there: the one home for device facts. Chapter 00.

    resolve_device(device)              None -> CUDA when present, else the CPU; a clear error otherwise
    synchronize(device)                 wait for queued work (a no-op on the CPU)
    dtype_bytes(dtype)                  bytes of one element
    free_memory_bytes(device)           what can still be allocated there
    check_fits(nbytes, device, what)    the one memory guard: MemoryError before anything is allocated
    huge_page_empty(shape, dtype)       CPU memory on 2 MiB pages (what decode's weights and bandwidth probe use)
    on_huge_pages(tensor)               whether a tensor lies in such memory
"""
from __future__ import annotations

import mmap
import weakref

import torch

__all__ = ["as_device", "resolve_device", "synchronize", "dtype_bytes", "free_memory_bytes", "check_fits",
           "huge_page_empty", "on_huge_pages", "UNKNOWN_FREE_BYTES"]

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


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether tensor lies in a block that `huge_page_empty` made (`llminfer.fast.use_huge_pages` too). Chapter 08."""
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _ARENAS
