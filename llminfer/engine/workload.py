"""Request streams for measuring an engine, and the serving metrics of a run. Chapter 05.

    workload = make_workload(n_requests=48, rate=40.0, vocab_size=cfg.vocab_size, seed=0)
    result = replay(engine, workload)             # real time: requests join when their arrival comes
    summary = summarize(result, slo_ttft_s=1.0, slo_tpot_s=0.05)

Arrivals are a Poisson process (exponential gaps) by default, as in the vLLM paper's experiments and
vLLM's benchmark; `burstiness` < 1 draws gamma-distributed gaps instead, burstier at the same mean
rate, as BurstGPT found real traffic to be. Prompt and output lengths are log-normal: most requests
short, a long tail of long ones, which is the shape request and response lengths take in published
chat traces (ShareGPT, BurstGPT). Everything comes from one seed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from .latency import SLO, percentile, request_goodput
from .sampling_params import SamplingParams

__all__ = ["Request", "Workload", "WorkloadResult", "make_workload", "replay", "summarize", "percentile"]


@dataclass(frozen=True)
class Request:
    """One request of a workload: its prompt, how many tokens it wants, when it arrives (s after the start)."""
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and the settings that made them. Chapter 05."""
    requests: tuple[Request, ...]
    settings: dict = field(default_factory=dict)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(r.prompt_ids) for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.max_new_tokens for r in self.requests]

    @property
    def arrivals_s(self) -> list[float]:
        return [r.arrival_s for r in self.requests]

    def __len__(self) -> int:
        return len(self.requests)


def _lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    values = np.exp(rng.normal(math.log(median), sigma, size=n))
    return [int(v) for v in np.clip(np.round(values), lo, hi)]


def make_workload(n_requests: int = 48, rate: float = 40.0, vocab_size: int = 1024, seed: int = 0,
                  prompt_median: float = 48, prompt_sigma: float = 0.8, max_prompt: int = 256,
                  output_median: float = 24, output_sigma: float = 0.8, max_output: int = 128,
                  burstiness: float = 1.0, shared_prefix: list[int] | None = None,
                  first_token_id: int = 3) -> Workload:
    """A reproducible request stream: Poisson (or gamma) arrivals, log-normal prompt and output lengths. Chapter 05.

    rate: mean requests per second (float('inf'): all arrive at once). Prompt tokens are drawn
    uniformly from first_token_id .. vocab_size - 1 (ids below it are usually special tokens);
    `shared_prefix` is put in front of every prompt (a system prompt, chapter 06).
    """
    if not isinstance(n_requests, int) or n_requests < 1:
        raise ValueError(f"n_requests must be a positive integer, got {n_requests!r}")
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests per second (inf: all at once), got {rate!r}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1 is Poisson, below 1 burstier), got {burstiness!r}")
    if not 0 <= first_token_id < vocab_size:
        raise ValueError(f"first_token_id={first_token_id} must lie in 0..{vocab_size - 1}")
    for name, median, hi in (("prompt", prompt_median, max_prompt), ("output", output_median, max_output)):
        if not 1 <= median <= hi:
            raise ValueError(f"{name}_median={median} must lie in 1..max_{name}={hi}")
    rng = np.random.default_rng(seed)
    if math.isinf(rate):
        arrivals = [0.0] * n_requests
    else:
        # gamma gaps with shape k and scale 1 / (k · rate) have mean 1 / rate; k = 1 is the exponential
        gaps = rng.gamma(burstiness, 1.0 / (burstiness * rate), size=n_requests)
        gaps[0] = 0.0                                                   # the first request opens the run
        arrivals = [float(t) for t in np.cumsum(gaps)]
    prompt_lens = _lognormal_lengths(rng, n_requests, prompt_median, prompt_sigma, 1, max_prompt)
    output_lens = _lognormal_lengths(rng, n_requests, output_median, output_sigma, 1, max_output)
    prefix = tuple(shared_prefix or ())
    requests = tuple(
        Request(prefix + tuple(int(t) for t in rng.integers(first_token_id, vocab_size, size=p)), o, a)
        for p, o, a in zip(prompt_lens, output_lens, arrivals))
    settings = dict(n_requests=n_requests, rate=rate, seed=seed, prompt_median=prompt_median,
                    prompt_sigma=prompt_sigma, max_prompt=max_prompt, output_median=output_median,
                    output_sigma=output_sigma, max_output=max_output, burstiness=burstiness,
                    shared_prefix_len=len(prefix))
    return Workload(requests, settings)


