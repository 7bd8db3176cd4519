"""The work each process of chapter 10's runs does, in an importable module, and the calls that launch it. Chapter 10.

    run_tensor_parallel(model, prompt_ids, ...)    TP over world_size processes: tokens, logits, memory, timings
    run_pipeline_parallel(model, prompt_ids, ...)  PP over n_stages processes: tokens, logits, the stage timeline
    measure_communication(sizes, ...)              all-reduce and send/recv times against message size

Each checks its request (split, stages, micro-batches, backend, port) before any process starts, then calls
`launch` with one of the `*_worker` functions below. The same workers run under torchrun through
`python -m llminfer.parallel` (see __main__.py).
"""
from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import llminfer
from llminfer.device import synchronize
from llminfer.generate import as_token_batch

from .launch import DEFAULT_TIMEOUT_S, WorkerContext, launch
from .loading import load_pipeline_stage, load_tensor_parallel, read_config
from .pipeline import PipelineState, bubble_fraction, pipeline_generate
from .plan import check_backend, check_world_size, pipeline_plan, split_micro_batches, tensor_parallel_plan
from .tensor import resident_bytes

__all__ = ["RunSpec", "tp_worker", "pp_worker", "comm_worker", "run_tensor_parallel", "run_pipeline_parallel",
           "measure_communication", "default_message_sizes", "time_decode_steps", "time_prefill", "stage_timeline"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunSpec:
    """What every rank of a TP or PP run does: plain data, so it travels to spawned processes. Chapter 10."""

    model: str                                   # a bundled model's name or a model folder
    prompt_ids: list                             # (B, T) token ids
    max_new_tokens: int = 8
    dtype: str = "float32"
    return_logits: bool = True
    timing_repeats: int = 0                      # > 0: also time prefill and decode steps (TP), or record (PP)
    micro_batches: tuple = (1,)                  # PP: one run per micro-batch count
    baseline: bool = True                        # TP timing: rank 0 also times the unsplit model alone
    extra: dict = field(default_factory=dict)


# --- timing helpers -------------------------------------------------------------------------------------------

def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@torch.inference_mode()
def time_decode_steps(model, prompt: torch.Tensor, repeats: int, warmup: int = 3) -> dict:
    """Median seconds of one decode step after a prefill of prompt, with the communication inside it when the
    model is tensor-parallel. Chapter 10."""
    batch, prompt_len = prompt.shape
    steps = warmup + repeats
    cache = model.new_cache(batch, max_seq_len=prompt_len + steps)
    logits = llminfer.prefill(model, prompt, cache)
    token = logits.argmax(-1)                                   # (B,)
    stats = getattr(getattr(model, "parallel", None), "stats", None)
    totals, comms, calls, spans = [], [], [], []
    for i in range(steps):
        if stats is not None:
            stats.reset()
            stats.enabled = True
        synchronize(model.device)
        start = time.perf_counter()
        logits = llminfer.decode_step(model, token, cache, check_ids=False)
        synchronize(model.device)
        seconds = time.perf_counter() - start
        if stats is not None:
            stats.enabled = False
        token = logits.argmax(-1)
        if i >= warmup:
            totals.append(seconds)
            comms.append(stats.seconds if stats is not None else 0.0)
            calls.append(stats.calls if stats is not None else 0)
            spans.append(list(stats.spans) if stats is not None else [])
    return {"step_s": _median(totals), "comm_s": _median(comms), "compute_s": _median(
        [t - c for t, c in zip(totals, comms)]), "collectives": calls[-1] if calls else 0, "samples_s": totals,
        "spans": spans}


@torch.inference_mode()
def time_prefill(model, prompt: torch.Tensor, repeats: int, warmup: int = 2) -> dict:
    """Median seconds of a prefill of prompt (a fresh cache each time), with its communication. Chapter 10."""
    batch, prompt_len = prompt.shape
    stats = getattr(getattr(model, "parallel", None), "stats", None)
    totals, comms = [], []
    cache = model.new_cache(batch, max_seq_len=prompt_len)
    for i in range(warmup + repeats):
        cache.reset()
        if stats is not None:
            stats.reset()
            stats.enabled = True
        start = time.perf_counter()
        llminfer.prefill(model, prompt, cache)
        synchronize(model.device)
        seconds = time.perf_counter() - start
        if stats is not None:
            stats.enabled = False
        if i >= warmup:
            totals.append(seconds)
            comms.append(stats.seconds if stats is not None else 0.0)
    return {"step_s": _median(totals), "comm_s": _median(comms),
            "compute_s": _median([t - c for t, c in zip(totals, comms)])}


def collective_waits(rank_spans: list[list[list[tuple[float, float]]]]) -> list[dict]:
    """Each rank's collective time split into waiting and moving data, median over steps. Chapter 10.

    rank_spans[rank][step] lists the (entered, left) times of that step's collectives on that rank (perf_counter,
    which is CLOCK_MONOTONIC and so shared by the processes of one machine). A collective cannot start before
    the last rank enters it: the time a rank spends in it before then is waiting for the other ranks (skew:
    Python, scheduling, a descheduled core), and only the rest is what an α–β model describes."""
    if len({len(steps) for steps in rank_spans}) != 1:
        raise ValueError("every rank must report the same number of steps")
    out = []
    for rank, steps in enumerate(rank_spans):
        waits, moves = [], []
        for step, spans in enumerate(steps):
            peers = [rank_spans[r][step] for r in range(len(rank_spans))]
            if len({len(p) for p in peers}) != 1:
                raise ValueError(f"step {step}: the ranks made different numbers of collectives")
            wait = move = 0.0
            for i, (entered, left) in enumerate(spans):
                last_entry = max(p[i][0] for p in peers)
                wait += max(0.0, min(last_entry, left) - entered)
                move += max(0.0, left - max(last_entry, entered))
            waits.append(wait)
            moves.append(move)
        out.append({"rank": rank, "wait_s": _median(waits), "transfer_s": _median(moves)})
    return out


# --- tensor parallel ------------------------------------------------------------------------------------------

def tp_worker(ctx: WorkerContext, spec: RunSpec) -> dict:
    """One rank of a tensor-parallel run: shard-on-read, greedy generation, memory, and optional timings."""
    dtype = _DTYPES[spec.dtype]
    prompt = torch.tensor(spec.prompt_ids, dtype=torch.long, device=ctx.device)
    out: dict = {"rank": ctx.rank}
    if spec.timing_repeats and spec.baseline:
        out["baseline"] = _baseline_timings(ctx, spec, prompt, dtype)
    model, out["load_peak_bytes"] = _peak_memory_during(
        lambda: load_tensor_parallel(spec.model, device=ctx.device, dtype=dtype), ctx.device)
    state = model.parallel
    result = llminfer.generate(model, prompt, max_new_tokens=spec.max_new_tokens, return_logits=spec.return_logits,
                               ignore_eos=True)         # every step, as pipeline_generate (which never stops at EOS)
    out.update(
        token_ids=result.token_ids,
        logits=torch.stack(result.logits) if spec.return_logits else None,     # (N, B, vocab)
        resident_bytes=resident_bytes(model),
        bytes_read=model.parallel_load.bytes_read,
        checkpoint_bytes=model.parallel_load.checkpoint_bytes,
        local_heads=state.plan.local_heads,
        local_kv_heads=state.plan.local_kv_heads,
        kv_head_range=state.plan.kv_head_range(ctx.rank),
        cache_bytes=model.new_cache(1, max_seq_len=model.config.max_seq_len).nbytes,
    )
    if spec.timing_repeats:
        with pinned_to_core(ctx.rank):         # each rank on a core of its own, as measure_communication's ranks
            dist.barrier()
            out["prefill"] = time_prefill(model, prompt, spec.timing_repeats)
            dist.barrier()
            out["decode"] = time_decode_steps(model, prompt, spec.timing_repeats)
        cache = _filled_cache(model, prompt)
        state.stats.reset()
        with state.stats.recording():                             # one decode step's collectives, counted
            llminfer.decode_step(model, torch.zeros(prompt.shape[0], dtype=torch.long, device=ctx.device), cache,
                                 check_ids=False)
        out["decode_collectives"] = {kind: tuple(v) for kind, v in state.stats.by_kind.items()}
    return out


def _rss_kib(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _peak_memory_during(fn, device):
    """(fn(), how far memory on device rose above its start at the peak of fn) in bytes. On the CPU that is this
    process's resident memory, known on Linux only (through /proc/self/clear_refs); None where it is unknown."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        return result, torch.cuda.max_memory_allocated(device) - before
    before = _rss_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")                       # resets the peak (VmHWM) to the current resident size
    except OSError:
        before = None
    result = fn()
    peak = _rss_kib("VmHWM")
    return result, None if before is None or peak is None else (peak - before) * 1024


@torch.inference_mode()
def _filled_cache(model, prompt):
    cache = model.new_cache(prompt.shape[0], max_seq_len=prompt.shape[1] + 1)
    llminfer.prefill(model, prompt, cache)
    return cache


def _baseline_timings(ctx: WorkerContext, spec: RunSpec, prompt, dtype) -> dict | None:
    """Rank 0 times the unsplit model while the other ranks wait: one thread, then every thread of the run."""
    timings = None
    if ctx.rank == 0:
        model, _ = llminfer.load_pretrained(spec.model, device=ctx.device, dtype=dtype, load_tokenizer=False)
        threads = torch.get_num_threads()
        timings = {"threads": threads,
                   "prefill": time_prefill(model, prompt, spec.timing_repeats),
                   "decode": time_decode_steps(model, prompt, spec.timing_repeats)}
        if ctx.device.type == "cpu":
            torch.set_num_threads(threads * ctx.world_size)      # the cores the whole run uses
            timings["decode_all_threads"] = time_decode_steps(model, prompt, spec.timing_repeats)
            timings["prefill_all_threads"] = time_prefill(model, prompt, spec.timing_repeats)
            timings["all_threads"] = torch.get_num_threads()
            torch.set_num_threads(threads)
        del model
    dist.barrier()
    return timings


def _check_prompt(prompt_ids, config, max_new_tokens: int) -> list:
    ids = as_token_batch(prompt_ids)
    batch, prompt_len = ids.shape
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > config.max_seq_len:
        raise ValueError(f"a prompt of {prompt_len} tokens + {max_new_tokens} new tokens exceeds the model's "
                         f"max_seq_len={config.max_seq_len}; shorten the prompt or generate fewer tokens")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= config.vocab_size:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary of {config.vocab_size} ids")
    return ids.tolist()


def run_tensor_parallel(model: str = "tiny-capitals", prompt_ids=None, max_new_tokens: int = 8, world_size: int = 2,
                        dtype: str = "float32", timing_repeats: int = 0, backend: str | None = None,
                        port: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = 1,
                        return_logits: bool = True) -> list[dict]:
    """Greedy generation with the model split over world_size processes; one dict per rank. Chapter 10.

    Refuses, before starting anything, a split the model's heads, K/V heads or widths do not allow, a prompt
    that does not fit, a backend this machine lacks and a port in use.
    """
    config = read_config(model)
    tensor_parallel_plan(config, check_world_size(world_size))
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    prompt = _check_prompt([[1]] if prompt_ids is None else prompt_ids, config, max_new_tokens)
    check_backend(backend, world_size)
    spec = RunSpec(str(model), prompt, max_new_tokens, dtype, return_logits, timing_repeats)
    return launch(tp_worker, (spec,), world_size=world_size, backend=backend, port=port, timeout_s=timeout_s,
                  threads=threads)


# --- pipeline parallel ----------------------------------------------------------------------------------------

def pp_worker(ctx: WorkerContext, spec: RunSpec) -> dict:
    """One stage of a pipeline run: its layers read from disk, a generation per micro-batch count."""
    dtype = _DTYPES[spec.dtype]
    model = load_pipeline_stage(spec.model, ctx.rank, ctx.world_size, device=ctx.device, dtype=dtype)
    state: PipelineState = model.parallel
    prompt = torch.tensor(spec.prompt_ids, dtype=torch.long)
    layers = state.plan.layer_range(ctx.rank)
    out = {"rank": ctx.rank, "layers": layers, "resident_bytes": resident_bytes(model),
           "bytes_read": model.parallel_load.bytes_read, "checkpoint_bytes": model.parallel_load.checkpoint_bytes,
           "runs": {}}
    record = spec.timing_repeats > 0
    if record:                                                    # first calls allocate: one untimed pass
        pipeline_generate(model, prompt, 2, spec.micro_batches[0])
    for n_micro in spec.micro_batches:
        dist.barrier()
        result = pipeline_generate(model, prompt, spec.max_new_tokens, n_micro, record=record,
                                   return_logits=spec.return_logits and state.is_last)
        rows = result.token_ids if len(prompt) > 1 else [result.token_ids]
        out["runs"][n_micro] = {"token_ids": rows, "events": result.events, "sent_bytes": state.sent_bytes,
                                "logits": torch.stack(result.logits) if result.logits else None}   # (N, B, vocab)
        state.sent_bytes = 0
    return out


def run_pipeline_parallel(model: str = "tiny-capitals", prompt_ids=None, max_new_tokens: int = 8, n_stages: int = 2,
                          micro_batches=(1,), dtype: str = "float32", record: bool = True,
                          backend: str | None = None, port: int | None = None,
                          timeout_s: float = DEFAULT_TIMEOUT_S, threads: int | None = 1) -> list[dict]:
    """Greedy generation through an n_stages pipeline, once per micro-batch count; one dict per stage. Chapter 10."""
    config = read_config(model)
    pipeline_plan(config, n_stages)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    prompt = _check_prompt([[1]] if prompt_ids is None else prompt_ids, config, max_new_tokens)
    micro_batches = tuple(micro_batches)
    if not micro_batches:
        raise ValueError("micro_batches must list at least one micro-batch count, e.g. (1, 4)")
    for count in micro_batches:
        split_micro_batches(len(prompt), count)
    check_backend(backend, n_stages)
    spec = RunSpec(str(model), prompt, max_new_tokens, dtype, True, 1 if record else 0, micro_batches)
    return launch(pp_worker, (spec,), world_size=n_stages, backend=backend, port=port, timeout_s=timeout_s,
                  threads=threads)


def stage_timeline(stage_results: list[dict], n_micro: int, step: int = 0) -> dict:
    """The events of one step of every stage of a PP run, times from the first start, and its bubble. Chapter 10."""
    events = [e for result in stage_results for e in result["runs"][n_micro]["events"] if e.step == step]
    if not events:
        raise ValueError(f"no events for step {step} with {n_micro} micro-batches; run with record=True")
    origin = min(e.start_s for e in events)
    rows = [(e.stage, e.micro_batch, e.start_s - origin, e.end_s - origin) for e in events]
    return {"events": sorted(rows), "bubble": bubble_fraction(events, len(stage_results)),
            "span_s": max(e.end_s for e in events) - origin}


# --- communication ----------------------------------------------------------------------------------------------

def default_message_sizes(smallest: int = 4, largest: int = 64 << 20, factor: int = 4) -> list[int]:
    """4 B, 16 B, ... up to 64 MiB: message sizes in bytes, multiplying by factor. Chapter 10."""
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= factor
    return sizes


def _timed_loop(fn, iterations: int, device) -> float:
    """Seconds per call of fn, over iterations back-to-back calls (the device's queue drained at both ends)."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / iterations


@contextmanager
def pinned_to_core(rank: int):
    """Runs the block with this process on one CPU core of its own, rank r on the r-th core it may use (Linux).

    On a machine with as many cores as ranks, the scheduler otherwise moves a rank between cores, or puts both
    on one core for a moment while the other core serves something else; every such moment stalls a collective,
    which waits for its slowest rank. Where affinity cannot be set the block runs unpinned. Chapter 10."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not allowed:
        yield None
        return
    core = allowed[rank % len(allowed)]
    os.sched_setaffinity(0, {core})
    try:
        yield core
    finally:
        os.sched_setaffinity(0, allowed)


def _per_call_seconds(fn, ctx: WorkerContext, calls: int, budget_s: float, warmup: int) -> float:
    """The median seconds of one call of fn, over back-to-back calls lasting about budget_s (at least calls).

    warmup untimed calls first: the first calls set up buffers and connections. Then each call is timed on its
    own: a collective makes the ranks wait for each other, so after the first one they enter every call together,
    and the median keeps the calls a stray process or a scheduler tick stalled from moving the result (the mean
    of a block of calls would carry every stall in it). The ranks agree on the number of calls (the smallest)
    and report the slower rank's median."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    probe = statistics.median(_timed_loop(fn, 1, ctx.device) for _ in range(3))
    count = _agree(max(calls, min(20 * calls, int(budget_s / max(probe, 1e-7)))), ctx)
    samples = [_timed_loop(fn, 1, ctx.device) for _ in range(count)]
    return _agree_max(statistics.median(samples), ctx)


def comm_worker(ctx: WorkerContext, sizes: list[int], repeats: int = 15, budget_s: float = 0.05,
                warmup: int = 5, pin: bool = True, rounds: int = 3) -> dict:
    """All-reduce (every rank) and send/recv (ranks 0 and 1, ping-pong) seconds per call at each size.

    Each size's time is the median of at least repeats single calls (more, up to budget_s, where calls are
    short), after warmup calls, each rank on a core of its own (pin). The sweep over the sizes runs rounds
    times and each size keeps its fastest round: a burst of work from another program that lasts through one
    size's calls slows that size in one round, not in all of them."""
    allreduce, sendrecv = [[] for _ in sizes], [[] for _ in sizes]
    with pinned_to_core(ctx.rank) if pin else nullcontext():
        for _ in range(rounds):
            for i, nbytes in enumerate(sizes):
                x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=ctx.device)
                allreduce[i].append(_per_call_seconds(lambda: dist.all_reduce(x), ctx, repeats, budget_s, warmup))
                sendrecv[i].append(_per_call_seconds(lambda: _ping_pong(x, ctx.rank), ctx, repeats, budget_s,
                                                     warmup) / 2)
    return {"sizes": list(sizes), "allreduce_s": [min(t) for t in allreduce], "sendrecv_s": [min(t) for t in sendrecv],
            "rounds": {"allreduce_s": allreduce, "sendrecv_s": sendrecv}}


def _ping_pong(x: torch.Tensor, rank: int) -> None:
    if rank == 0:
        dist.send(x, dst=1)
        dist.recv(x, src=1)
    elif rank == 1:
        dist.recv(x, src=0)
        dist.send(x, dst=0)


def _agree(value: int, ctx: WorkerContext) -> int:
    """The smallest of every rank's value, so that all ranks loop the same number of times."""
    t = torch.tensor([value], dtype=torch.long, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def _agree_max(value: float, ctx: WorkerContext) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def measure_communication(sizes=None, repeats: int = 15, world_size: int = 2, backend: str | None = None,
                          port: int | None = None, budget_s: float = 0.05, warmup: int = 5, pin: bool = True,
                          rounds: int = 3, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Seconds per all-reduce and per one-way send at each message size, over world_size processes. Chapter 10.

    Each size: warmup untimed calls, then the median of single calls back to back, at least repeats of them and
    more (up to 20 × repeats) while they fit in budget_s; pin puts each rank on a core of its own for the
    measurement (see pinned_to_core). The sweep runs rounds times; each size keeps its fastest round (every round
    is in "rounds")."""
    sizes = default_message_sizes() if sizes is None else list(sizes)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of positive byte counts, got {sizes!r}")
    if check_world_size(world_size) < 2:
        raise ValueError(f"measuring communication needs at least 2 processes, got world_size={world_size}")
    if max(sizes) > 1 << 30:
        raise ValueError(f"the largest message, {max(sizes)} bytes, is over 1 GiB; pass smaller sizes")
    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 0), ("rounds", rounds, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer of at least {low}, got {value!r}")
    check_backend(backend, world_size)
    return launch(comm_worker, (sizes, repeats, budget_s, warmup, pin, rounds), world_size=world_size, backend=backend,
                  port=port, timeout_s=timeout_s)[0]
