"""Tensor parallelism (Megatron-style) as a module transform: `tensor_parallel(model, group)`. Chapter 10.

Each rank keeps the model's one forward and swaps some of its modules for sharded ones:

    q_proj, k_proj, v_proj, gate_proj, up_proj   column-parallel: each rank computes its own heads / MLP columns
    o_proj, down_proj                            row-parallel: each rank's partial sum, then one all-reduce
    embed_tokens                                 vocabulary rows split; ids outside a rank's rows give 0; all-reduce
    lm_head                                      vocabulary rows split; the logits are all-gathered

Attention modules are told their local head counts (n_heads / world_size query heads, and the K/V heads those
read), so the unchanged `Attention.forward` runs on a rank's heads only, and the rank's KV cache holds only its
K/V heads. Two all-reduces per layer (after attention, after the MLP) carry the whole cost of the split.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .plan import TensorParallelPlan, tensor_parallel_plan

__all__ = ["CommStats", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelHead",
           "TensorParallelState", "tensor_parallel", "shard_of", "resident_bytes"]


@dataclass
class CommStats:
    """Collectives made while `recording()`: how many, the bytes each rank contributed, the seconds spent. Chapter 10.

    On the CPU (gloo) a collective returns when it is done, so a clock around the call times it. On CUDA the
    call only queues the collective: it is timed by two CUDA events around it on the stream, read once the
    recording is over (`seconds` waits for them). Synchronising the device around every collective instead
    would stall the queue of kernels twice per layer and count the stall as communication.
    """

    enabled: bool = False
    calls: int = 0
    nbytes: int = 0
    by_kind: dict = field(default_factory=dict)    # kind -> [calls, bytes, seconds]
    _seconds: float = 0.0
    _pending: list = field(default_factory=list)   # (kind, start event, end event) not yet read
    spans: list = field(default_factory=list)      # CPU: (entered, left) of each collective, perf_counter seconds

    @property
    def seconds(self) -> float:
        """Seconds spent in the collectives recorded so far (waits for the CUDA events of the pending ones)."""
        self.settle()
        return self._seconds

    def reset(self) -> None:
        self.calls, self.nbytes, self._seconds, self.by_kind, self._pending, self.spans = 0, 0, 0.0, {}, [], []

    def settle(self) -> None:
        """Reads the pending CUDA events into the totals (one wait, for the last of them)."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for kind, start, end in self._pending:
            seconds = start.elapsed_time(end) / 1e3            # elapsed_time is in milliseconds
            self._seconds += seconds
            self.by_kind[kind][2] += seconds
        self._pending = []

    @contextmanager
    def recording(self):
        """Counts and times every collective inside the block; the totals are final when it ends."""
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False
            self.settle()

    def run(self, kind: str, tensor: torch.Tensor, fn) -> None:
        """Calls fn() (a collective on tensor), timing it when recording."""
        if not self.enabled:
            fn()
            return
        nbytes = tensor.numel() * tensor.element_size()
        entry = self.by_kind.setdefault(kind, [0, 0, 0.0])
        self.calls += 1
        self.nbytes += nbytes
        entry[0] += 1
        entry[1] += nbytes
        if tensor.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            self._pending.append((kind, start, end))
            return
        start_s = time.perf_counter()
        fn()
        end_s = time.perf_counter()
        seconds = end_s - start_s
        self.spans.append((start_s, end_s))      # perf_counter is CLOCK_MONOTONIC: comparable across ranks
        self._seconds += seconds
        entry[2] += seconds


@dataclass(frozen=True)
class Shard:
    """Where a rank's tensor sits in the full one: rows (dim 0) or columns (dim 1) [start, stop)."""

    dim: int
    start: int
    stop: int


