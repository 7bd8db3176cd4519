"""`python -m llminfer.bench`: prefill and decode beside the machine's measured ceilings and beside peers. Chapter 04.

    measure     the run: ceilings, prefill, decode contenders, batch sweep, context scaling
    figures     MFU, MBU, ratios and the roofline, as pure functions of timings
    report      the machine, the JSON, the terminal table and the plot
    transformers_contender   transformers `generate` on the same weights, as a GenerationResult
    decode      `python -m llminfer.bench.decode`: decode by precision against the bandwidth ceiling (chapter 08)
    engine      `python -m llminfer.bench.engine`: batching, chunked prefill, prefix caching (chapters 05-06)
    engine_decode  `python -m llminfer.bench.engine_decode`: the engine's 8-request decode beside one fast request
                   (the engine section of `python -m llminfer.bench` on a CPU)
"""
from .measure import Settings, check_settings, estimate_bytes, main, parse_args, run, shape_config

__all__ = ["Settings", "parse_args", "check_settings", "estimate_bytes", "shape_config", "run", "main"]
