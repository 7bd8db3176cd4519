"""Where tensors live and how much room is left there: the one home for device facts. Chapter 00.

    resolve_device(device)              None -> CUDA when present, else the CPU; a clear error otherwise
    synchronize(device)                 wait for queued work (a no-op on the CPU)
    dtype_bytes(dtype)                  bytes of one element
    free_memory_bytes(device)           what can still be allocated there
    check_fits(nbytes, device, what)    the one memory guard: MemoryError before anything is allocated
"""
from __future__ import annotations

import torch

__all__ = ["as_device", "resolve_device", "synchronize", "dtype_bytes", "free_memory_bytes", "check_fits",
           "UNKNOWN_FREE_BYTES"]

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
