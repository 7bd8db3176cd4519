"""The load generator: load-test any OpenAI-compatible server with the official client. Chapter 11.

    python -m llminfer.bench serve --base-url http://127.0.0.1:8000/v1 --model tiny-capitals \\
        --num-prompts 64 --request-rate 8 --goodput ttft:500 tpot:50 --out results/
    python -m llminfer.bench serve --compare vllm       # llminfer's server against vLLM's

After the manner of `vllm bench serve`: requests go out through `openai.AsyncOpenAI` (so the same tool
measures llminfer, vLLM, SGLang or anything else that speaks the API), streamed, with
`stream_options={"include_usage": true}` so the server's own token count is used. Arrivals are a
Poisson process at --request-rate (gamma-distributed gaps with --burstiness below 1; `inf` sends all at
once), optionally capped at --max-concurrency requests in flight; or a fixed concurrency alone.

Workloads: the chapter 05 workload (`llminfer.engine.workload.make_workload`: log-normal prompt and
output lengths, random token ids sent as token-id prompts), or a JSON-lines file of
{"prompt": text or token ids, "max_tokens": n} rows. With `ignore_eos` (a vLLM extension, on by
default) every request makes exactly max_tokens tokens, so runs are comparable.

What comes out, from each request's raw timestamps (all on the client's clock, seconds from the run's
start): TTFT (send to first streamed chunk), ITL (gaps between chunks), TPOT ((last - first) / (output
tokens - 1)), E2E (send to last chunk), each as mean, p50, p90, p99 (a tail percentile with too few
requests behind it is NaN: `engine.latency.percentile`); request and token throughput over the run's
duration (first send to last response); and goodput, the requests per second that met every stated target
(vLLM's --goodput, `engine.latency.request_goodput`; DistServe's goodput is the highest rate whose SLO
attainment meets a target, `engine.latency.max_rate_meeting`, over a sweep of rates). `summarize` computes all of it from the raw
records alone, so anyone can recompute the figures from the JSON.

The run is bounded: at most --num-prompts requests, none sent after --duration-limit seconds, each
one cut off after --request-timeout seconds; whatever is still running at the end is cancelled.
"""
from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..engine.latency import SLO, percentiles, request_goodput

__all__ = ["BenchRequest", "RequestRecord", "BenchResult", "workload_requests", "file_requests", "arrival_offsets",
           "run_benchmark", "benchmark", "summarize", "percentiles", "plot_result"]



@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt (text or token ids) and how many tokens to ask for."""
    prompt: str | list[int]
    max_tokens: int

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


@dataclass
class RequestRecord:
    """What happened to one request, as raw timestamps in seconds from the run's start (client clock)."""
    index: int
    send_s: float
    prompt_tokens: int = 0
    max_tokens: int = 0
    chunk_s: list[float] = field(default_factory=list)   # arrival of every streamed chunk that carried a choice
    end_s: float = float("nan")
    output_tokens: int = 0
    text: str = ""
    success: bool = False
    error: str = ""
    server_timings: dict | None = None                   # the server's own view, if it returned one

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.send_s if self.chunk_s else float("nan")

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot_s(self) -> float:
        if self.output_tokens < 2 or not self.chunk_s:
            return float("nan")
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)


@dataclass
class BenchResult:
    """A run: its settings, the per-request records and the summary computed from them."""
    settings: dict
    records: list[RequestRecord]
    summary: dict

    def to_json(self) -> dict:
        return {"settings": self.settings, "summary": self.summary,
                "requests": [asdict(r) for r in self.records]}


# --- workloads ---------------------------------------------------------------------------------------------

def workload_requests(n: int, vocab_size: int = 1024, seed: int = 0, prompt_median: float = 24,
                      prompt_sigma: float = 0.8, max_prompt: int = 64, output_median: float = 16,
                      output_sigma: float = 0.8, max_output: int = 64, first_token_id: int = 3,
                      shared_prefix: list[int] | None = None) -> list[BenchRequest]:
    """The chapter 05 workload's prompts (random token ids) and output lengths, as requests. Chapter 11.

    shared_prefix goes in front of every prompt (a system prompt, which the prefix cache serves).
    """
    from ..engine.workload import make_workload
    workload = make_workload(n_requests=n, rate=float("inf"), vocab_size=vocab_size, seed=seed,
                             prompt_median=prompt_median, prompt_sigma=prompt_sigma, max_prompt=max_prompt,
                             output_median=output_median, output_sigma=output_sigma, max_output=max_output,
                             first_token_id=first_token_id, shared_prefix=shared_prefix)
    return [BenchRequest(list(r.prompt_ids), r.max_new_tokens) for r in workload.requests]


