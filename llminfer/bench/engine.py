"""The measurements of chapters 05 and 06, as functions, and `python -m llminfer.bench engine`. Chapter 05.

    batch_sweep(model, [1, 2, 4, 8])          decode-step time and tokens/s against batch size
    compare_policies(model, workload)         sequential, static, continuous on one workload
    chunked_prefill_trade(model)              running decodes' ITL when a long prompt arrives, chunked or not
    prefix_cache_trade(model)                 TTFT and throughput with a shared system prompt, cached or not
    memory_accounting(model, workload)        KV positions used vs reserved (preallocated, per request, paged)

The command runs them on the chapters' default settings and writes a JSON report (machine, settings,
figures, whether the targets were met) to data/benchmarks/engine-<machine>.json.
"""
from __future__ import annotations

import argparse
import time

import torch

from ..config import ModelConfig
from ..device import resolve_device, synchronize
from ..engine.llm_engine import LLMEngine
from ..engine.sampling_params import SamplingParams
from ..engine.workload import make_workload, replay, summarize
from ..timing import time_fn
from .measure import threads
from .report import device_slug, machine, publish

__all__ = ["NARROW_LLAMA", "DEFAULT_WORKLOAD", "DEFAULT_ENGINE", "SLO", "TARGETS", "batch_sweep", "latency_target",
           "compare_policies", "chunked_prefill_trade", "prefix_cache_trade", "memory_accounting", "add_arguments",
           "command", "SUMMARY"]

SUMMARY = "batching policies, chunked prefill, prefix caching and KV memory (chapters 05-06)"

# The model the workloads run on: a Llama of SmolLM2's family, narrowed (6.8M parameters) so that the slowest
# policy finishes in seconds on a CPU. Its weights are random: speed, not text, is measured.
NARROW_LLAMA = ModelConfig(vocab_size=8192, dim=256, n_layers=6, n_heads=4, n_kv_heads=2, hidden_dim=768,
                           max_seq_len=512, tie_embeddings=True)
# The chapter 05 workload: Poisson arrivals, log-normal lengths (see workload.py for the sources).
DEFAULT_WORKLOAD = dict(n_requests=24, rate=40.0, seed=0, prompt_median=32, prompt_sigma=0.8, max_prompt=192,
                        output_median=32, output_sigma=0.8, max_output=128)
DEFAULT_ENGINE = dict(block_size=16, max_num_seqs=16, max_num_batched_tokens=256)
SLO = dict(slo_ttft_s=2.0, slo_tpot_s=0.05)           # a fixed latency target (see latency_target for a relative one)
TPOT_SLO_FACTOR = 4.0                                 # latency_target: TPOT within 4x that of a request served alone
TARGETS = {"continuous_over_sequential": 3.0, "continuous_over_static": 1.5}


def batch_sweep(model, batch_sizes: list[int], cached_len: int = 64, repeats: int = 3, progress: bool = False) -> dict:
    """Median time of one decode step for each batch size, after cached_len positions; tokens/s. Chapter 05.

    A static batch on the model's contiguous cache (chapter 04): B sequences, one new token each. The
    cache's contents do not change the time, so its length is set without a prefill.
    """
    device = model.device
    steps, rates = [], []
    sizes = batch_sizes
    if progress:
        from tqdm.auto import tqdm
        sizes = tqdm(batch_sizes, desc="batch sizes", leave=False)
    for batch in sizes:
        cache = model.new_cache(batch_size=batch, max_seq_len=cached_len + 1)
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)

        def one_step():
            cache.length = cached_len                      # back to cached_len (the contents do not matter)
            with torch.inference_mode():
                model(tokens, cache=cache)

        timing = time_fn(one_step, device, warmup=1, repeats=repeats)
        steps.append(timing.median_s)
        rates.append(batch / timing.median_s)
        del cache
    return {"batch_size": list(batch_sizes), "step_s": steps, "tokens_per_s": rates, "cached_len": cached_len}


def latency_target(model, prompt_len: int = 32, output_len: int = 32, ttft_s: float = 2.0,
                   tpot_factor: float = TPOT_SLO_FACTOR) -> dict:
    """A latency target that scales with the machine: TTFT within ttft_s of arrival, TPOT within
    tpot_factor times the TPOT of one request served alone (measured here). Chapter 05."""
    engine = LLMEngine(model, block_size=16, max_num_seqs=1, max_model_len=min(model.config.max_seq_len, 512))
    engine.generate([[1] * 8], SamplingParams(max_new_tokens=2))
    (alone,) = engine.generate([[5] * prompt_len], SamplingParams(max_new_tokens=output_len))
    return {"slo_ttft_s": ttft_s, "slo_tpot_s": tpot_factor * alone.tpot_s, "alone_ttft_s": alone.ttft_s,
            "alone_tpot_s": alone.tpot_s}