@dataclass
class WorkloadResult:
    """What a replay produced: outputs in workload order, the run's span, the engine's trace. Chapter 05."""
    outputs: list                       # RequestOutput per request, in workload order
    start_s: float                      # the engine clock when the run began (arrival times count from here)
    duration_s: float                   # start to the last token
    trace: list = field(default_factory=list)   # StepRecord per step
    arrivals_s: list[float] = field(default_factory=list)
    stats: object = None
    policy: str = ""

    @property
    def output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        return len(self.outputs) / self.duration_s if self.duration_s > 0 else 0.0


def replay(engine, workload: Workload, params: SamplingParams | None = None, realtime: bool = True,
           progress: bool = False) -> WorkloadResult:
    """Runs the workload on the engine: each request joins at its arrival time; returns the outputs. Chapter 05.

    realtime=True waits (sleeps) when the engine is idle and the next request has not arrived yet;
    realtime=False lets every request arrive at once (offline throughput).
    `params` gives the other sampling settings (max_new_tokens comes from each request).
    """
    base = params or SamplingParams()
    pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s)
    ids: dict[int, int] = {}
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(pending), desc=f"{engine.policy}", leave=False)
    trace_start = len(engine.trace)
    start = engine.clock()
    cursor = 0
    while cursor < len(pending) or engine.has_unfinished():
        now = engine.clock()
        while cursor < len(pending):
            request = workload.requests[pending[cursor]]
            arrival = start + (request.arrival_s if realtime else 0.0)
            if arrival > now:
                break
            p = SamplingParams(max_new_tokens=request.max_new_tokens, temperature=base.temperature, top_k=base.top_k,
                               top_p=base.top_p, eos_token_id=base.eos_token_id, seed=base.seed)
            ids[pending[cursor]] = engine.add_request(list(request.prompt_ids), p, arrival_time=arrival)
            cursor += 1
        if engine.has_unfinished():
            for event in engine.step():
                if event.finished and bar is not None:
                    bar.update(1)
        elif cursor < len(pending):
            time.sleep(max(0.0, start + workload.requests[pending[cursor]].arrival_s - engine.clock()))
    if bar is not None:
        bar.close()
    outputs = [engine.pop_output(ids[i]) for i in range(len(workload.requests))]
    last = max(start + o.e2e_s + (workload.requests[i].arrival_s if realtime else 0.0)
               for i, o in enumerate(outputs))
    trace = list(engine.trace)[trace_start:]
    return WorkloadResult(outputs, start, last - start, trace,
                          [r.arrival_s if realtime else 0.0 for r in workload.requests], engine.stats, engine.policy)


def summarize(result: WorkloadResult, slo_ttft_s: float = 1.0, slo_tpot_s: float = 0.1) -> dict:
    """Throughput, TTFT / TPOT / ITL / E2E medians and p90/p99, and goodput under the stated targets. Chapter 05.

    Goodput here is vLLM's (`--goodput`): requests per second that met both the TTFT and the TPOT target
    (`latency.request_goodput`). A one-token request has no TPOT and is judged by TTFT alone. A tail percentile
    without enough requests behind it is nan (`latency.percentile`).
    """
    outputs = result.outputs
    ttft = [o.ttft_s for o in outputs]
    tpot = [o.tpot_s for o in outputs if len(o.token_ids) > 1]
    itl = [gap for o in outputs for gap in o.itl_s]
    e2e = [o.e2e_s for o in outputs]
    slo = SLO(ttft_s=slo_ttft_s, tpot_s=slo_tpot_s)
    good, goodput = request_goodput(((o.ttft_s, o.tpot_s, o.e2e_s, len(o.token_ids)) for o in outputs),
                                    result.duration_s, slo)
    summary = {"policy": result.policy, "requests": len(outputs), "output_tokens": result.output_tokens,
               "duration_s": result.duration_s, "throughput_tok_s": result.throughput,
               "request_throughput": result.request_throughput,
               "goodput_req_s": goodput if result.duration_s > 0 else 0.0,
               "slo_attained": good / len(outputs), "slo_ttft_s": slo_ttft_s, "slo_tpot_s": slo_tpot_s,
               "preemptions": sum(o.preemptions for o in outputs), "steps": len(result.trace)}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_s"] = percentile(values, q)
    return summary