def file_requests(path: str | Path, n: int | None = None, default_max_tokens: int = 16) -> list[BenchRequest]:
    """Requests from a JSON-lines file: {"prompt": text or token ids, "max_tokens": n} per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no dataset file at {path}; pass a JSON-lines file or --dataset workload")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number} is not JSON ({exc}); each line must be a JSON object") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
            raise ValueError(f"{path}:{number} needs a non-empty \"prompt\": a string or a list of token ids")
        max_tokens = row.get("max_tokens", row.get("output_tokens", default_max_tokens))
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path}:{number} has max_tokens={max_tokens!r}; it must be a positive integer")
        out.append(BenchRequest(prompt, max_tokens))
        if n is not None and len(out) >= n:
            break
    if not out:
        raise ValueError(f"{path} holds no requests")
    return out


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: a Poisson process at request_rate (gamma gaps if burstiness != 1)."""
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 requests per second (inf: all at once), got {request_rate!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1: Poisson, below 1: burstier), got {burstiness!r}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (burstiness * request_rate), size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


# --- the figures -------------------------------------------------------------------------------------------

def max_in_flight(records: list[RequestRecord]) -> int:
    """The most requests sent and not yet answered at any moment of a run (from the client's timestamps; a request
    that ends as another is sent is not counted with it). A server that runs at most max_num_seqs requests at once
    holds the rest of them in its queue. Chapter 11."""
    ended = [r for r in records if math.isfinite(r.end_s)]
    events = sorted([(r.send_s, 1) for r in ended] + [(r.end_s, -1) for r in ended])
    in_flight = most = 0
    for _, change in events:
        in_flight += change
        most = max(most, in_flight)
    return most


def summarize(records: list[RequestRecord], slo: dict | None = None) -> dict:
    """Throughput, latency percentiles and goodput, from the raw per-request records alone. Chapter 11.

    slo: targets in seconds, any of {"ttft", "tpot", "e2e"}; a request is good if it succeeded and met
    every one (a one-token request has no TPOT and is judged on the others).
    """
    slo = dict(slo or {})
    unknown = set(slo) - {"ttft", "tpot", "e2e"}
    if unknown:
        raise ValueError(f"unknown latency targets {sorted(unknown)}; use ttft, tpot and e2e (seconds)")
    done = [r for r in records if r.success]
    start = min((r.send_s for r in records), default=0.0)
    end = max((r.end_s for r in done), default=start)
    duration = end - start
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)

    targets = SLO(**{f"{name}_s": value for name, value in slo.items()})
    good, goodput = request_goodput(((r.ttft_s, r.tpot_s, r.e2e_s, r.output_tokens) for r in done), duration, targets)
    out = {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "duration_s": duration, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "request_throughput": len(done) / duration if duration > 0 else float("nan"),
        "output_throughput": output_tokens / duration if duration > 0 else float("nan"),
        "total_token_throughput": (prompt_tokens + output_tokens) / duration if duration > 0 else float("nan"),
        "max_in_flight": max_in_flight(records), "slo_s": slo, "good_requests": good,
        "goodput": goodput if slo else float("nan"),
    }
    for name, values in (("ttft", [r.ttft_s for r in done]), ("tpot", [r.tpot_s for r in done]),
                         ("itl", [g for r in done for g in r.itl_s]), ("e2e", [r.e2e_s for r in done])):
        for stat, value in percentiles(values).items():
            out[f"{name}_{stat}_s"] = value
    return out


def plot_result(result: BenchResult, title: str | None = None):
    """TTFT and E2E per request against its send time, and the ITL distribution: a matplotlib Figure."""
    import matplotlib.pyplot as plt
    done = [r for r in result.records if r.success]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.scatter([r.send_s for r in done], [1e3 * r.ttft_s for r in done], s=12, label="TTFT")
    left.scatter([r.send_s for r in done], [1e3 * r.e2e_s for r in done], s=12, marker="x", label="E2E")
    left.set_xlabel("request sent at (s from start)")
    left.set_ylabel("latency (ms)")
    left.set_yscale("log")
    left.legend()
    itl = [1e3 * g for r in done for g in r.itl_s]
    if itl:
        right.hist(itl, bins=40, color="tab:green")
    s = result.summary
    right.axvline(1e3 * s.get("itl_p50_s", float("nan")), color="k", linestyle="--", label="p50")
    right.axvline(1e3 * s.get("itl_p99_s", float("nan")), color="tab:red", linestyle=":", label="p99")
    right.set_xlabel("inter-token latency (ms)")
    right.set_ylabel("gaps")
    right.legend()
    fig.suptitle(title or f"{s['completed']} requests · {s['output_throughput']:.0f} output tok/s · "
                          f"goodput {s['goodput']:.2f} req/s")
    fig.tight_layout()
    return fig


# --- the run -----------------------------------------------------------------------------------------------

