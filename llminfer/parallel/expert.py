"""Expert parallelism on torch.distributed: each rank holds E / world_size of every MoE layer's experts, and the
tokens travel to them. Chapter 14.

    expert_parallel(model)                      swap, in place, every MoE layer for this rank's ExpertParallelMoE
    ExpertParallelMoE(moe, rank, world_size)    an MoEFeedForward holding only its rank's experts
    all_to_all_rows(rows, send_counts)          the variable-size all-to-all: counts first, then the rows
    run_expert_parallel(moe, inputs)            an MoE layer over world_size processes, beside its bytes
    measure_expert_parallel(moe, token_counts)  the split layer's bytes and all-to-all seconds at several sizes
    run_expert_parallel_generate(model, ...)    greedy decoding of an MoE model, its sequences split over ranks
    measure_all_to_all(sizes)                   seconds per all-to-all against the bytes each rank sends
    ep_bytes_per_token(cfg)                     dispatch + combine bytes per token and MoE layer
    predict_ep_step(cfg, batch_per_rank, ...)   the α–β model's all-to-all time of a decode step (chapter 10's links)

Each rank runs attention on its own sequences (data parallel) and keeps a full copy of the router and the shared
expert; only the routed experts are split, rank r holding the contiguous block [r·E/W, (r+1)·E/W). An MoE layer
then goes:

    route     weights, ids = router(x)                     on the rank's own tokens, as one process would
    dispatch  all-to-all: each (token, expert) pair's hidden state goes to the rank that holds the expert
    experts   each rank runs its experts on what it received, one grouped product per expert
    combine   all-to-all back: each result returns to its token's rank, which adds them with the weights

The dispatch is two collectives: the counts (how many rows each rank will send each other rank) are exchanged
first with a fixed-size all-to-all, so that every rank can size its receive buffer, then the rows go in one
variable-size `all_to_all_single`. gloo implements `all_to_all_single` with split sizes on CPU tensors (checked
with torch 2.13), and NCCL on GPUs, so the same code runs on both. Production systems (DeepEP, vLLM's and
SGLang's expert-parallel kernels) fuse these steps, send FP8 in the dispatch, and send a token once per rank
rather than once per expert; the bytes here are the plain version, counted exactly.
"""
from __future__ import annotations

import copy
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

import llminfer
from llminfer import costs
from llminfer.checks import check_int
from llminfer.costs import MoEShape
from llminfer.device import synchronize
from llminfer.generate import check_request
from llminfer.moe import MoEFeedForward, experts_grouped, route

from . import cost_model
from .cost_model import Link
from .launch import DEFAULT_TIMEOUT_S, WorkerContext, launch
from .plan import check_backend, check_world_size
from .workers import _agree, _agree_max, _timed_loop, default_message_sizes

__all__ = ["expert_range", "all_to_all_rows", "A2AStats", "ExpertParallelMoE", "expert_parallel", "ep_layer_worker",
           "run_expert_parallel", "ep_sweep_worker", "measure_expert_parallel", "ep_generate_worker", "run_expert_parallel_generate", "a2a_worker",
           "measure_all_to_all", "ep_bytes_per_token", "EPStepPrediction", "predict_ep_step"]


def expert_range(n_experts: int, world_size: int, rank: int) -> tuple[int, int]:
    """The experts [start, stop) rank holds: a contiguous block of n_experts / world_size. Chapter 14."""
    if world_size < 1 or n_experts % world_size:
        raise ValueError(f"n_experts={n_experts} is not divisible by world_size={world_size}: each rank holds the "
                         f"same number of experts; use a world size that divides {n_experts}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1}")
    per_rank = n_experts // world_size
    return rank * per_rank, (rank + 1) * per_rank


