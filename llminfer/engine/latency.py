"""Latency statistics and service-level objectives, one definition for the engine, the server and the chapters.

    percentile(values, q)                 -> the q-th percentile, or nan where the sample is too small for it
    percentiles(values, qs)               -> {'mean', 'p50', 'p90', 'p99'}
    SLO(ttft_s=, tpot_s=, e2e_s=)         -> targets; .met(ttft_s, tpot_s, e2e_s, output_tokens)
    request_goodput(requests, duration_s, slo)   -> (good requests, good requests per second): vLLM's goodput
    max_rate_meeting(rates, attainment, target)  -> the highest rate whose SLO attainment meets target: DistServe's

A tail percentile needs samples beyond it: chapter 01's rule is that 20 values give a fair p90 (two above it) and
no p99 (a fifth of a value above it). So percentile q is reported only from MIN_TAIL_SAMPLES / (1 - q/100)
values or more, and is nan below that, so that a p99 of 16 requests cannot be printed as if it meant something.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np

__all__ = ["MIN_TAIL_SAMPLES", "samples_needed", "percentile", "percentiles", "SLO", "request_goodput",
           "max_rate_meeting"]

MIN_TAIL_SAMPLES = 2          # values that must lie beyond a tail percentile for it to be quoted
PERCENTILES = (50, 90, 99)


def samples_needed(q: float) -> int:
    """Return how many values percentile q needs: 1 for the median and below, MIN_TAIL_SAMPLES/(1-q/100) above."""
    if not 0 <= q < 100:
        raise ValueError(f"percentile q must be in [0, 100), got {q!r}; use max() for the largest value")
    if q <= 50:
        return 1
    return math.ceil(MIN_TAIL_SAMPLES / (1 - q / 100) - 1e-9)


def _finite(values) -> np.ndarray:
    return np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)


def percentile(values, q: float) -> float:
    """Return the q-th percentile (0-100, linear interpolation) of the finite values; nan if too few for it."""
    values = _finite(values)
    if values.size < samples_needed(q):
        return float("nan")
    return float(np.percentile(values, q))


def percentiles(values, qs=PERCENTILES) -> dict:
    """Return {'mean', 'p50', 'p90', 'p99'} of the finite values; a percentile without enough values is nan."""
    finite = _finite(values)
    mean = float(finite.mean()) if finite.size else float("nan")
    return {"mean": mean, **{f"p{q}": percentile(finite, q) for q in qs}}


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; a target left at None is not judged. Chapter 05."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s", "e2e_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)):
                raise ValueError(f"SLO {name} must be a number of seconds >= 0 or None, got {value!r}")

    @property
    def targets(self) -> dict:
        """Return the stated targets by name ('ttft', 'tpot', 'e2e'), in seconds."""
        return {name: value for name, value in (("ttft", self.ttft_s), ("tpot", self.tpot_s), ("e2e", self.e2e_s))
                if value is not None}

    def met(self, ttft_s: float, tpot_s: float, e2e_s: float, output_tokens: int) -> bool:
        """Return whether one request met every stated target (a one-token request has no TPOT to judge)."""
        measured = {"ttft": ttft_s, "tpot": tpot_s, "e2e": e2e_s}
        for name, target in self.targets.items():
            if name == "tpot" and output_tokens < 2:
                continue
            if not measured[name] <= target:              # nan fails too
                return False
        return True


def request_goodput(requests: Iterable[tuple[float, float, float, int]], duration_s: float,
                    slo: SLO) -> tuple[int, float]:
    """Return (requests that met slo, those per second of duration_s): vLLM's goodput. Chapter 05.

    requests holds (ttft_s, tpot_s, e2e_s, output_tokens) of each request that finished. DistServe's goodput
    is a different number, a rate: see max_rate_meeting.
    """
    good = sum(1 for ttft, tpot, e2e, tokens in requests if slo.met(ttft, tpot, e2e, tokens))
    return good, (good / duration_s if duration_s > 0 else float("nan"))


def max_rate_meeting(rates, attainment, target: float = 0.9) -> float:
    """Return the highest offered rate whose SLO attainment is at least target (DistServe's goodput). Chapter 11.

    rates and attainment are paired measurements (requests/s offered, share of requests that met the SLO);
    nan when no measured rate meets the target.
    """
    rates, attainment = list(rates), list(attainment)
    if len(rates) != len(attainment):
        raise ValueError(f"rates and attainment must pair up, got {len(rates)} rates and {len(attainment)} shares")
    if not 0 < target <= 1:
        raise ValueError(f"target is a share of requests in (0, 1], got {target!r}")
    meeting = [rate for rate, share in zip(rates, attainment) if share >= target]
    return max(meeting) if meeting else float("nan")
