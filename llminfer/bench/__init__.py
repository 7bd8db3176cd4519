"""`python -m llminfer.bench`: prefill and decode beside the machine's measured ceilings and beside peers. Chapter 04.

    measure     the run: ceilings, prefill, decode contenders, batch sweep, context scaling
    figures     MFU, MBU, ratios and the roofline, as pure functions of timings
    report      the machine, the JSON, the terminal table and the plot
    transformers_contender   transformers `generate` on the same weights, as a GenerationResult
"""
from .measure import Settings, check_settings, estimate_bytes, main, parse_args, run, shape_config

__all__ = ["Settings", "parse_args", "check_settings", "estimate_bytes", "shape_config", "run", "main"]
