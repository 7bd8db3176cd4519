"""The engine section of `python -m llminfer.bench prefill-decode`: the engine's batched decode beside one fast single request. Chapters 05 and 08.

Decode is memory-bound: a step streams every weight once, whether it carries one sequence or eight. So an
engine step over B running requests should cost little more than one request's step, and its tokens/s be
close to B times a single request's. This section measures that on one random-weight model of a published
shape (SmolLM2-135M by default), in one process, the two contenders taking turns:

    single   one request through the static decoder of chapter 08 (`llminfer.fast.compile_decode`):
             fused projections, the native layer stack in one call, the compiled step; 1 / median gap
    engine   B requests at once through `LLMEngine(optimize=True)`: its decode steps (every request
             decoding), B tokens each; B / median step time

and reports the median of each over the rounds and their ratio (the engine's tokens/s over the single
request's). `python -m llminfer.bench prefill-decode` runs it as its engine section on a CPU (--no-engine skips it).
"""
from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..checkpoint import load_random
from .measure import interleave, shape_config, threads
from .report import load_average, machine

__all__ = ["EngineSettings", "engine_section", "engine_table"]


@dataclass
class EngineSettings:
    """What the engine section measures. Chapters 05 and 08."""
    shape: str = "smollm2-135m"   # a published shape (PRESETS) or a bundled model's, with random weights
    dtype: str = "float32"
    requests: int = 8              # B: requests decoding together in the engine
    prompt_len: int = 32
    new_tokens: int = 32
    rounds: int = 5
    threads: int | None = 2        # None: torch's current count
    compile: bool = True           # the single request's step compiled (as chapter 08 runs it)
    seed: int = 0


def _check(settings: EngineSettings) -> None:
    for name in ("requests", "prompt_len", "rounds"):
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"engine section: {name}={value!r} must be a positive integer")
    if not isinstance(settings.new_tokens, int) or settings.new_tokens < 3:
        raise ValueError(f"engine section: new_tokens={settings.new_tokens!r} must be an integer >= 3 (decode is "
                         "timed between tokens)")
    if settings.threads is not None and (not isinstance(settings.threads, int) or settings.threads < 1):
        raise ValueError(f"engine section: threads={settings.threads!r} must be a positive integer or None")
    if settings.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"engine section: dtype={settings.dtype!r} must be 'float32' or 'bfloat16'")


def _engine_decode_rate(engine, prompts, new_tokens: int) -> tuple[float, int]:
    """B / median time of the engine's steps in which all B requests decode; returns it and their count."""
    from ..engine import SamplingParams

    first = len(engine.trace)
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens))
    steps = list(engine.trace)[first:]
    full = [s.end_s - s.start_s for s in steps
            if len(s.entries) == len(prompts) and all(kind == "decode" for _, kind, _ in s.entries)]
    if not full:
        raise RuntimeError("the engine ran no step with every request decoding; raise max_num_seqs or new_tokens")
    return len(prompts) / statistics.median(full), len(full)


def engine_section(settings: EngineSettings | None = None, log=None) -> dict:
    """Returns the engine section's report: tokens/s of the engine's B-request decode and of one fast request,
    medians over interleaved rounds, and their ratio. Chapters 05 and 08."""
    from ..engine import LLMEngine
    from ..fast import compile_decode

    settings = settings or EngineSettings()
    _check(settings)
    log = log or (lambda message: print(f"[bench.engine_decode] {message}", file=sys.stderr, flush=True))
    started, load_before = time.perf_counter(), load_average()
    with threads(settings.threads) as count:
        dtype = getattr(torch, settings.dtype)
        length = settings.prompt_len + settings.new_tokens
        cfg = shape_config(settings.shape).replace(max_seq_len=length + 8)
        base = load_random(cfg, dtype=dtype, seed=settings.seed)
        generator = torch.Generator().manual_seed(settings.seed)
        prompts = [torch.randint(0, cfg.vocab_size, (settings.prompt_len,), generator=generator).tolist()
                   for _ in range(settings.requests)]
        log(f"preparing the single request's decoder (compile={settings.compile})")
        decoder = compile_decode(copy.deepcopy(base), max_seq_len=length, compile=settings.compile)
        single_ids = torch.tensor([prompts[0]])
        log(f"preparing the engine for {settings.requests} requests")
        blocks = settings.requests * (-(-length // 16)) + 1
        engine = LLMEngine(copy.deepcopy(base), block_size=16, num_blocks=blocks, max_num_seqs=settings.requests,
                           max_num_batched_tokens=max(512, settings.requests * settings.prompt_len),
                           max_model_len=length, optimize=True)
        # one warm-up each, then the two take turns: tokens/s of one request, and (B / step time, steps timed)
        found = interleave({
            "single": lambda: 1.0 / statistics.median(decoder.generate(single_ids, settings.new_tokens).itl_s),
            "engine": lambda: _engine_decode_rate(engine, prompts, settings.new_tokens)},
            settings.rounds, warmup=1, log=log)
        single = found["single"]
        batched = [rate for rate, _ in found["engine"]]
        steps = sum(counted for _, counted in found["engine"])
        single_rate, engine_rate = statistics.median(single), statistics.median(batched)
        return {
            "what": f"engine decode of {settings.requests} requests vs one fast request, interleaved rounds",
            "machine": machine("cpu"), "settings": asdict(settings),
            "threads": count, "load_average_before": load_before,
            "load_average_after": load_average(), "elapsed_s": time.perf_counter() - started,
            "single_tokens_per_s": single_rate, "engine_tokens_per_s": engine_rate,
            "ratio": engine_rate / single_rate,
            "round_ratios": [b / s for b, s in zip(batched, single)],
            "single_round_tokens_per_s": single, "engine_round_tokens_per_s": batched,
            "engine_decode_steps_timed": steps, "engine_kernel": engine.cache.kernel_name,
        }


def engine_table(report: dict) -> str:
    """The engine section as text lines. Chapters 05 and 08."""
    s = report["settings"]
    return "\n".join([
        f"engine section: {s['shape']} {s['dtype']}, {report['threads']} thread(s), prompt {s['prompt_len']}, "
        f"{s['new_tokens']} new tokens, {s['rounds']} rounds, load {report['load_average_before']} -> "
        f"{report['load_average_after']}",
        f"  one fast request        {report['single_tokens_per_s']:>8.1f} tokens/s",
        f"  engine, {s['requests']} requests    {report['engine_tokens_per_s']:>8.1f} tokens/s",
        f"  ratio                   {report['ratio']:>8.2f}x (rounds: "
        f"{', '.join(f'{r:.2f}' for r in report['round_ratios'])})",
    ])
