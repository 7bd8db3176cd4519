"""The measurement layer every `python -m llminfer.bench` subcommand uses: turns, threads, shapes, ceilings. Chapter 04.

    interleave(contenders, rounds, ...)   contenders take turns, warm-up discarded (`llminfer.timing.interleave`)
    threads(n)                            torch's CPU thread count for a block, restored after it (on error too)
    shape_config(name)                    a published shape's or a bundled model's config, by name
    BandwidthCeiling(nbytes, footprints)  the bandwidth probes sampled alongside decode runs (chapter 08)
    matmul_probes(dtype, rows)            the matmul probes that bound a prefill's rate (chapter 08)
    native_read_probes(nbytes)            the native kernels' streaming reads, one per load width

The machine's description, the load and the report writer are in `report`; the figures (MBU, MFU, ratios) are
pure functions in `figures`.
"""
from __future__ import annotations

import json
from contextlib import contextmanager

import torch

from .. import cpu as native_cpu
from .. import timing
from ..checkpoint import bundled_models, model_folder
from ..config import ModelConfig, get_preset
from ..device import huge_page_empty, last_level_cache_bytes
from ..timing import interleave, medians, round_order

__all__ = ["interleave", "medians", "round_order", "threads", "shape_config", "BandwidthCeiling", "matmul_probes",
           "layer_probe", "layer_products", "LAYER_SHAPES", "native_read_probes",
           "QUANT_WEIGHTS"]


@contextmanager
def threads(count: int | None):
    """Sets torch's CPU thread count to count for the block (None: leaves it as it is) and restores the count it
    found when the block ends, by an error too. Chapter 04."""
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ValueError(f"threads={count!r} must be a positive integer (or None for torch's current count)")
    saved = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def shape_config(shape: str) -> ModelConfig:
    """Returns the config of a published shape (PRESETS) or of a bundled model, by name. Chapter 04."""
    if shape in bundled_models():
        return ModelConfig.from_hf(json.loads((model_folder(shape) / "config.json").read_text()))
    return get_preset(shape)                                 # an unknown shape: ValueError naming the known ones


def matmul_probes(dtype: torch.dtype, rows: int) -> list[timing.CeilingProbe]:
    """Returns the matmul probes of dtype that bound a prefill's rate: torch's 1536 x 1536 square matmul and, with
    the native kernels, the blocked kernel on the same square and on a layer's products (SmolLM2-135M's shapes,
    `layer_products`) with `rows` rows. The best of them is the MFU's yardstick: on a CPU where the
    blocked kernel outruns torch's sgemm (a Zen 5), torch's rate alone is no ceiling. Chapter 08."""
    probes = [timing.matmul_probe("cpu", dtype)]
    if native_cpu.available():
        name, n = str(dtype).removeprefix("torch."), 1536
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        probes.append(timing.CeilingProbe(lambda: native_cpu.gemv(a, b), 2 * n ** 3,
                                          f"({n} x {n}) @ ({n} x {n}) by the native blocked kernel, {name}", "cpu"))
        probes.append(layer_probe(dtype, rows))
    return probes


# the weights of a quantized format's prefill probe: int8 codes, int4 nibbles
QUANT_WEIGHTS = {"int8": torch.int8, "int4": torch.uint8}


