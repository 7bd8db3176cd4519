"""llminfer's server against vLLM's CPU build: same checkpoint, same load generator, alternating rounds. Chapter 11.

    make peer-vllm                                             # vLLM's CPU build in .venv-vllm, once
    python -m llminfer.serve.bench --compare vllm              # fp32 and bf16, concurrency 1, 4, 8 and 16
    python -m llminfer.serve.bench --compare vllm --quick      # a short run that checks the harness

vLLM's CPU build reads no GGUF file, so both servers load the real model (SmolLM2-135M-Instruct) from one
safetensors folder that llminfer writes from the GGUF (`peer_checkpoint`, through `llminfer.save_pretrained`).
For each dtype, each round starts one server, warms it up, runs the load generator (`bench.benchmark`: random
token-id prompts of chapter 05's workload, a fixed number of output tokens with `ignore_eos`, a fixed
concurrency) at every concurrency level, and stops it; then the other server does the same. The next round
starts with the other server, so drifts in the machine's load fall on both alike. A point (server, dtype,
concurrency) pools the requests of every round: output tokens per second are its tokens over its runs' summed
durations, TTFT and TPOT percentiles come from all its requests (`aggregate`). Also measured: each server's
startup (process start to a 200 from /health) and the peak resident memory of its processes (vLLM runs three).

Both servers get the same KV space (vLLM's `VLLM_CPU_KVCACHE_SPACE`, llminfer's pool sized to hold as many
positions), the same context length, the same batch limit (`max_num_seqs`) and the same compute cores: vLLM's
CPU build binds its model to every core but one, kept for its front end, and llminfer's engine gets as many torch
threads (`--threads` overrides it).
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..engine.latency import percentiles
from .bench import RequestRecord, _finite, run_benchmark, workload_requests
from .process import LOOPBACK, ServerExited, ServerProcess, free_port, wait_until_healthy

__all__ = ["ROOT", "vllm_python", "peer_checkpoint", "process_tree_rss", "RSSSampler", "VLLMProcess",
           "round_order", "aggregate", "ratios", "compare", "plot_comparison", "main"]

ROOT = Path(__file__).resolve().parents[2]          # the repository: .venv-vllm and build/ live here
SERVERS = ("llminfer", "vllm")
REAL_MODEL = "smollm2-135m-instruct"
TARGET_SPEEDUP = 1.2                                 # output tokens/s against vLLM's, at the same dtype


def vllm_python(root: str | Path | None = None) -> Path | None:
    """The Python of `make peer-vllm`'s environment (.venv-vllm), or None where it was not built. Chapter 11."""
    python = Path(root or ROOT) / ".venv-vllm" / "bin" / "python"
    return python if python.is_file() else None


def peer_checkpoint(folder: str | Path | None = None, name: str = REAL_MODEL) -> Path:
    """The real model as a Hugging Face safetensors folder (config, weights, tokenizer files), written once from
    the GGUF file by `llminfer.save_pretrained`; returns the folder. Chapter 11."""
    import torch

    import llminfer
    folder = Path(folder) if folder is not None else ROOT / "build" / "peer" / name
    done = folder / ".complete"
    if done.is_file():
        return folder
    model, tokenizer = llminfer.load_pretrained(name, device="cpu", dtype=torch.float32)
    llminfer.save_pretrained(model, folder, tokenizer=tokenizer)
    done.write_text(name + "\n")
    return folder


# --- memory of a server's processes ---------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (Linux /proc; 0 where it cannot be read). Chapter 11."""
    total, stack, seen = 0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError):
            continue
        stack += _children(current)
    return total