def all_to_all_rows(rows: torch.Tensor, send_counts: list[int], group=None) -> tuple[torch.Tensor, list[int]]:
    """Sends rows[start_r : start_r + send_counts[r]] to rank r, for every r, and receives what each rank sends
    this one; returns (received rows in rank order, how many came from each rank). Chapter 14.

    Two collectives: a fixed-size all-to-all of the counts (one int64 per rank), then a variable-size
    all_to_all_single of the rows. The receive buffer is sized from the first before the second starts."""
    world_size = dist.get_world_size(group)
    if len(send_counts) != world_size or sum(send_counts) != rows.shape[0]:
        raise ValueError(f"send_counts {send_counts} must give one count per rank ({world_size}) summing to the "
                         f"{rows.shape[0]} rows")
    counts = torch.tensor(send_counts, dtype=torch.long, device=rows.device)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)
    recv_counts = received_counts.tolist()
    received = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(received, rows.contiguous(), output_split_sizes=recv_counts,
                           input_split_sizes=list(send_counts), group=group)
    return received, recv_counts


@dataclass
class A2AStats:
    """What this rank's all-to-alls moved while `enabled`: the hidden-state rows and their bytes sent to other
    ranks (its own share stays in memory) by phase, and the seconds of each phase's collectives. Chapter 14.

    The bytes are the rows' only: the dispatch also sends each row's expert id (8 bytes beside dim values) and
    every all-to-all of rows is preceded by one of the counts (8 bytes per rank), which are timed but not counted.

    A phase's seconds include the wait for the slowest rank to arrive (an all-to-all starts when every rank has
    entered it) and the dispatch's three collectives (counts, rows, expert ids). The clock waits for the device
    before and after each phase, so on a GPU it stalls the queue: time with it to measure, not while serving."""

    enabled: bool = True
    calls: int = 0
    bytes_by_phase: dict = field(default_factory=dict)     # phase -> bytes sent to other ranks
    rows_by_phase: dict = field(default_factory=dict)      # phase -> rows sent to other ranks
    seconds_by_phase: dict = field(default_factory=dict)   # phase -> [seconds of each call]

    @contextmanager
    def timed(self, phase: str, device: torch.device):
        """Times the block (a phase's collectives) when enabled."""
        if not self.enabled:
            yield
            return
        synchronize(device)
        start = time.perf_counter()
        yield
        synchronize(device)
        self.seconds_by_phase.setdefault(phase, []).append(time.perf_counter() - start)

    def add(self, phase: str, rows: torch.Tensor, send_counts: list[int], rank: int) -> None:
        if not self.enabled:
            return
        remote = sum(send_counts) - send_counts[rank]
        row_bytes = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        self.calls += 1
        self.rows_by_phase[phase] = self.rows_by_phase.get(phase, 0) + remote
        self.bytes_by_phase[phase] = self.bytes_by_phase.get(phase, 0) + remote * row_bytes

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_phase.values())


