"""The benchmark's figures, as pure functions of timings and counts: no tensor, no clock. Chapter 04.

    decode_figures(...)        tokens/s, bytes per token and MBU of a cached decode
    prefill_figures(...)       tokens/s, FLOP/s and MFU of a prefill
    utilisation(achieved, ceiling, what)   achieved / ceiling (above 1: the path beats the probe, reported so)
    above_probe(values)        the names of the utilisations above 1, for a report's note
    paired_ratio(mine, theirs) the median of per-round ratios, and the ratio of medians
    add_roofline(rows, matmul_rate, bandwidth)  the speedup each step's slower limit predicts
"""
from __future__ import annotations

import statistics

from .. import costs

__all__ = ["utilisation", "above_probe", "decode_figures", "prefill_figures", "paired_ratio", "add_roofline"]


def utilisation(achieved: float, ceiling: float, what: str) -> float:
    """Returns achieved / ceiling, as it is, even above 1.

    A probe is the ceiling of its own access pattern only. A decode step that only reads its weights can beat the
    copy probe, which reads and writes (a GPU's read stream runs faster than its copy), and a CUDA-graph decode comes
    close to it. So a value above 1 is not an error: it says "above the probe", and a report names such values
    (`above_probe`) rather than the benchmark stopping after minutes of measurement. Values that cannot be a
    ratio (a ceiling that is not positive, a negative or NaN speed) are refused.
    """
    if not ceiling > 0 or not achieved >= 0:
        raise ValueError(f"{what}: cannot compare {achieved!r} with a ceiling of {ceiling!r}; both must be positive")
    return achieved / ceiling


def above_probe(values: dict) -> list[str]:
    """The names among values (name -> utilisation or None) above 1: each beat the probe it is measured against,
    so that probe is not its ceiling; the report says so beside them."""
    return [name for name, value in values.items() if value is not None and value > 1.0]


def decode_figures(cfg, dtype_bytes: int, step_times_s: list[float], batch_size: int, prompt_len: int,
                   new_tokens: int, matvec_rate: float, copy_rate: float) -> dict:
    """Returns tokens/s, bytes per step and token, and MBU from the step times of a cached decode."""
    step_s = statistics.median(step_times_s)
    steps = new_tokens - 1                                # the first new token comes from the prefill
    # step i (1-based) runs after prompt_len + i - 1 cached positions
    per_step = costs.decode_bytes(cfg, prompt_len, steps, dtype_bytes, batch_size) / steps
    achieved = per_step / step_s
    return {"batch_size": batch_size, "step_s": step_s, "tokens_per_s": batch_size / step_s,
            "bytes_per_step": per_step, "bytes_per_token": per_step / batch_size, "bytes_per_s": achieved,
            "matvec_bytes_per_s_alongside": matvec_rate,
            "mbu_matvec": utilisation(achieved, matvec_rate, "decode MBU against the matvec bandwidth"),
            "mbu_copy": utilisation(achieved, copy_rate, "decode MBU against the copy bandwidth")}


def prefill_figures(cfg, prompt_len: int, batch_size: int, seconds: float, matmul_rate_alongside: float,
                    matmul_rate_run: float) -> dict:
    """Returns tokens/s, FLOP/s and MFU (against the matmul rate measured alongside, and the run's)."""
    flops = costs.prefill_flops(cfg, prompt_len, batch_size)
    rate = flops / seconds
    return {"prompt_len": prompt_len, "median_s": seconds, "tokens_per_s": batch_size * prompt_len / seconds,
            "flops": flops, "flop_per_s": rate, "matmul_flop_per_s_alongside": matmul_rate_alongside,
            "mfu": utilisation(rate, matmul_rate_alongside, "prefill MFU against the matmul rate alongside"),
            "mfu_vs_run_ceiling": utilisation(rate, matmul_rate_run, "prefill MFU against the run's matmul rate")}


def paired_ratio(mine_s: list[float], theirs_s: list[float]) -> dict:
    """Returns how many times faster `mine` is: the median of per-round ratios (rounds ran back to back)
    and the ratio of the medians."""
    if not mine_s or len(mine_s) != len(theirs_s):
        raise ValueError(f"paired timings need the same number of rounds, got {len(mine_s)} and {len(theirs_s)}")
    pairs = [theirs / mine for mine, theirs in zip(mine_s, theirs_s)]
    return {"of_medians": statistics.median(theirs_s) / statistics.median(mine_s),
            "paired_median": statistics.median(pairs)}


def add_roofline(rows: list[dict], matmul_rate: float, bandwidth: float) -> None:
    """Adds the speedup the roofline predicts (each step at the slower of its two limits) to scaling rows."""
    for row in rows:
        cached = costs.roofline_seconds(row["flops_cached"], row["bytes_cached"], matmul_rate, bandwidth)
        recompute = costs.roofline_seconds(row["flops_recompute"], row["bytes_recompute"], matmul_rate, bandwidth)
        row["roofline_speedup"] = recompute / cached