class RSSSampler:
    """The peak of `process_tree_rss(pid)`, sampled on a thread every interval_s while the block runs."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llminfer-rss", daemon=True)

    def _run(self) -> None:
        while True:
            self.peak = max(self.peak, process_tree_rss(self.pid))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "RSSSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, process_tree_rss(self.pid))


# --- vLLM as a child process ----------------------------------------------------------------------------------

class VLLMProcess:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) from .venv-vllm on 127.0.0.1, as a
    child process with its own log file; start() waits for /health, stop() ends its process group. Chapter 11.

    start() raises RuntimeError, with the tail of the log, if the process exits before it is ready, and
    TimeoutError, with the tail, if /health has not answered 200 within startup_timeout_s.
    """

    def __init__(self, model_dir: str | Path, served_model_name: str, dtype: str = "float32",
                 max_model_len: int = 2048, max_num_seqs: int = 16, kv_cache_gib: float = 1.0,
                 python: str | Path | None = None, port: int | None = None, startup_timeout_s: float = 600.0,
                 log_path: str | Path | None = None, extra_args: list[str] | None = None):
        python = Path(python) if python is not None else vllm_python()
        if python is None or not Path(python).is_file():
            raise FileNotFoundError("no vLLM environment: build it with `make peer-vllm` (.venv-vllm, 3.4 GB)")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16' (what both servers run on a CPU), got {dtype!r}")
        if not kv_cache_gib > 0:
            raise ValueError(f"kv_cache_gib must be > 0 GiB, got {kv_cache_gib!r}")
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.startup_s = float("nan")
        self.log_path = Path(log_path) if log_path is not None else ROOT / "build" / "peer" / f"vllm-{self.port}.log"
        self.command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                        "--served-model-name", served_model_name, "--host", LOOPBACK, "--port", str(self.port),
                        "--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                        *(extra_args or [])]
        # VLLM_HOST_IP: vLLM otherwise looks up this host's network address, which fails without a network
        self.env = {**os.environ, "VLLM_HOST_IP": LOOPBACK, "VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}",
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log_tail(self, chars: int = 3000) -> str:
        """The last chars characters of vLLM's log."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def start(self) -> "VLLMProcess":
        if self.process is not None:
            raise RuntimeError("this VLLMProcess was already started; make a new one")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until_healthy(self.url, self.process, self.startup_timeout_s, interval_s=1.0)
        except ServerExited as exc:
            raise RuntimeError(f"vLLM exited with code {exc.returncode} before it was ready; its log "
                               f"({self.log_path}) ends:\n{self.log_tail()}") from None
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"vLLM did not answer /health within {self.startup_timeout_s:g} s; its log "
                               f"({self.log_path}) ends:\n{self.log_tail()}") from None
        self.startup_s = time.perf_counter() - started
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> int | None:
        """SIGINT to its process group, then SIGTERM, then SIGKILL; returns the exit code."""
        if self.process is None:
            return None
        for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if self.process.poll() is not None:
                break
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:                                   # workers it left behind in its group
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.process.returncode

    def __enter__(self) -> "VLLMProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# --- the plan and the figures ---------------------------------------------------------------------------------

def round_order(servers: tuple[str, ...] | list[str], rounds: int) -> list[list[str]]:
    """The order the servers run in, per round: as given in even rounds, reversed in odd ones. Chapter 11."""
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"rounds must be a positive integer, got {rounds!r}")
    return [list(servers) if r % 2 == 0 else list(reversed(servers)) for r in range(rounds)]


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
        proc = VLLMProcess(folder, name, dtype, settings["max_model_len"], settings["max_num_seqs"],
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
    from ..device import cpu_capabilities, cpu_slug, dtype_bytes
    from ..timing import load_per_core
    if "vllm" in servers and vllm_python() is None:
        raise FileNotFoundError("no vLLM environment at .venv-vllm: build it first with `make peer-vllm`")
    for level in concurrency:
        if not isinstance(level, int) or level < 1:
            raise ValueError(f"every concurrency level must be a positive integer, got {level!r}")
    folder = peer_checkpoint(folder)
    from ..checkpoint import read_config
    config = read_config(folder)
    # vLLM's CPU build computes on every core but one, which it keeps for its front end (tokenizing, HTTP):
    # llminfer's engine gets as many threads, its event loop and the load generator the rest
    threads = threads or max(1, (os.cpu_count() or 1) - 1)
    cpu = cpu_capabilities()
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
    report = {"machine": {"cpu": cpu.model, "isa_level": cpu.isa_level, "logical_cpus": cpu.logical_cpus,
                          "slug": cpu_slug(cpu),
                          "load_per_core_before": load_per_core()},
              "settings": settings, "runs": [], "failures": [], "startup_s": {}, "rss_peak_bytes": {}}
    started = time.perf_counter()
    for dtype in dtypes:
        for r, order in enumerate(round_order(tuple(servers), rounds)):
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
    report["machine"]["load_per_core_after"] = load_per_core()
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


def save(report: dict, folder: str | Path) -> tuple[Path, Path]:
    """Writes serve-vs-vllm-<cpu>.json and .png into folder; returns both paths."""
    import matplotlib.pyplot as plt
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"serve-vs-vllm-{report['machine']['slug']}"
    json_path, png_path = folder / f"{stem}.json", folder / f"{stem}.png"
    json_path.write_text(json.dumps(_finite(report), indent=1))
    fig = plot_comparison(report)
    fig.savefig(png_path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return json_path, png_path


def main(args) -> int:
    """`python -m llminfer.serve.bench --compare vllm [--quick]`: runs, prints the table, writes JSON and plot."""
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