class ExpertParallelMoE(nn.Module):
    """An MoE feed-forward of which this rank holds only experts [start, stop); the others are reached by
    all-to-all. forward(x) is the full MoEFeedForward(x) on this rank's tokens: the same sums added in the same
    order, the experts' products differing only by float rounding (they run on other numbers of rows). Chapter 14.

    Every rank must call forward the same number of times (each call is collective), with any number of tokens,
    zero included."""

    def __init__(self, moe: MoEFeedForward, rank: int, world_size: int, group=None):
        super().__init__()
        self.start, self.stop = expert_range(moe.n_experts, world_size, rank)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.softmax_before_topk, self.normalize = moe.softmax_before_topk, moe.normalize
        self.router = moe.router                               # the full router, on every rank
        self.shared_expert, self.shared_expert_gate = moe.shared_expert, moe.shared_expert_gate
        local = slice(self.start, self.stop)
        self.w_gate = nn.Parameter(moe.w_gate.detach()[local].clone(), requires_grad=False)
        self.w_up = nn.Parameter(moe.w_up.detach()[local].clone(), requires_grad=False)
        self.w_down = nn.Parameter(moe.w_down.detach()[local].clone(), requires_grad=False)
        self.stats = A2AStats()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                       # (T, D): this rank's tokens
        weights, ids = route(self.router(x), self.top_k, softmax_before_topk=self.softmax_before_topk,
                             normalize=self.normalize)                     # (T, k) each, as one process
        per_rank = self.stop - self.start
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)                           # pairs by expert, so by owning rank
        token = order // self.top_k
        send_counts = torch.bincount(flat // per_rank, minlength=self.world_size).tolist()
        # dispatch: each pair's hidden state and its expert go to the expert's rank
        rows = x[token]                                                    # (T·k, D)
        self.stats.add("dispatch", rows, send_counts, self.rank)
        with self.stats.timed("dispatch", x.device):
            received, recv_counts = all_to_all_rows(rows, send_counts, self.group)
            expert_ids, _ = all_to_all_rows(flat[order], send_counts, self.group)
        # the local experts, each row through its one expert with weight 1 (exact: x · 1.0 = x)
        local_ids = (expert_ids - self.start).unsqueeze(1)                 # (N, 1)
        ones = torch.ones(local_ids.shape, dtype=torch.float32, device=x.device)
        outputs = experts_grouped(received, ones, local_ids, self.w_gate, self.w_up, self.w_down)
        # combine: the results go back the way they came, then the weighted sum over each token's k experts,
        # added in the order one process adds them (by expert)
        self.stats.add("combine", outputs, recv_counts, self.rank)
        with self.stats.timed("combine", x.device):
            back, _ = all_to_all_rows(outputs, recv_counts, self.group)
        back *= weights.reshape(-1)[order, None].to(back.dtype)
        y = torch.zeros_like(x).index_add_(0, token, back)
        if self.shared_expert is not None:                                 # on every rank, as MoEFeedForward
            gate = torch.sigmoid(self.shared_expert_gate(x)) if self.shared_expert_gate is not None else 1.0
            y = y + gate * self.shared_expert(x)
        return y.reshape(shape)


def expert_parallel(model: nn.Module, rank: int, world_size: int, group=None) -> list[ExpertParallelMoE]:
    """Replaces, in place, every MoEFeedForward in model by this rank's ExpertParallelMoE (its experts only);
    returns them. Chapter 14."""
    swapped = []
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MoEFeedForward):
                part = ExpertParallelMoE(child, rank, world_size, group)
                setattr(module, child_name, part)
                swapped.append(part)
    if not swapped:
        raise ValueError("the model has no MoEFeedForward layer to split; expert parallelism needs an MoE model")
    return swapped


# --- one layer over processes ---------------------------------------------------------------------------------

def _on_cpu(module: nn.Module) -> nn.Module:
    """module itself if its weights are in CPU memory, else a CPU copy (the caller's stays where it is): what
    travels to the processes, which move it to their own device."""
    if all(t.device.type == "cpu" for t in (*module.parameters(), *module.buffers())):
        return module
    return copy.deepcopy(module).cpu()


def ep_layer_worker(ctx: WorkerContext, moe: MoEFeedForward, inputs: list, repeats: int = 0) -> dict:
    """One rank of an expert-parallel MoE layer: its experts, its tokens inputs[rank], its output and bytes; with
    repeats, the median seconds of each phase's collectives over that many more calls."""
    part = ExpertParallelMoE(moe.to(ctx.device), ctx.rank, ctx.world_size)
    out, counted = _counted_then_timed(part, inputs[ctx.rank].to(ctx.device), repeats)
    return {"rank": ctx.rank, "experts": (part.start, part.stop), "output": out.cpu(), **counted,
            "expert_bytes": sum(p.numel() * p.element_size() for p in (part.w_gate, part.w_up, part.w_down))}


@torch.inference_mode()
def _counted_then_timed(part: ExpertParallelMoE, x: torch.Tensor, repeats: int) -> tuple[torch.Tensor, dict]:
    """part(x) once, counting the rows and bytes it sent (this call also sets up buffers), then repeats more calls
    timed: (the output, {"bytes", "rows", "seconds": median per phase})."""
    part.stats = A2AStats()
    out = part(x)
    counted = {"bytes": dict(part.stats.bytes_by_phase), "rows": dict(part.stats.rows_by_phase)}
    part.stats.seconds_by_phase = {}
    for _ in range(repeats):
        dist.barrier()
        part(x)
    counted["seconds"] = {phase: statistics.median(t) for phase, t in part.stats.seconds_by_phase.items()}
    return out, counted


