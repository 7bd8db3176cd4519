"""`python -m llminfer.bench serve`: load-test any OpenAI-compatible server, or compare llminfer's with vLLM's. Chapter 11.

    python -m llminfer.bench serve --base-url http://127.0.0.1:8000/v1 --model tiny-capitals \\
        --num-prompts 64 --request-rate 8 --goodput ttft:500 tpot:50 --out results/
    python -m llminfer.bench serve --compare vllm      # llminfer's server against vLLM's, alternating rounds

The load generator itself (`llminfer.serve.bench`: requests, records, `run_benchmark`, `summarize`) belongs to the
server's chapter; this is its command line, and the comparison against vLLM's CPU build on the real model:

    make peer-vllm                                   # vLLM's CPU build in .venv-vllm, once
    python -m llminfer.bench serve --compare vllm    # fp32 and bf16, concurrency 1, 4, 8 and 16
    python -m llminfer.bench serve --compare vllm --quick   # a short run that checks the harness

Both servers load the real model (SmolLM2-135M-Instruct) from one safetensors folder that llminfer writes from the
GGUF file (`llminfer.serve.peer.peer_checkpoint`). For each dtype, each round starts one server, warms it up, runs
the load generator (random token-id prompts of chapter 05's workload, a fixed number of output tokens with
`ignore_eos`, a fixed concurrency) at every concurrency level, and stops it; then the other server does the same.
The next round starts with the other server (`llminfer.timing.round_order`, alternating), so drifts in the
machine's load fall on both alike. A point (server, dtype, concurrency) pools the requests of every round: output
tokens per second are its tokens over its runs' summed durations, TTFT and TPOT percentiles come from all its
requests (`aggregate`). Also measured: each server's startup (process start to a 200 from /health) and the peak
resident memory of its processes (vLLM runs three).

Both servers get the same KV space (vLLM's `VLLM_CPU_KVCACHE_SPACE`, llminfer's pool sized to hold as many
positions), the same context length, the same batch limit (`max_num_seqs`) and the same compute cores: vLLM's
CPU build binds its model to every core but one, kept for its front end, and llminfer's engine gets as many torch
threads (`--threads` overrides it).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

from ..engine.latency import percentiles
from ..serve.bench import (RequestRecord, file_requests, plot_result, run_benchmark, workload_requests)
from ..serve import peer
from ..serve.peer import REAL_MODEL, ROOT, RSSSampler
from ..serve.process import ServerProcess
from ..timing import round_order
from .report import device_slug, load_average, machine, publish

__all__ = ["SERVERS", "TARGET_SPEEDUP", "aggregate", "ratios", "verdict", "plot_comparison", "compare", "points_of",
           "table", "save", "parse_goodput", "add_arguments", "command", "SUMMARY"]

SUMMARY = "load-test an OpenAI-compatible server, or llminfer's against vLLM's (chapter 11)"
SERVERS = ("llminfer", "vllm")
TARGET_SPEEDUP = 1.2                                 # output tokens/s against vLLM's, at the same dtype


# --- the plan and the figures ---------------------------------------------------------------------------------

def aggregate(runs: list[dict]) -> dict:
    """One point from its rounds' runs, each {"duration_s", "records": [RequestRecord or its dict]}: output tokens
    per second over the summed durations, each round's own rate, and TTFT/TPOT/ITL/E2E percentiles of every
    successful request. Chapter 11."""
    if not runs:
        raise ValueError("no runs to aggregate; pass at least one round's run")
    records = [r if isinstance(r, RequestRecord) else RequestRecord(**r) for run in runs for r in run["records"]]
    done = [r for r in records if r.success]
    tokens = sum(r.output_tokens for r in done)
    duration = sum(run["duration_s"] for run in runs)
    out = {"requests": len(records), "completed": len(done), "failed": len(records) - len(done),
           "output_tokens": tokens, "duration_s": duration,
           "output_throughput": tokens / duration if duration > 0 else float("nan"),
           "round_output_throughput": [sum(_tokens(r) for r in run["records"]) / run["duration_s"]
                                       if run["duration_s"] > 0 else float("nan") for run in runs]}
    for name, values in (("ttft", [r.ttft_s for r in done]), ("tpot", [r.tpot_s for r in done]),
                         ("itl", [g for r in done for g in r.itl_s]), ("e2e", [r.e2e_s for r in done])):
        for stat, value in percentiles(values).items():
            out[f"{name}_{stat}_s"] = value
    return out


def _tokens(record) -> int:
    """The output tokens of a successful request (0 for a failed one), from a RequestRecord or its dict."""
    if not isinstance(record, RequestRecord):
        record = RequestRecord(**record)
    return record.output_tokens if record.success else 0


def ratios(points: dict) -> dict:
    """Per dtype and concurrency: llminfer's output tokens/s over vLLM's, and vLLM's TTFT p50 over llminfer's (both
    > 1 where llminfer is ahead), from points[server][dtype][concurrency] summaries. Chapter 11."""
    out = {}
    for dtype, by_level in points.get("llminfer", {}).items():
        theirs = points.get("vllm", {}).get(dtype, {})
        for level, mine in by_level.items():
            if level not in theirs:
                continue
            other = theirs[level]
            out.setdefault(dtype, {})[level] = {
                "output_throughput": _div(mine["output_throughput"], other["output_throughput"]),
                "ttft_p50": _div(other["ttft_p50_s"], mine["ttft_p50_s"]),
                "tpot_p50": _div(other["tpot_p50_s"], mine["tpot_p50_s"])}
    return out


def _div(a, b) -> float:
    return a / b if a is not None and b and math.isfinite(a) and math.isfinite(b) else float("nan")


def verdict(ratio_table: dict, target: float = TARGET_SPEEDUP) -> dict:
    """Per dtype: whether llminfer's output tokens/s are >= target × vLLM's and its TTFT p50 no worse, at every
    concurrency level measured. Chapter 11."""
    out = {}
    for dtype, by_level in ratio_table.items():
        speed = all(r["output_throughput"] >= target for r in by_level.values())
        ttft = all(r["ttft_p50"] >= 1.0 for r in by_level.values())
        out[dtype] = {"throughput_target_met": speed, "ttft_no_worse": ttft,
                      "min_throughput_ratio": min(r["output_throughput"] for r in by_level.values())}
    return out


def plot_comparison(report: dict):
    """Output tokens/s, TTFT p50 and TPOT p50 against concurrency, per server and dtype: a matplotlib Figure."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    styles = {"llminfer": "o-", "vllm": "s--"}
    for server, by_dtype in report["points"].items():
        for dtype, by_level in by_dtype.items():
            levels = sorted(by_level, key=int)
            x = [int(c) for c in levels]
            label = f"{server} {dtype}"
            axes[0].plot(x, [by_level[c]["output_throughput"] for c in levels], styles.get(server, "x-"), label=label)
            axes[1].plot(x, [1e3 * by_level[c]["ttft_p50_s"] for c in levels], styles.get(server, "x-"), label=label)
            axes[2].plot(x, [1e3 * by_level[c]["tpot_p50_s"] for c in levels], styles.get(server, "x-"), label=label)
    for ax, label in zip(axes, ("output tokens/s", "TTFT p50 (ms)", "TPOT p50 (ms)")):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    machine = report.get("machine", {})
    fig.suptitle(f"{report['settings']['model']} served by llminfer and vLLM (CPU) · {machine.get('cpu', '')} · "
                 f"{report['settings']['output_tokens']} tokens per request, ignore_eos")
    fig.tight_layout()
    return fig


