"""Device-aware timing and the machine's measured ceilings. Chapter 04.

    synchronize(device)                          wait for queued work on device
    time_fn(fn, device, warmup=2, repeats=10)    -> TimingResult(median_s, iqr_s, times_s)
    with stopwatch(device) as watch: ...         one timed block, synchronised: watch.seconds
    probe_bytes(device, cpu_bytes)               a bandwidth probe's size: cpu_bytes, at least 1 GiB on a GPU
    measure_copy_bandwidth(device, dtype)        -> Ceiling (bytes read + written per second)
    measure_matvec_bandwidth(device, dtype)      -> Ceiling (matrix bytes per second of a matvec)
    measure_matmul_flops(device, dtype)          -> Ceiling (FLOP/s of a square matmul)
    measure_ceilings(device, dtype)              -> dict of the three
    ceiling_probes(device, dtype)                -> dict of CeilingProbe: .sample() between other
                                                    measurements, .ceiling() at the end
    interleave(contenders, rounds, warmup=1)     contenders take turns, one call each per round, after
                                                    untimed warm-up calls: label -> the rounds' results
    round_order(names, rounds, alternate=True)   the order of each round (reversed in odd rounds)
    medians(results, value)                      label -> the median of value(result) over its rounds

Each call of `fn` is timed on its own after `warmup` untimed calls: on CUDA
between two CUDA events recorded on the current stream, elsewhere with
`torch.utils.benchmark.utils.timer.timer`, the clock `torch.utils.benchmark`
uses (it synchronises any accelerator before reading the time). Report the
median; the interquartile range says how noisy the machine was.

The ceilings are the rates this machine reaches on the simplest kernels that
stress one resource, in the dtype of the run, so that a model's speed can be
quoted as a fraction of them (MBU for decode, MFU for prefill) rather than of
a datasheet figure. Sizes are chosen far larger than the CPU caches and then
checked against free memory: `MemoryError` says so before anything is allocated.
"""
from __future__ import annotations

import os
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.utils.benchmark.utils.timer import timer as _benchmark_clock

from .device import (as_device, check_fits, cpu_capabilities, dtype_bytes, free_memory_bytes, huge_page_empty,
                     synchronize)

__all__ = ["TimingResult", "Ceiling", "synchronize", "time_fn", "free_memory_bytes",
           "check_fits", "measure_copy_bandwidth", "measure_matvec_bandwidth",
           "measure_matmul_flops", "measure_ceilings", "measure_bandwidth", "dtype_bytes",
           "CeilingProbe", "ceiling_probes", "copy_probe", "matvec_probe", "matmul_probe", "load_per_core",
           "machine_summary", "stopwatch", "Stopwatch", "probe_bytes", "interleave", "round_order", "medians"]