async def _one(client, model: str, index: int, request: BenchRequest, send_s: float, t0: float, ignore_eos: bool,
               temperature: float, timeout_s: float, return_timings: bool) -> RequestRecord:
    record = RequestRecord(index, send_s, request.prompt_len or 0, request.max_tokens)
    extra = {"ignore_eos": True} if ignore_eos else {}
    if return_timings:
        extra["return_timings"] = True
    texts = []
    try:
        stream = await client.completions.create(
            model=model, prompt=request.prompt, max_tokens=request.max_tokens, temperature=temperature,
            stream=True, stream_options={"include_usage": True}, extra_body=extra or None, timeout=timeout_s)
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.choices:
                record.chunk_s.append(now)
                texts.append(chunk.choices[0].text or "")
                timings = (chunk.choices[0].model_extra or {}).get("timings")
                if timings is not None:
                    record.server_timings = timings
            if chunk.usage is not None:
                record.output_tokens = chunk.usage.completion_tokens
                record.prompt_tokens = chunk.usage.prompt_tokens
        record.end_s = time.perf_counter() - t0
        if not record.output_tokens:
            record.output_tokens = len(record.chunk_s)
        record.success = bool(record.chunk_s)
        if not record.success:
            record.error = "the stream ended without a token"
    except asyncio.CancelledError:
        record.end_s = time.perf_counter() - t0
        record.error = "cancelled: the run's duration limit was reached"
    except Exception as exc:                     # a refusal (429, 400...) or a dropped connection
        record.end_s = time.perf_counter() - t0
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    record.text = "".join(texts)
    return record


async def benchmark(base_url: str, model: str, requests: list[BenchRequest], request_rate: float = float("inf"),
                    max_concurrency: int | None = None, burstiness: float = 1.0, seed: int = 0,
                    slo: dict | None = None, ignore_eos: bool = True, temperature: float = 0.0,
                    request_timeout_s: float = 60.0, duration_limit_s: float = 300.0, api_key: str = "none",
                    return_timings: bool = False, progress: bool = False) -> BenchResult:
    """Sends the requests (Poisson arrivals, optional concurrency cap); returns records and summary. Chapter 11."""
    import openai
    if not requests:
        raise ValueError("no requests to send; pass at least one")
    if max_concurrency is not None and (not isinstance(max_concurrency, int) or max_concurrency < 1):
        raise ValueError(f"max_concurrency must be a positive integer or None, got {max_concurrency!r}")
    for name, value in (("request_timeout_s", request_timeout_s), ("duration_limit_s", duration_limit_s)):
        if not (isinstance(value, (int, float)) and 0 < value < math.inf):
            raise ValueError(f"{name} must be a finite positive number of seconds, got {value!r}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    limit = max_concurrency or len(requests)
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=request_timeout_s,
                                http_client=None)
    semaphore = asyncio.Semaphore(limit)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(requests), desc=f"rate {request_rate:g}/s", leave=False)
    t0 = time.perf_counter()
    deadline = t0 + duration_limit_s

    async def send(index: int, request: BenchRequest, offset: float) -> RequestRecord | None:
        if t0 + offset >= deadline:
            return None                           # due after the run's time is up: never sent
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with semaphore:
            now = time.perf_counter()
            if now >= deadline:
                return None                       # never sent: the run's time is up
            record = await _one(client, model, index, request, now - t0, t0, ignore_eos, temperature,
                                request_timeout_s, return_timings)
        if bar is not None:
            bar.update(1)
        return record

    tasks = [asyncio.ensure_future(send(i, r, o)) for i, (r, o) in enumerate(zip(requests, offsets))]
    try:
        done, pending = await asyncio.wait(tasks, timeout=duration_limit_s + request_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=5.0)
    finally:
        for task in tasks:
            task.cancel()
        await client.close()
        if bar is not None:
            bar.close()
    records = [t.result() for t in tasks if t.done() and not t.cancelled() and t.result() is not None]
    settings = {"base_url": base_url, "model": model, "num_requests": len(requests),
                "request_rate": request_rate if math.isfinite(request_rate) else "inf",
                "max_concurrency": max_concurrency, "burstiness": burstiness, "seed": seed, "ignore_eos": ignore_eos,
                "temperature": temperature, "request_timeout_s": request_timeout_s,
                "duration_limit_s": duration_limit_s, "slo_s": dict(slo or {})}
    return BenchResult(settings, records, summarize(records, slo))


def run_benchmark(*args, **kwargs) -> BenchResult:
    """`benchmark` from synchronous code, also inside a running event loop (a notebook): in its own thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(benchmark(*args, **kwargs))
    box: dict = {}

    def target():
        try:
            box["result"] = asyncio.run(benchmark(*args, **kwargs))
        except BaseException as exc:
            box["error"] = exc
    thread = threading.Thread(target=target, name="llminfer-bench")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