# --- the run --------------------------------------------------------------------------------------------------

def _start(server: str, folder: Path, dtype: str, settings: dict, log_dir: Path):
    """A started server of either kind: (object with base_url, pid, stop(), startup seconds)."""
    name = settings["model"]
    if server == "vllm":
        proc = peer.VLLMProcess(folder, name, dtype, settings["max_model_len"], settings["max_num_seqs"],
                           settings["kv_cache_gib"], startup_timeout_s=settings["startup_timeout_s"],
                           log_path=log_dir / f"vllm-{dtype}.log").start()
        return proc, proc.process.pid, proc.startup_s
    positions = int(settings["kv_cache_gib"] * 2**30 // settings["kv_bytes_per_position"][dtype])
    args = ["--model", str(folder), "--served-model-name", name, "--dtype", dtype,
            "--threads", str(settings["threads"]), "--max-model-len", str(settings["max_model_len"]),
            "--max-num-seqs", str(settings["max_num_seqs"]), "--num-blocks", str(max(1, positions // 16)),
            "--max-queued-requests", "1024"]
    started = time.perf_counter()
    proc = ServerProcess(args, startup_timeout_s=settings["startup_timeout_s"]).start()
    return proc, proc.process.pid, time.perf_counter() - started


def compare(dtypes=("float32", "bfloat16"), concurrency=(1, 4, 8, 16), num_prompts: int = 50, rounds: int = 2,
            output_tokens: int = 24, threads: int | None = None, max_model_len: int = 2048, max_num_seqs: int = 16,
            kv_cache_gib: float = 1.0, seed: int = 0, warmup: int = 4, folder: str | Path | None = None,
            servers=SERVERS, startup_timeout_s: float = 600.0, log=print) -> dict:
    """Runs the comparison (see the module's docstring); returns the JSON-ready report. Chapter 11."""
    import torch

    from ..costs import kv_cache_bytes
    from ..device import dtype_bytes
    if "vllm" in servers and peer.vllm_python() is None:
        raise FileNotFoundError("no vLLM environment at .venv-vllm: build it first with `make peer-vllm`")
    for level in concurrency:
        if not isinstance(level, int) or level < 1:
            raise ValueError(f"every concurrency level must be a positive integer, got {level!r}")
    folder = peer.peer_checkpoint(folder)
    from ..checkpoint import read_config
    config = read_config(folder)
    # vLLM's CPU build computes on every core but one, which it keeps for its front end (tokenizing, HTTP):
    # llminfer's engine gets as many threads, its event loop and the load generator the rest
    threads = threads or max(1, (os.cpu_count() or 1) - 1)
    settings = {"model": REAL_MODEL, "checkpoint": "the GGUF file dequantized, written by llminfer.save_pretrained",
                "dtypes": list(dtypes), "concurrency": list(concurrency), "num_prompts_per_round": num_prompts,
                "rounds": rounds, "output_tokens": output_tokens, "ignore_eos": True, "threads": threads,
                "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "kv_cache_gib": kv_cache_gib,
                "seed": seed, "warmup_requests": warmup, "startup_timeout_s": startup_timeout_s,
                "workload": "chapter 05's: random token-id prompts (median 24, at most 64 tokens)",
                "kv_bytes_per_position": {d: kv_cache_bytes(config, 1, dtype_bytes(getattr(torch, d))) for d in dtypes}}
    requests = [r.__class__(r.prompt, output_tokens) for r in workload_requests(num_prompts, seed=seed)]
    warm = [r.__class__(r.prompt, 8) for r in workload_requests(max(1, warmup), seed=seed + 1)]
    log_dir = ROOT / "build" / "peer"
    log_dir.mkdir(parents=True, exist_ok=True)
    report = {"machine": {**machine("cpu"), "slug": device_slug("cpu"), "load_average_before": load_average()},
              "settings": settings, "runs": [], "failures": [], "startup_s": {}, "rss_peak_bytes": {}}
    started = time.perf_counter()
    for dtype in dtypes:
        for r, order in enumerate(round_order(servers, rounds, alternate=True)):
            for server in order:
                log(f"[{time.perf_counter() - started:6.0f} s] {dtype} round {r + 1}/{rounds}: starting {server}")
                try:
                    proc, pid, startup = _start(server, folder, dtype, settings, log_dir)
                except (RuntimeError, TimeoutError) as exc:     # recorded; the other runs still count
                    report["failures"].append({"server": server, "dtype": dtype, "round": r, "error": str(exc)})
                    log(f"    {server} did not start: {str(exc)[:2000]}")
                    continue
                report["startup_s"].setdefault(server, {}).setdefault(dtype, []).append(startup)
                try:
                    with RSSSampler(pid) as rss:
                        run_benchmark(proc.base_url, REAL_MODEL, warm, max_concurrency=max(1, warmup))
                        for level in concurrency:
                            result = run_benchmark(proc.base_url, REAL_MODEL, requests, max_concurrency=level,
                                                   seed=seed, request_timeout_s=300.0, duration_limit_s=1800.0)
                            s = result.summary
                            report["runs"].append({"server": server, "dtype": dtype, "round": r,
                                                   "concurrency": level, "duration_s": s["duration_s"],
                                                   "summary": s, "records": [vars(x) for x in result.records]})
                            log(f"    {server:8s} {dtype:8s} c={level:<3d} {s['output_throughput']:7.1f} tok/s  "
                                f"TTFT p50 {1e3 * s['ttft_p50_s']:7.1f} ms  TPOT p50 {1e3 * s['tpot_p50_s']:6.1f} ms"
                                f"  ({s['completed']}/{s['requests']})")
                    report["rss_peak_bytes"].setdefault(server, {}).setdefault(dtype, []).append(rss.peak)
                finally:
                    proc.stop()
    report["points"] = points_of(report["runs"])
    report["ratios"] = ratios(report["points"])
    report["verdict"] = verdict(report["ratios"]) if report["ratios"] else {}
    report["elapsed_s"] = time.perf_counter() - started
    report["machine"]["load_average_after"] = load_average()
    return report


def points_of(runs: list[dict]) -> dict:
    """points[server][dtype][str(concurrency)] = aggregate of that point's runs over every round. Chapter 11."""
    grouped: dict = {}
    for run in runs:
        grouped.setdefault(run["server"], {}).setdefault(run["dtype"], {}).setdefault(
            str(run["concurrency"]), []).append(run)
    return {server: {dtype: {level: aggregate(rs) for level, rs in by_level.items()}
                     for dtype, by_level in by_dtype.items()} for server, by_dtype in grouped.items()}


def table(report: dict) -> str:
    """The report's points as text: one line per dtype, concurrency and server, then the ratios."""
    lines = [f"{'dtype':9s} {'conc':>4s} {'server':8s} {'tok/s':>7s} {'TTFT p50':>9s} {'p90':>8s} "
             f"{'TPOT p50':>9s} {'p90':>7s} {'n':>4s}"]
    for dtype in report["settings"]["dtypes"]:
        for level in map(str, report["settings"]["concurrency"]):
            for server in SERVERS:
                p = report["points"].get(server, {}).get(dtype, {}).get(level)
                if p is None:
                    continue
                lines.append(f"{dtype:9s} {level:>4s} {server:8s} {p['output_throughput']:7.1f} "
                             f"{1e3 * p['ttft_p50_s']:7.1f}ms {1e3 * p['ttft_p90_s']:6.1f}ms "
                             f"{1e3 * p['tpot_p50_s']:7.1f}ms {1e3 * p['tpot_p90_s']:5.1f}ms {p['completed']:4d}")
            r = report["ratios"].get(dtype, {}).get(level)
            if r is not None:
                lines.append(f"{'':9s} {level:>4s} {'ratio':8s} {r['output_throughput']:6.2f}x tok/s, "
                             f"TTFT p50 {r['ttft_p50']:.2f}x, TPOT p50 {r['tpot_p50']:.2f}x (>1: llminfer ahead)")
    for server, by_dtype in report["startup_s"].items():
        for dtype, values in by_dtype.items():
            rss = report["rss_peak_bytes"].get(server, {}).get(dtype, [])
            lines.append(f"{server:8s} {dtype:9s} startup {statistics.median(values):6.1f} s (median of "
                         f"{len(values)}), peak RSS {max(rss, default=0) / 2**30:.2f} GiB")
    return "\n".join(lines)


def save(report: dict, folder: str | Path) -> list[Path]:
    """Writes serve-vs-vllm-<cpu>.json and .png into folder; returns both paths. Chapter 11."""
    return publish(report, folder, f"serve-vs-vllm-{report['machine']['slug']}", plot=plot_comparison)


def compare_command(args) -> int:
    """`python -m llminfer.bench serve --compare vllm [--quick]`: runs, prints the table, writes JSON and plot."""
    if args.quick:
        options = dict(dtypes=tuple(args.dtypes or ("float32",)), concurrency=tuple(args.concurrency or (1, 8)),
                       num_prompts=args.num_prompts or 8, rounds=args.rounds or 1, warmup=2)
    else:
        options = dict(dtypes=tuple(args.dtypes or ("float32", "bfloat16")),
                       concurrency=tuple(args.concurrency or (1, 4, 8, 16)), num_prompts=args.num_prompts or 50,
                       rounds=args.rounds or 2)
    servers = tuple(args.servers) if args.servers else SERVERS
    report = compare(**options, output_tokens=args.output_tokens, threads=args.threads, kv_cache_gib=args.kv_cache_gib,
                     max_model_len=args.max_model_len, servers=servers, startup_timeout_s=args.startup_timeout,
                     log=lambda line: print(line, file=sys.stderr, flush=True))
    print(table(report))
    for failure in report["failures"]:
        print(f"{failure['server']} {failure['dtype']} round {failure['round'] + 1} did not start "
              f"(see build/peer/ for its log)")
    for dtype, v in report["verdict"].items():
        print(f"{dtype}: llminfer/vLLM output tokens/s >= {TARGET_SPEEDUP}x at every level: "
              f"{'✓' if v['throughput_target_met'] else '✗'} (lowest {v['min_throughput_ratio']:.2f}x) · TTFT p50 no "
              f"worse: {'✓' if v['ttft_no_worse'] else '✗'}")
    out = args.out or (str(ROOT / "build" / "peer") if args.quick else str(ROOT / "data" / "benchmarks"))
    json_path, png_path = save(report, out)
    print(f"wrote {json_path} and {png_path}")
    return 0


# --- the command line --------------------------------------------------------------------------------------

def parse_goodput(items: list[str] | None) -> dict:
    """['ttft:500', 'tpot:50'] (milliseconds, as vLLM writes them) -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    slo = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--goodput takes name:milliseconds with name ttft, tpot or e2e, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the target must be > 0 ms")
        slo[name] = ms / 1e3
    return slo


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Adds the load generator's options, and the comparison's, to p. Chapter 11."""
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's OpenAI base URL")
    p.add_argument("--model", default="tiny-capitals", help="the model name the server knows")
    p.add_argument("--api-key", default="none")
    p.add_argument("--dataset", default="workload", help="'workload' (chapter 05's) or a JSON-lines file")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests (default 32; with --compare, per point and round: 50, --quick 8)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson; below 1: burstier gamma arrivals")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=1024, help="token ids of the workload's prompts lie below this")
    p.add_argument("--prompt-median", type=float, default=24)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--output-median", type=float, default=16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at the end-of-sequence token")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="*", default=None, help="targets in ms, e.g. ttft:500 tpot:50 e2e:2000")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds before one request is given up")
    p.add_argument("--duration-limit", type=float, default=300.0, help="no request is sent after this many seconds")
    p.add_argument("--out", default=None, help="folder for serve_bench.json and serve_bench.png")
    against = p.add_argument_group("against a peer (starts each server in turn, alternating rounds)")
    against.add_argument("--compare", choices=["vllm"], default=None,
                      help="serve the real model with llminfer and with vLLM (from .venv-vllm: make peer-vllm)")
    against.add_argument("--quick", action="store_true", help="a short comparison that checks the harness")
    against.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=None,
                      help="(default: float32 bfloat16; --quick: float32)")
    against.add_argument("--concurrency", nargs="+", type=int, default=None, help="(default: 1 4 8 16; --quick: 1 8)")
    against.add_argument("--rounds", type=int, default=None, help="rounds per dtype (default 2; --quick 1)")
    against.add_argument("--servers", nargs="+", choices=["llminfer", "vllm"], default=None)
    against.add_argument("--output-tokens", type=int, default=24, help="tokens per request (ignore_eos)")
    against.add_argument("--threads", type=int, default=None,
                      help="llminfer's torch threads (default: the CPUs less one, the cores vLLM computes on)")
    against.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server gets to answer /health")
    against.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV space of each server")
    against.add_argument("--max-model-len", type=int, default=2048, help="context length of both servers")