def _engine(model, workload, policy: str, **settings) -> LLMEngine:
    settings = {**DEFAULT_ENGINE, **settings}
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in workload.requests)
    block = settings["block_size"]
    max_model_len = min(model.config.max_seq_len, -(-longest // block) * block)
    engine = LLMEngine(model, policy=policy, max_model_len=max_model_len, **settings)
    engine.generate([[1] * 8], SamplingParams(max_new_tokens=2))    # warm-up: first calls allocate and compile
    return engine


def compare_policies(model, workload, policies=("sequential", "static", "continuous"), progress: bool = False,
                     slo: dict | None = None, **settings) -> dict:
    """Replays workload under each policy on a fresh engine; returns {policy: (WorkloadResult, summary)}. Chapter 05."""
    slo = {k: v for k, v in (slo or SLO).items() if k in ("slo_ttft_s", "slo_tpot_s")}
    out = {}
    for policy in policies:
        engine = _engine(model, workload, policy, **settings)
        result = replay(engine, workload, progress=progress)
        out[policy] = (result, summarize(result, **slo))
    return out


def chunked_prefill_trade(model, n_decoders: int = 8, decode_prompt: int = 16, decode_tokens: int = 32,
                          long_prompt: int = 384, budget: int = 64, arrive_after_steps: int = 8, seed: int = 0) -> dict:
    """n_decoders requests are decoding when one long prompt arrives; with chunked prefill (token budget
    `budget`) and without (the whole prompt in one step). Returns per setting the decoders' ITLs, the long
    request's TTFT and the step times. Chapter 05."""
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (n_decoders, decode_prompt), generator=generator).tolist()
    long_ids = torch.randint(3, vocab, (long_prompt,), generator=generator).tolist()
    out = {}
    for chunked in (True, False):
        engine = LLMEngine(model, block_size=16, max_num_seqs=n_decoders + 1, enable_prefix_caching=False,
                           max_num_batched_tokens=budget if chunked else long_prompt + n_decoders,
                           chunked_prefill=chunked, max_model_len=min(model.config.max_seq_len, 512))
        engine.generate([[1] * 8], SamplingParams(max_new_tokens=2))
        first = len(engine.trace)
        ids = [engine.add_request(p, SamplingParams(max_new_tokens=decode_tokens)) for p in prompts]
        for _ in range(arrive_after_steps):
            engine.step()
        long_id = engine.add_request(long_ids, SamplingParams(max_new_tokens=1))
        arrival_step = len(engine.trace) - first
        while engine.has_unfinished():
            engine.step()
        outputs = [engine.pop_output(i) for i in ids]
        long_out = engine.pop_output(long_id)
        trace = list(engine.trace)[first:]
        out["chunked" if chunked else "whole"] = {
            "itl_s": [gap for o in outputs for gap in o.itl_s],
            "max_itl_s": max(gap for o in outputs for gap in o.itl_s),
            "long_ttft_s": long_out.ttft_s,
            "step_s": [r.end_s - r.start_s for r in trace],
            "step_tokens": [r.num_tokens for r in trace],
            "arrival_step": arrival_step,
            "budget": engine.max_num_batched_tokens,
        }
    return out


def prefix_cache_trade(model, system_prompt_len: int = 96, n_requests: int = 24, rate: float = 40.0,
                       seed: int = 1, **settings) -> dict:
    """A shared system prompt in front of every request of a workload; prefix caching on and off. Chapter 06."""
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(3, model.config.vocab_size, (system_prompt_len,), generator=generator).tolist()
    workload = make_workload(n_requests=n_requests, rate=rate, vocab_size=model.config.vocab_size, seed=seed,
                             prompt_median=24, max_prompt=96, output_median=16, max_output=64, shared_prefix=system)
    out = {}
    for caching in (False, True):
        engine = _engine(model, workload, "continuous", enable_prefix_caching=caching, **settings)
        result = replay(engine, workload)
        out["cached" if caching else "uncached"] = (result, summarize(result, **SLO), engine.stats)
    return out


def memory_accounting(model, workload, max_seq_len: int = 512, block_size: int = 16, **settings) -> dict:
    """KV positions used against what three ways of storing them reserve, after every step of a run. Chapter 06.

    All requests arrive at once. Per step and running request: the positions it holds; `reserve_max` sets
    aside max_seq_len (chapter 04's preallocation), `reserve_request` its prompt + max_new_tokens, `paged`
    its whole blocks. `waste` lists each running sequence's unused positions in its last block, every step.
    """
    settings = {**DEFAULT_ENGINE, **settings, "block_size": block_size}
    engine = LLMEngine(model, max_model_len=max_seq_len, **settings)
    for r in workload.requests:
        engine.add_request(list(r.prompt_ids), SamplingParams(max_new_tokens=r.max_new_tokens))
    rows = []
    while engine.has_unfinished():
        engine.step()
        running = [s for s in engine.scheduler.running if s.block_table]
        rows.append(dict(
            used=sum(s.num_computed_tokens for s in running), seqs=len(running),
            reserve_max=max_seq_len * len(running),
            reserve_request=sum(s.num_prompt_tokens + s.params.max_new_tokens for s in running),
            paged=block_size * sum(len(s.block_table) for s in running),
            waste=[block_size * len(s.block_table) - s.num_computed_tokens for s in running]))
    totals = {k: sum(r[k] for r in rows) for k in ("used", "reserve_max", "reserve_request", "paged")}
    waste = [w for r in rows for w in r["waste"]]
    return {"rows": rows, "totals": totals, "waste": waste, "block_size": block_size, "max_seq_len": max_seq_len,
            "used_fraction": {k: totals["used"] / totals[k] for k in ("reserve_max", "reserve_request", "paged")},
            "mean_waste": sum(waste) / len(waste), "max_seqs": max(r["seqs"] for r in rows)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the engine benchmark's options to parser. Chapter 05."""
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when present)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (steadier with 1)")
    parser.add_argument("--out", default="data/benchmarks", help="folder for engine-<machine>.json")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each policy (the median is reported)")


def run(device, repeats: int = 3) -> dict:
    """Returns the report: a batch sweep, the policies compared `repeats` times, chunked prefill, prefix caching,
    KV memory; the targets and whether they were met. Chapters 05-06."""
    torch.manual_seed(0)
    report = {"machine": machine(device), "settings": {"workload": DEFAULT_WORKLOAD, "engine": DEFAULT_ENGINE,
                                                       "slo": SLO, "model": NARROW_LLAMA.__dict__.copy()}}
    from ..checkpoint import load_random

    smollm = load_random("smollm2-135m", device=device, dtype=torch.float32)
    sweep = batch_sweep(smollm, [1, 2, 4, 8, 16, 32], repeats=3)
    report["batch_sweep_smollm2_135m"] = sweep
    del smollm
    model = load_random(NARROW_LLAMA, device=device, dtype=torch.float32)
    workload = make_workload(vocab_size=NARROW_LLAMA.vocab_size, **DEFAULT_WORKLOAD)
    slo = latency_target(model)
    report["latency_target"] = slo
    runs = []
    for _ in range(repeats):
        runs.append({p: s for p, (_, s) in compare_policies(model, workload, slo=slo).items()})
        synchronize(device)
    report["policies"] = runs
    med = {p: sorted(r[p]["throughput_tok_s"] for r in runs)[len(runs) // 2] for p in runs[0]}
    ratios = {"continuous_over_sequential": med["continuous"] / med["sequential"],
              "continuous_over_static": med["continuous"] / med["static"]}
    report["median_throughput_tok_s"] = med
    report["ratios"] = ratios
    report["targets"] = {k: {"target": v, "measured": ratios[k], "met": ratios[k] >= v} for k, v in TARGETS.items()}
    trade = chunked_prefill_trade(model)
    report["chunked_prefill"] = {k: {"max_itl_s": v["max_itl_s"], "long_ttft_s": v["long_ttft_s"],
                                     "itl_p50_s": sorted(v["itl_s"])[len(v["itl_s"]) // 2], "budget": v["budget"]}
                                 for k, v in trade.items()}
    prefix = prefix_cache_trade(model)
    report["prefix_caching"] = {k: {"throughput_tok_s": s["throughput_tok_s"], "ttft_p50_s": s["ttft_p50_s"],
                                    "ttft_p90_s": s["ttft_p90_s"], "hit_rate": st.prefix_hit_rate}
                                for k, (_, s, st) in prefix.items()}
    memory = memory_accounting(model, make_workload(vocab_size=NARROW_LLAMA.vocab_size,
                                                    **dict(DEFAULT_WORKLOAD, rate=float("inf"))))
    report["memory"] = {k: memory[k] for k in ("totals", "used_fraction", "mean_waste", "block_size", "max_seq_len",
                                               "max_seqs")}
    report["created"] = time.strftime("%Y-%m-%d")
    return report


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`python -m llminfer.bench engine`: runs, prints the targets, writes <out>/engine-<machine>.json. Chapter 05."""
    if args.repeats < 1 or args.threads < 1:
        parser.error(f"--repeats {args.repeats} and --threads {args.threads} must be positive integers")
    device = resolve_device(args.device)
    with threads(args.threads if device.type == "cpu" else None):
        report = run(device, args.repeats)
    publish(report, args.out, f"engine-{device_slug(device)}", table=table)
    return 0


def table(report: dict) -> str:
    """The targets as lines: each ratio, its target and whether it was met. Chapter 05."""
    return "\n".join(f"{key}: {row['measured']:.2f}x (target {row['target']}x, {'met' if row['met'] else 'short'})"
                     for key, row in report["targets"].items())