# A layer's products, (N, K) each: SmolLM2-135M's fused qkv, o, gate_up and down
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def layer_products(dtype: torch.dtype, rows: int) -> tuple[list, int]:
    """Returns ([(x, gemv's weight arguments)], FLOPs): `rows` rows of x and a random (N, K) weight of dtype (float32,
    bfloat16, int8 codes with a scale a row, or uint8: int4 tiles in groups of 32) for each of LAYER_SHAPES; x
    bfloat16 for bfloat16 weights."""
    if dtype not in (torch.float32, torch.bfloat16, torch.int8, torch.uint8):
        raise ValueError(f"no native product for {dtype} weights; float32, bfloat16, int8 and uint8 (int4) have one")
    products = []
    for seed, (n, k) in enumerate(LAYER_SHAPES):
        g = torch.Generator().manual_seed(seed)
        if dtype == torch.int8:
            parts = [torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g)]
        elif dtype == torch.uint8:
            nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
            parts = [*native_cpu.tile_int4(nibbles, torch.rand(n, k // 32, generator=g),
                                           torch.rand(n, k // 32, generator=g)), 32]
        else:
            parts = [torch.randn(n, k, generator=g).to(dtype)]
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + seed))
        products.append((x.bfloat16() if dtype == torch.bfloat16 else x, parts))
    return products, sum(2 * rows * n * k for n, k in LAYER_SHAPES)


def layer_probe(weight_dtype: torch.dtype, rows: int) -> timing.CeilingProbe:
    """Returns the probe of `rows` rows by a layer's products (SmolLM2-135M's shapes, `layer_products`)
    with weights of weight_dtype (torch.int8: int8 codes, torch.uint8: int4 nibbles) by the native blocked kernel.
    A quantized format's prefill multiplies in float32, its weights widened a block at a time: it reads fewer bytes
    than float32's, so its own products bound it too (on a Zen 5 an int8 prefill ran 305 GFLOP/s against 302 for
    float32's products). Chapter 08."""
    name = {dtype: fmt for fmt, dtype in QUANT_WEIGHTS.items()}.get(weight_dtype,
                                                                     str(weight_dtype).removeprefix("torch."))
    products, flops = layer_products(weight_dtype, rows)
    shapes = ", ".join(f"{k}x{n}" for n, k in LAYER_SHAPES)
    return timing.CeilingProbe(lambda: [native_cpu.gemv(x, *parts) for x, parts in products], flops,
                               f"{rows} rows by a layer's products ({shapes}) by the native blocked kernel, {name}",
                               "cpu")


def native_read_probes(nbytes: int) -> dict[str, timing.CeilingProbe]:
    """Returns probes streaming nbytes from 2 MiB pages through the native kernels' read loop (every thread;
    `cpu.stream_read`), one per load width the process runs (64 bytes with AVX-512, 32 with AVX2, else 8:
    the widest is not always the fastest), by label ("native read, 32-byte loads"), or none without the kernels.
    Chapter 08."""
    if not native_cpu.available():
        return {}
    data = huge_page_empty((nbytes,), torch.uint8)
    pages = "2 MiB pages"
    if data is None:
        data, pages = torch.empty(nbytes, dtype=torch.uint8), "4 KiB pages"
    data.fill_(1)
    features = native_cpu.isa_features()
    widths = [w for w, level in ((64, "avx512"), (32, "avx2")) if level in features] or [8]
    return {f"native read, {width}-byte loads":
            timing.CeilingProbe(lambda w=width: native_cpu.stream_read(data, w), nbytes,
                                f"native streaming read of {nbytes / 2**20:.0f} MiB on {pages}, {width}-byte loads, "
                                f"{torch.get_num_threads()} thread(s)", "cpu") for width in widths}


class BandwidthCeiling:
    """The probes whose fastest sample bounds a decode step's bytes per second, sampled alongside the runs they
    bound: torch's matrix-vector product and torch's streaming read (from 2 MiB pages, where the fast path keeps its
    weights) over nbytes, and the native streaming reads (`native_read_probes`) over at least four times the
    last-level cache. The native read matters: on a Zen 5 the fast path's fp32 decode streamed faster than both
    torch probes, so against them alone its MBU came out above 1. The fastest sample, not the median, because the
    bandwidth a shared machine gives moves within minutes (the same Zen 5 read 49.5 GB/s in one run and 78-84 a few
    minutes later): a contender timed in a fast minute outran the median of probes timed in slower ones. Each of
    `footprints` (bytes per token) smaller than that working set gets a streaming read of its own size, because
    a cache holds part of it: on an Intel Xeon with a 480 MiB last-level cache, 92 MiB streamed at 58 GB/s and
    1920 MiB at 31, so int4's decode outran the memory's ceiling without being wrong (`for_bytes`). Shared by
    both decode benchmarks and chapter 08. Chapter 08."""

    def __init__(self, nbytes: int, footprints=()):
        # (32 MiB where the OS does not give the last-level cache's size)
        self.uncached = 4 * (last_level_cache_bytes() or 32 << 20)
        self.native = native_read_probes(max(nbytes, self.uncached))
        self.probes = {"matvec": timing.matvec_probe("cpu", torch.float32, nbytes),
                       "read": timing.read_probe("cpu", torch.float32, nbytes, huge_pages=True), **self.native}
        # a working set smaller than that can be read partly from the cache: each footprint gets a streaming
        # read of its own size, the ceiling of a contender that reads that many bytes per token
        self.footprints = {size: self._footprint_probe(size)
                           for size in sorted({_mib(f) for f in footprints if f < self.uncached})}
        self.samples: dict[str, list[float]] = {label: [] for label in self.probes}
        self.samples.update({_footprint_label(size): [] for size in self.footprints})

    @staticmethod
    def _footprint_probe(size_mib: int) -> timing.CeilingProbe:
        """The streaming read of size_mib MiB: the native read with the widest loads, else torch's read."""
        probes = native_read_probes(size_mib << 20)
        if probes:
            return next(iter(probes.values()))
        return timing.read_probe("cpu", torch.float32, size_mib << 20, huge_pages=True)

    def _all(self) -> dict[str, timing.CeilingProbe]:
        return {**self.probes, **{_footprint_label(size): probe for size, probe in self.footprints.items()}}

    def warm(self, repeats: int = 2) -> None:
        """Times each probe without keeping the times (the first calls of a run are slow)."""
        for probe in self._all().values():
            probe.sample(repeats)

    def sample(self, repeats: int = 1) -> None:
        """Times each probe `repeats` times and keeps the times: call it after each run it bounds."""
        for label, probe in self._all().items():
            self.samples[label] += probe.sample(repeats)

    def rates(self) -> dict[str, float]:
        """Bytes per second of each probe, at the fastest of its kept samples, by label ("matvec", "read",
        "native read, 64-byte loads", ...)."""
        return {label: probe.peak_rate_of(self.samples[label]) for label, probe in self.probes.items()}

    def medians(self) -> dict[str, float]:
        """Bytes per second of each probe at the median of its kept samples, by label (how much the rate moved)."""
        return {label: probe.rate_of(self.samples[label]) for label, probe in self.probes.items()}

    def native_rates(self) -> dict[str, float]:
        """The native probes' rates, by description (empty without the native kernels)."""
        rates = self.rates()
        return {probe.what: rates[label] for label, probe in self.native.items()}

    def best(self) -> float:
        """The ceiling of the memory: the best rate of the probes over working sets too large for any cache."""
        return max(self.rates().values())

    def footprint_rates(self) -> dict[int, float]:
        """Bytes per second of each footprint's own streaming read, at its fastest sample, by size in MiB."""
        return {size: probe.peak_rate_of(self.samples[_footprint_label(size)])
                for size, probe in self.footprints.items()}

    def for_bytes(self, nbytes: float) -> float:
        """The ceiling of a contender that reads nbytes per token: the memory's (`best`), or, where a cache can
        hold part of nbytes, the faster of that and a streaming read of nbytes itself (a footprint given at
        construction; any other size below the cache's reach is refused, as it has no probe)."""
        if nbytes >= self.uncached:
            return self.best()
        size = _mib(nbytes)
        if size not in self.footprints:
            raise ValueError(f"no streaming read of {size} MiB was sampled (footprints: "
                             f"{sorted(self.footprints) or 'none'} MiB); pass the contender's bytes per token as a "
                             "footprint to BandwidthCeiling")
        return max(self.best(), self.footprint_rates()[size])

    def what(self) -> str:
        return "the best of: " + "; ".join(probe.what for probe in self.probes.values())

    def samples_per_probe(self) -> int:
        return len(self.samples["matvec"])


def _mib(nbytes: float) -> int:
    """nbytes rounded to whole MiB (at least 1): a footprint's key."""
    return max(1, round(nbytes / 2**20))


def _footprint_label(size_mib: int) -> str:
    return f"footprint read, {size_mib} MiB"