def command(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """`python -m llminfer.bench serve`: one load test of a server, or with --compare the comparison against a
    peer; bad input exits with status 2. Chapter 11."""
    try:
        slo = parse_goodput(args.goodput)
    except ValueError as exc:
        p.error(str(exc))
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.compare:
        for name in ("rounds", "output_tokens", "threads", "max_model_len"):
            value = getattr(args, name)
            if value is not None and value < 1:
                p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if any(c < 1 for c in args.concurrency or []):
            p.error(f"--concurrency levels must be >= 1, got {args.concurrency}")
        if not args.startup_timeout > 0:
            p.error(f"--startup-timeout must be > 0 seconds, got {args.startup_timeout}")
        if not args.kv_cache_gib > 0:
            p.error(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")
        return compare_command(args)
    args.num_prompts = args.num_prompts or 32
    if args.dataset == "workload":
        requests = workload_requests(args.num_prompts, args.vocab_size, args.seed, args.prompt_median,
                                     max_prompt=args.max_prompt, output_median=args.output_median,
                                     max_output=args.max_output)
    else:
        requests = file_requests(args.dataset, args.num_prompts)
    result = run_benchmark(args.base_url, args.model, requests, args.request_rate, args.max_concurrency,
                           args.burstiness, args.seed, slo, not args.no_ignore_eos, args.temperature,
                           args.request_timeout, args.duration_limit, args.api_key, progress=sys.stderr.isatty())
    s = result.summary
    print(f"{s['completed']}/{s['requests']} requests in {s['duration_s']:.2f} s: "
          f"{s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        print(f"  {name.upper():5s} ms  mean {1e3 * s[f'{name}_mean_s']:8.2f}  p50 {1e3 * s[f'{name}_p50_s']:8.2f}  "
              f"p90 {1e3 * s[f'{name}_p90_s']:8.2f}  p99 {1e3 * s[f'{name}_p99_s']:8.2f}")
    if slo:
        print(f"  goodput {s['goodput']:.2f} req/s ({s['good_requests']}/{s['completed']} met "
              + ", ".join(f"{k} <= {1e3 * v:g} ms" for k, v in slo.items()) + ")")
    failed = [r for r in result.records if not r.success]
    if failed:
        print(f"  {len(failed)} failed; first: {failed[0].error}")
    if args.out:
        publish(result.to_json(), args.out, "serve_bench", plot=lambda _: plot_result(result), stream=sys.stdout)
        print(f"wrote {Path(args.out) / 'serve_bench.json'} and {Path(args.out) / 'serve_bench.png'}")
    return 0 if not failed else 1