def run_expert_parallel(moe: MoEFeedForward, inputs: list, world_size: int = 2, repeats: int = 0,
                        backend: str | None = None, port: int | None = None,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Runs moe over world_size processes, rank r holding E / world_size experts and the tokens inputs[r]
    (T_r, D); one dict per rank: its output (T_r, D), the experts it held, the rows and bytes it sent to other
    ranks in the dispatch and the combine, and (repeats > 0) the median seconds of each. Chapter 14."""
    check_world_size(world_size)
    check_int("repeats", repeats, 0)
    if not isinstance(moe, MoEFeedForward):
        raise ValueError(f"moe must be an llminfer.moe.MoEFeedForward, got {type(moe).__name__}")
    expert_range(moe.n_experts, world_size, 0)
    if len(inputs) != world_size or any(x.dim() != 2 or x.shape[1] != moe.router.in_features for x in inputs):
        raise ValueError(f"inputs must hold one (tokens, {moe.router.in_features}) tensor per rank ({world_size})")
    check_backend(backend, world_size)
    return launch(ep_layer_worker, (_on_cpu(moe), [x.cpu() for x in inputs], repeats), world_size=world_size,
                  backend=backend, port=port, timeout_s=timeout_s)


def ep_sweep_worker(ctx: WorkerContext, moe: MoEFeedForward, token_counts: list[int], repeats: int,
                    seed: int) -> list[dict]:
    """One rank of a sweep: for each token count, random tokens through the split layer, the bytes this rank sent
    and the median seconds of each phase."""
    part = ExpertParallelMoE(moe.to(ctx.device), ctx.rank, ctx.world_size)
    generator = torch.Generator().manual_seed(seed + ctx.rank)
    rows = []
    for n_tokens in token_counts:
        x = torch.randn(n_tokens, moe.router.in_features, generator=generator).to(ctx.device)
        rows.append({"tokens": n_tokens, **_counted_then_timed(part, x, repeats)[1]})
    return rows


def measure_expert_parallel(moe: MoEFeedForward, token_counts=(1, 8, 64, 512), repeats: int = 5,
                            world_size: int = 2, seed: int = 0, backend: str | None = None, port: int | None = None,
                            timeout_s: float = DEFAULT_TIMEOUT_S) -> list[list[dict]]:
    """The split layer at each token count per rank (random hidden states), in one run: per rank, per count,
    the bytes it sent in the dispatch and the combine and the median seconds of each, to set beside the α–β
    fit of `measure_all_to_all`. Chapter 14."""
    check_world_size(world_size)
    check_int("repeats", repeats, 1)
    if not isinstance(moe, MoEFeedForward):
        raise ValueError(f"moe must be an llminfer.moe.MoEFeedForward, got {type(moe).__name__}")
    expert_range(moe.n_experts, world_size, 0)
    token_counts = list(token_counts)
    if not token_counts or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 16
                               for n in token_counts):
        raise ValueError(f"token_counts must list integers in 1..65536 (tokens per rank), got {token_counts!r}")
    check_backend(backend, world_size)
    return launch(ep_sweep_worker, (_on_cpu(moe), token_counts, repeats, seed), world_size=world_size,
                  backend=backend, port=port, timeout_s=timeout_s)


# --- a decoder over processes ---------------------------------------------------------------------------------

def ep_generate_worker(ctx: WorkerContext, model, prompts: list, max_new_tokens: int) -> dict:
    """One rank of expert-parallel greedy decoding: the model's MoE layers split, its own prompts decoded."""
    model = model.to(ctx.device)
    parts = expert_parallel(model, ctx.rank, ctx.world_size)
    prompt = torch.tensor(prompts[ctx.rank], dtype=torch.long, device=ctx.device)
    result = llminfer.generate(model, prompt, max_new_tokens=max_new_tokens, return_logits=True, ignore_eos=True)
    return {"rank": ctx.rank, "token_ids": result.token_ids, "logits": torch.stack(result.logits).cpu(),
            "bytes": sum(p.stats.nbytes for p in parts), "calls": sum(p.stats.calls for p in parts)}


def run_expert_parallel_generate(model, prompts: list, max_new_tokens: int = 4, world_size: int = 2,
                                 backend: str | None = None, port: int | None = None,
                                 timeout_s: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Greedy decoding of an MoE model with its experts split over world_size ranks, rank r decoding the batch
    prompts[r] (every rank the same number of steps, so the all-to-alls pair up). A rank's batch is one (B, T)
    tensor, so its prompts share a length; ranks may differ. Every request is checked before any process
    starts. Chapter 14."""
    check_world_size(world_size)
    if len(prompts) != world_size:
        raise ValueError(f"prompts must hold one batch of prompts per rank ({world_size}), got {len(prompts)}")
    for rank, batch in enumerate(prompts):
        lengths = [len(p) for p in batch] if batch and all(isinstance(p, (list, tuple)) for p in batch) else []
        if len(set(lengths)) > 1:
            raise ValueError(f"prompts[{rank}] holds prompts of lengths {lengths}: a rank decodes its batch as one "
                             "(B, T) tensor, so they must have one length; give each rank prompts of one length "
                             "(ranks may differ)")
        check_request(model.config, batch, max_new_tokens)          # ids, vocabulary, context: as generate checks
    check_backend(backend, world_size)
    return launch(ep_generate_worker, (_on_cpu(model), prompts, max_new_tokens), world_size=world_size,
                  backend=backend, port=port, timeout_s=timeout_s)


# --- all-to-all time against bytes ----------------------------------------------------------------------------

def a2a_worker(ctx: WorkerContext, sizes: list[int], repeats: int = 5, budget_s: float = 0.05) -> dict:
    """Seconds per all_to_all_single whose send buffer holds nbytes (equal splits), at each size."""
    seconds = []
    for nbytes in sizes:
        n = max(ctx.world_size, nbytes // 4 // ctx.world_size * ctx.world_size)
        send = torch.ones(n, dtype=torch.float32, device=ctx.device)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)                                # warm-up
        probe = _timed_loop(lambda: dist.all_to_all_single(recv, send), 1, ctx.device)
        iterations = _agree(max(1, min(200, int(budget_s / max(probe, 1e-6)))), ctx)
        samples = []
        for _ in range(repeats):
            dist.barrier()
            samples.append(_timed_loop(lambda: dist.all_to_all_single(recv, send), iterations, ctx.device))
        seconds.append(_agree_max(statistics.median(samples), ctx))
    return {"sizes": list(sizes), "seconds": seconds}


def measure_all_to_all(sizes=None, repeats: int = 5, world_size: int = 2, backend: str | None = None,
                       port: int | None = None, budget_s: float = 0.05, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Seconds per all-to-all at each send-buffer size (bytes per rank), the bytes each rank sends to the others
    ((W − 1) / W of its buffer), and the α–β fit of seconds against those bytes (None, with fit_error saying
    why, when the times do not grow with the bytes, as happens on a busy machine). Chapter 14."""
    sizes = default_message_sizes(64, 16 << 20) if sizes is None else list(sizes)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of positive byte counts, got {sizes!r}")
    if max(sizes) > 1 << 30:
        raise ValueError(f"the largest message, {max(sizes)} bytes, is over 1 GiB; pass smaller sizes")
    if check_world_size(world_size) < 2:
        raise ValueError(f"an all-to-all needs at least 2 processes, got world_size={world_size}")
    check_backend(backend, world_size)
    measured = launch(a2a_worker, (sizes, repeats, budget_s), world_size=world_size, backend=backend, port=port,
                      timeout_s=timeout_s)[0]
    sent = [n * (world_size - 1) / world_size for n in measured["sizes"]]
    try:
        fit, why = cost_model.fit_alpha_beta(sent, measured["seconds"]), None
    except ValueError as error:             # a loaded machine can time a small message slower than a large one
        fit, why = None, str(error)
    return {**measured, "sent_bytes": sent, "fit": fit, "fit_error": why}


# --- the α–β projection ---------------------------------------------------------------------------------------

def ep_bytes_per_token(cfg, moe: MoEShape | None = None, world_size: int = 8, dispatch_bytes: int = 2,
                       combine_bytes: int = 2) -> dict:
    """Bytes one token sends to other ranks in one MoE layer, under uniform routing over world_size ranks.
    Chapter 14.

    The token's hidden state (dim values) goes to each of its k experts, and (W − 1) / W of them live on another
    rank: dispatch k · (W − 1) / W · dim · dispatch_bytes. The k results come back the same way (combine, in
    combine_bytes). DeepEP sends the dispatch in FP8 (dispatch_bytes=1, plus a scale per 128 values, left out
    here) and the combine in BF16 (2)."""
    moe = costs._moe_of(cfg, moe)
    remote = moe.top_k * (world_size - 1) / world_size
    dispatch = remote * cfg.dim * dispatch_bytes
    combine = remote * cfg.dim * combine_bytes
    return {"remote_copies": remote, "dispatch": dispatch, "combine": combine, "total": dispatch + combine,
            "per_step_all_layers": (dispatch + combine) * moe.moe_layers(cfg)}


@dataclass(frozen=True)
class EPStepPrediction:
    """The all-to-all time of one decode step under expert parallelism, in the α–β model. Chapter 14."""

    batch_per_rank: int
    dispatch_bytes: float       # sent by one rank to the others in one dispatch
    combine_bytes: float        # sent by one rank to the others in one combine
    dispatch_seconds: float     # one dispatch all-to-all
    combine_seconds: float      # one combine all-to-all
    step_seconds: float         # dispatch + combine in every MoE layer


def predict_ep_step(cfg, batch_per_rank: int, world_size: int, node_link: Link, cluster_link: Link | None = None,
                    gpus_per_node: int = 8, moe: MoEShape | None = None, dispatch_bytes: int = 2,
                    combine_bytes: int = 2) -> EPStepPrediction:
    """Predicted seconds of the all-to-alls of one decode step with the experts spread over world_size GPUs,
    each rank decoding batch_per_rank tokens. Chapter 14.

    Each rank sends its tokens' copies to the other ranks: to the gpus_per_node − 1 others of its server over
    node_link and to the rest over cluster_link, the two at once, so an all-to-all takes the slower link's α
    plus the longer of the two transfers (uniform routing; NVLink and the NICs work in parallel):

        t = α + max(bytes_in_node / β_node, bytes_across / β_cluster)

    A step makes one dispatch and one combine in each MoE layer, one after the other (each layer's input
    depends on the previous one's output)."""
    moe = costs._moe_of(cfg, moe)
    for name, value in (("batch_per_rank", batch_per_rank), ("world_size", world_size),
                        ("gpus_per_node", gpus_per_node)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size > gpus_per_node and cluster_link is None:
        raise ValueError(f"world_size={world_size} spans more than one node of {gpus_per_node} GPUs; pass "
                         "cluster_link (e.g. cost_model.LINKS['ib-ndr'])")
    in_node = (min(world_size, gpus_per_node) - 1) / world_size            # fraction of copies to node peers
    across = max(0, world_size - gpus_per_node) / world_size                # fraction to other servers
    copies = batch_per_rank * moe.top_k
    link = cluster_link if across else node_link

    def seconds(value_bytes: int) -> tuple[float, float]:
        row = cfg.dim * value_bytes
        node_s = copies * in_node * row / node_link.bytes_per_s
        cluster_s = copies * across * row / cluster_link.bytes_per_s if across else 0.0
        return copies * (in_node + across) * row, link.alpha_s + max(node_s, cluster_s)

    dispatch_sent, dispatch_s = seconds(dispatch_bytes)
    combine_sent, combine_s = seconds(combine_bytes)
    return EPStepPrediction(batch_per_rank, dispatch_sent, combine_sent, dispatch_s, combine_s,
                            moe.moe_layers(cfg) * (dispatch_s + combine_s))
