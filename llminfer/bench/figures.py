"""The benchmark's figures, as pure functions of timings and counts: no tensor, no clock. Chapter 04.

    decode_figures(...)        tokens/s, bytes per token and MBU of a cached decode
    prefill_figures(...)       tokens/s, FLOP/s and MFU of a prefill
    utilisation(achieved, ceiling, what)   achieved / ceiling, refused above 1 (the probe is wrong)
    paired_ratio(mine, theirs) the median of per-round ratios, and the ratio of medians
    add_roofline(rows, matmul_rate, bandwidth)  the speedup each step's slower limit predicts
"""
from __future__ import annotations

import statistics

from .. import costs

__all__ = ["utilisation", "decode_figures", "prefill_figures", "paired_ratio", "add_roofline"]


def utilisation(achieved: float, ceiling: float, what: str) -> float:
    """Returns achieved / ceiling; a value above 1 means the ceiling was mis-measured, so it is refused."""
    if not ceiling > 0 or not achieved >= 0:
        raise ValueError(f"{what}: cannot compare {achieved!r} with a ceiling of {ceiling!r}; both must be positive")
    value = achieved / ceiling
    if value > 1.0:
        raise ValueError(f"{what} would be {value:.2f}: above 1.0 the ceiling it is measured against is wrong "
                         "(a cold or too small probe), so it is not reported; rerun with larger probes")
    return value


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