def _narrow(weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """A contiguous copy of weight's shard (a meta tensor stays meta: nothing is read)."""
    return weight.detach().narrow(shard.dim, shard.start, shard.stop - shard.start).clone(
        memory_format=torch.contiguous_format)


class _Sharded(nn.Module):
    """A module holding one shard of a full weight; `shard` says which."""

    shard: Shard

    def extra_repr(self) -> str:
        kind = "rows" if self.shard.dim == 0 else "columns"
        return f"{tuple(self.weight.shape)}, {kind} {self.shard.start}:{self.shard.stop}"


class ColumnParallelLinear(_Sharded):
    """y_local = x · W[rows]ᵀ (+ b[rows]): this rank's output features, no communication. Chapter 10."""

    def __init__(self, linear: nn.Linear, start: int, stop: int):
        super().__init__()
        self.shard = Shard(0, start, stop)
        self.weight = nn.Parameter(_narrow(linear.weight, self.shard), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(_narrow(linear.bias, self.shard),
                                                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)             # (..., stop - start)


class RowParallelLinear(_Sharded):
    """y = Σ_ranks x_local · W[:, cols]ᵀ: a partial sum per rank, completed by one all-reduce. Chapter 10."""

    def __init__(self, linear: nn.Linear, start: int, stop: int, state: "TensorParallelState"):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("a row-parallel linear with a bias would add it once per rank; llminfer's o_proj and "
                             "down_proj have none")
        self.shard = Shard(1, start, stop)
        self.weight = nn.Parameter(_narrow(linear.weight, self.shard), requires_grad=False)
        object.__setattr__(self, "state", state)               # shared, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)                     # (..., out): this rank's share of the sum
        return self.state.all_reduce(partial, "all-reduce")    # (..., out): the full sum, on every rank


class VocabParallelEmbedding(_Sharded):
    """Rows [start, stop) of the embedding table; other ids give zeros; one all-reduce sums the ranks. Chapter 10."""

    def __init__(self, embedding: nn.Embedding, start: int, stop: int, state: "TensorParallelState"):
        super().__init__()
        self.shard = Shard(0, start, stop)
        self.weight = nn.Parameter(_narrow(embedding.weight, self.shard), requires_grad=False)
        object.__setattr__(self, "state", state)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        outside = (input_ids < self.shard.start) | (input_ids >= self.shard.stop)           # (B, T)
        local_ids = (input_ids - self.shard.start).masked_fill(outside, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(outside[..., None], 0.0)     # (B, T, dim)
        return self.state.all_reduce(rows, "embedding all-reduce")                         # exactly one rank adds


class VocabParallelHead(_Sharded):
    """Logits of vocabulary rows [start, stop) on each rank, all-gathered into the full (B, T, vocab). Chapter 10."""

    def __init__(self, weight: nn.Parameter, start: int, stop: int, state: "TensorParallelState"):
        super().__init__()
        self.shard = Shard(0, start, stop)
        self.weight = weight                                   # (rows, dim): a tied head shares the embedding's
        object.__setattr__(self, "state", state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)                       # (B, T, vocab / world_size)
        return self.state.all_gather(local, "logits all-gather")   # (B, T, vocab)


class TensorParallelState:
    """What a tensor-parallel model knows about its group: rank, plan, and the communication counters. Chapter 10."""

    def __init__(self, plan: TensorParallelPlan, rank: int, group=None):
        self.plan = plan
        self.rank = rank
        self.world_size = plan.world_size
        self.group = group
        self.stats = CommStats()

    def _check_group(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"this model is rank {self.rank} of a {self.world_size}-way tensor-parallel group, but "
                               "no process group is initialised; run it inside llminfer.parallel.launch(...) or "
                               "under torchrun")

    def all_reduce(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """Sums tensor over the group in place; returns it."""
        if self.world_size == 1:
            return tensor
        self._check_group()
        self.stats.run(kind, tensor, lambda: dist.all_reduce(tensor, group=self.group))
        return tensor

    def all_gather(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        """Every rank's tensor, concatenated along the last dimension in rank order."""
        if self.world_size == 1:
            return tensor
        self._check_group()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.stats.run(kind, tensor, lambda: dist.all_gather(parts, tensor, group=self.group))
        return torch.cat(parts, dim=-1)


def _rank_and_size(group, rank, world_size) -> tuple[int, int]:
    if rank is None or world_size is None:
        if not dist.is_initialized():
            if rank is None and world_size is None:
                return 0, 1
            raise ValueError("pass both rank and world_size to shard without a process group, or neither")
        rank = dist.get_rank(group) if rank is None else rank
        world_size = dist.get_world_size(group) if world_size is None else world_size
    if not (isinstance(rank, int) and isinstance(world_size, int) and 0 <= rank < world_size):
        raise ValueError(f"rank={rank!r} must be an integer in 0..world_size-1 (world_size={world_size!r})")
    return rank, world_size


@torch.no_grad()
def tensor_parallel(model, group=None, *, rank: int | None = None, world_size: int | None = None):
    """Shards model in place for one rank of a tensor-parallel group; returns it. Chapter 10.

    rank and world_size default to this process's place in `group` (the default group when None). A model on the
    meta device is sharded without reading anything, which is how `load_tensor_parallel` reads only its shard.
    """
    if getattr(model, "parallel", None) is not None:
        raise ValueError("this model is already split (model.parallel is set); load a fresh model to split it again")
    rank, world_size = _rank_and_size(group, rank, world_size)
    config = model.config
    plan = tensor_parallel_plan(config, world_size)
    state = TensorParallelState(plan, rank, group)
    head_dim = config.head_dim
    q0, q1 = plan.head_range(rank)
    kv0, kv1 = plan.kv_head_range(rank)
    m0, m1 = plan.mlp_range(rank)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(attn.q_proj, q0 * head_dim, q1 * head_dim)       # (dim -> H_loc·D)
        attn.k_proj = ColumnParallelLinear(attn.k_proj, kv0 * head_dim, kv1 * head_dim)     # (dim -> H_kv_loc·D)
        attn.v_proj = ColumnParallelLinear(attn.v_proj, kv0 * head_dim, kv1 * head_dim)
        attn.o_proj = RowParallelLinear(attn.o_proj, q0 * head_dim, q1 * head_dim, state)   # (H_loc·D -> dim)
        attn.n_heads, attn.n_kv_heads = plan.local_heads, plan.local_kv_heads              # what forward reads
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, m0, m1)                         # (dim -> hidden_loc)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, m0, m1)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, m0, m1, state)                     # (hidden_loc -> dim)
    v0, v1 = plan.vocab_range(rank)
    tied = config.tie_embeddings
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens, v0, v1, state)
    head_weight = model.embed_tokens.weight if tied else nn.Parameter(
        _narrow(model.lm_head.weight, Shard(0, v0, v1)), requires_grad=False)
    model.lm_head = VocabParallelHead(head_weight, v0, v1, state)
    model.parallel = state               # model.new_cache() sizes its cache from the local heads set above
    return model


def shard_of(model, param_name: str) -> Shard | None:
    """The shard that parameter `param_name` of a split model holds, or None if it holds the whole tensor."""
    module_name, _, _attr = param_name.rpartition(".")
    module = model.get_submodule(module_name)
    return getattr(module, "shard", None)


def resident_bytes(model) -> int:
    """Bytes of the parameters this process holds (a tied table counted once). Chapter 10."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