def load_per_core() -> float:
    """Return the one-minute load average over the number of CPUs (nan where the OS does not say). Chapter 01."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return float("nan")


def machine_summary(device=None) -> str:
    """Return the line a timing cell prints first: the processor, its vector class, threads and load. Chapter 01.

    Timings differ between machines by more than any effect a chapter measures, so every chapter that times
    something says where it ran, and how busy the machine was while it did.
    """
    device = as_device(device or "cpu")
    cpu = cpu_capabilities()
    line = (f"{cpu.model} ({cpu.isa_level} class, {cpu.logical_cpus} CPUs) · torch threads {torch.get_num_threads()}"
            f" · load {load_per_core():.2f} per core")
    if device.type == "cuda":
        line = f"{torch.cuda.get_device_name(device)} · host: {line}"
    return line


@dataclass
class TimingResult:
    """Median, interquartile range and every sample of a timed call, in seconds. Chapter 04."""
    median_s: float
    iqr_s: float
    times_s: list[float] = field(default_factory=list)

    @classmethod
    def from_times(cls, times_s: list[float]) -> "TimingResult":
        """Returns the summary of a list of per-call times."""
        if not times_s:
            raise ValueError("no times to summarise; pass repeats >= 1")
        ordered = sorted(times_s)
        if len(ordered) >= 2:
            q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
        else:
            q1 = q3 = ordered[0]
        return cls(statistics.median(ordered), q3 - q1, list(times_s))


@dataclass
class Ceiling:
    """A measured hardware rate (bytes/s or FLOP/s) and how it was measured. Chapter 04."""
    rate: float              # bytes/s for bandwidths, FLOP/s for matmul
    timing: TimingResult
    work: float              # bytes moved or FLOPs done by one call
    what: str                # e.g. "copy of 512 MiB float32"

    def as_dict(self) -> dict:
        """Returns a JSON-ready description."""
        return {"rate": self.rate, "median_s": self.timing.median_s, "iqr_s": self.timing.iqr_s,
                "work": self.work, "what": self.what}


_device = as_device


def time_fn(fn: Callable[[], object], device, warmup: int = 2, repeats: int = 10) -> TimingResult:
    """Returns the median and IQR of `repeats` timed calls of fn() after `warmup` untimed ones. Chapter 04."""
    if warmup < 0 or repeats < 1:
        raise ValueError(f"warmup={warmup}, repeats={repeats}: need warmup >= 0 and repeats >= 1")
    device = _device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)   # elapsed_time is in milliseconds
    else:
        for _ in range(repeats):
            start = _benchmark_clock()
            fn()
            synchronize(device)
            times.append(_benchmark_clock() - start)
    return TimingResult.from_times(times)


class Stopwatch:
    """What `stopwatch` measured: seconds (set when its block ends). Chapter 04."""
    seconds: float = float("nan")


@contextmanager
def stopwatch(device):
    """Times the block once, by the host clock, waiting for device's queued work before and after: a CUDA
    call returns when its kernels are queued, not when they are done. Yields a Stopwatch. Chapter 04.

        with stopwatch(device) as watch:
            decoder.warmup()
        print(watch.seconds)
    """
    device = as_device(device)
    watch = Stopwatch()
    synchronize(device)
    start = _benchmark_clock()
    yield watch
    synchronize(device)
    watch.seconds = _benchmark_clock() - start


# A bandwidth probe must stream far more than the caches hold and run long enough that launching the kernel is
# noise. On a CPU 128-256 MiB does both; HBM streams 128 MiB in about 40 µs, close to a launch's own cost, so a
# probe that small reads low and a decode then seems to beat its ceiling (MBU above 1). 1 GiB at the least there.
MIN_GPU_PROBE_BYTES = 1 << 30


def probe_bytes(device, cpu_bytes: int = 256 << 20) -> int:
    """The working set of a bandwidth probe on device: cpu_bytes on a CPU, at least 1 GiB on a GPU. Chapter 04."""
    device = as_device(device)
    return cpu_bytes if device.type == "cpu" else max(cpu_bytes, MIN_GPU_PROBE_BYTES)


def _default_bytes(device: torch.device) -> int:
    return probe_bytes(device)


class CeilingProbe:
    """A kernel that stresses one resource, sampled again and again during a run. Chapter 04.

    On a shared machine the rate it reaches changes with the load; sampling the probe between the
    measurements it is compared with (`sample()`), and taking the median of all samples, sets speed
    and ceiling side by side under the same conditions.
    """

    def __init__(self, fn: Callable[[], object], work: float, what: str, device):
        self.fn, self.work, self.what, self.device = fn, work, what, _device(device)
        self.times_s: list[float] = []
        fn()                                              # first call: allocation, kernel selection

    def sample(self, repeats: int = 1) -> list[float]:
        """Times `repeats` more calls, keeps them and returns them."""
        times = time_fn(self.fn, self.device, warmup=0, repeats=repeats).times_s
        self.times_s += times
        return times

    def rate_of(self, times_s: list[float]) -> float:
        """Returns the rate at the median of some of the samples (e.g. those taken during one phase)."""
        return self.work / statistics.median(times_s)

    def peak_rate_of(self, times_s: list[float]) -> float:
        """Returns the rate of the fastest of some of the samples: the most the probe reached in that phase (a
        ceiling for work timed at other moments of a machine whose speed moves)."""
        return self.work / min(times_s)

    def ceiling(self) -> Ceiling:
        """Returns the rate at the median of every sample so far."""
        timing = TimingResult.from_times(self.times_s)
        return Ceiling(self.work / timing.median_s, timing, self.work, self.what)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def copy_probe(device, dtype=torch.float32, nbytes: int | None = None) -> CeilingProbe:
    """Returns a probe copying nbytes (default 512 MiB on CPU, 2 GiB on CUDA) device to device. Chapter 04."""
    device = _device(device)
    numel = max(1, (nbytes or 2 * _default_bytes(device)) // dtype_bytes(dtype))
    check_fits(2 * numel * dtype_bytes(dtype), device, "the copy-bandwidth test")
    source = torch.ones(numel, dtype=dtype, device=device)
    target = torch.empty_like(source)
    return CeilingProbe(lambda: target.copy_(source), 2 * numel * dtype_bytes(dtype),   # read + written
                        f"copy of {numel * dtype_bytes(dtype) / 2**20:.0f} MiB {_name(dtype)}", device)


def matvec_probe(device, dtype=torch.float32, nbytes: int | None = None) -> CeilingProbe:
    """Returns a probe multiplying a (rows x 4096) matrix of nbytes by a vector. Chapter 04."""
    device = _device(device)
    cols = 4096
    rows = max(1, (nbytes or 2 * _default_bytes(device)) // (cols * dtype_bytes(dtype)))
    check_fits(rows * cols * dtype_bytes(dtype), device, "the matvec-bandwidth test")
    matrix = torch.randn(rows, cols, device=device).to(dtype)
    vector = torch.randn(1, cols, device=device).to(dtype)
    return CeilingProbe(lambda: torch.nn.functional.linear(vector, matrix), rows * cols * dtype_bytes(dtype),
                        f"({rows} x {cols}) matrix times a vector, {_name(dtype)}", device)


def read_probe(device, dtype=torch.float32, nbytes: int | None = None, huge_pages: bool = False) -> CeilingProbe:
    """Returns a probe summing a tensor of nbytes: a pure streaming read, on every thread. Chapter 08.

    torch's matrix-vector product does not always use every thread for one vector (it did not on a 2-core
    CPU here), so as a bandwidth ceiling it can sit below what a decode kernel streams; a reduction does not.
    huge_pages=True puts the data on 2 MiB pages on a CPU, as `llminfer.fast.use_huge_pages` puts the weights
    of a decode step: memory read from 4 KiB pages streams a few percent slower, so a ceiling measured there
    sits below what such a step can reach."""
    device = _device(device)
    numel = max(1, (nbytes or 2 * _default_bytes(device)) // dtype_bytes(dtype))
    check_fits(numel * dtype_bytes(dtype), device, "the read-bandwidth test")
    data, pages = None, ""
    if huge_pages and device.type == "cpu":
        data = huge_page_empty((numel,), dtype)
        pages = ", on 2 MiB pages" if data is not None else ", on 4 KiB pages (no huge pages here)"
    data = torch.ones(numel, dtype=dtype, device=device) if data is None else data.fill_(1)
    return CeilingProbe(lambda: data.sum(), numel * dtype_bytes(dtype),
                        f"sum of {numel * dtype_bytes(dtype) / 2**20:.0f} MiB {_name(dtype)}{pages}", device)


def matmul_probe(device, dtype=torch.float32, n: int | None = None) -> CeilingProbe:
    """Returns a probe multiplying two n x n matrices (2 n^3 FLOPs). Chapter 04."""
    device = _device(device)
    n = n or (8192 if device.type == "cuda" else 1536)
    check_fits(3 * n * n * dtype_bytes(dtype), device, f"the {n} x {n} matmul test")
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return CeilingProbe(lambda: a @ b, 2 * n ** 3, f"({n} x {n}) @ ({n} x {n}) matmul, {_name(dtype)}", device)


def _measure(probe: CeilingProbe, repeats: int) -> Ceiling:
    probe.fn()                                            # second warm-up call
    probe.sample(repeats)
    return probe.ceiling()


def measure_copy_bandwidth(device, dtype=torch.float32, nbytes: int | None = None,
                           repeats: int = 7) -> Ceiling:
    """Returns the rate of a large device-to-device copy, counting bytes read plus written. Chapter 04."""
    return _measure(copy_probe(device, dtype, nbytes), repeats)


def measure_matvec_bandwidth(device, dtype=torch.float32, nbytes: int | None = None,
                             repeats: int = 7) -> Ceiling:
    """Returns the matrix bytes per second of a large matrix-vector product (decode's kernel). Chapter 04."""
    return _measure(matvec_probe(device, dtype, nbytes), repeats)


def measure_matmul_flops(device, dtype=torch.float32, n: int | None = None,
                         repeats: int = 5) -> Ceiling:
    """Returns the FLOP/s of an n x n by n x n matmul (2 n^3 FLOPs). Chapter 04."""
    return _measure(matmul_probe(device, dtype, n), repeats)


def ceiling_probes(device, dtype=torch.float32, quick: bool = False) -> dict[str, CeilingProbe]:
    """Returns the copy, matvec and matmul probes of device in dtype, smaller with quick. Chapter 04."""
    device = _device(device)
    base = _default_bytes(device) // (4 if quick else 1)
    return {"copy_bandwidth": copy_probe(device, dtype, 2 * base),
            "matvec_bandwidth": matvec_probe(device, dtype, 2 * base),
            "matmul_flops": matmul_probe(device, dtype, 1024 if quick and device.type == "cpu" else None)}


def measure_ceilings(device, dtype=torch.float32, quick: bool = False) -> dict[str, Ceiling]:
    """Returns the copy bandwidth, matvec bandwidth and matmul rate of device in dtype. Chapter 04."""
    probes = ceiling_probes(device, dtype, quick)
    return {name: _measure(probe, 3 if quick else 7) for name, probe in probes.items()}


measure_bandwidth = measure_copy_bandwidth   # the short name: the copy is the usual bandwidth figure


# --- contenders taking turns ----------------------------------------------------------------------------------------

def round_order(names: Iterable[str], rounds: int, alternate: bool = False) -> list[list[str]]:
    """Returns the order of each round: the names as given, or with alternate=True reversed in odd rounds, so that
    a drift in the machine's speed falls on every contender alike. Chapter 04."""
    names = list(names)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    if not names:
        raise ValueError("no contenders to order; pass at least one name")
    return [list(reversed(names)) if alternate and r % 2 else list(names) for r in range(rounds)]


def interleave(contenders: dict[str, Callable[[], object]], rounds: int, warmup: int = 1, alternate: bool = False,
               between: Callable[[], object] | None = None,
               log: Callable[[str], object] | None = None) -> dict[str, list]:
    """Returns label -> the results of `rounds` calls of each contender. The contenders take turns, one call each
    per round (`round_order`), after `warmup` untimed calls each whose results are discarded; between() runs after
    every call (a ceiling probe sampled alongside what it bounds). On a shared machine each round compares calls
    made at the same moment, so ratios of the rounds' medians hold up where one contender's run after another's
    would not. Chapter 04."""
    if not contenders:
        raise ValueError("no contenders to interleave; pass at least one")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    order = round_order(contenders, rounds, alternate)
    for _ in range(warmup):
        for runner in contenders.values():
            runner()
    results: dict[str, list] = {label: [] for label in contenders}
    for index, labels in enumerate(order):
        if log is not None:
            log(f"round {index + 1}/{rounds}")
        for label in labels:
            results[label].append(contenders[label]())
            if between is not None:
                between()
    return results


def medians(results: dict[str, list], value: Callable[[object], float] = float) -> dict[str, float]:
    """Returns label -> the median of value(result) over that contender's results (from `interleave`). Chapter 04."""
    empty = [label for label, found in results.items() if not found]
    if empty:
        raise ValueError(f"no results for {empty}; run at least one round")
    return {label: statistics.median(value(r) for r in found) for label, found in results.items()}
