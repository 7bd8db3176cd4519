"""What a parallel run will do, checked before any process starts. Chapter 10.

    tensor_parallel_plan(config, world_size)      -> TensorParallelPlan: which heads, KV heads, MLP columns
                                                    and vocabulary rows each rank holds
    pipeline_plan(config, n_stages)               -> PipelinePlan: which layers each stage holds
    split_micro_batches(batch_size, n_micro)      -> the sizes of the micro-batches
    check_backend(backend, world_size)            -> the backend name, or ValueError (NCCL without GPUs)
    check_port(port)                              -> a socket bound to 127.0.0.1:port, or ValueError if taken

Every check raises ValueError naming the value, the limit and the fix, so a bad request is refused in the
notebook or on the command line, before a single process is spawned.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["TensorParallelPlan", "PipelinePlan", "tensor_parallel_plan", "pipeline_plan", "split_micro_batches",
           "check_world_size", "check_backend", "default_backend", "check_port", "loopback_interface"]

LOOPBACK = "127.0.0.1"


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_world_size(world_size) -> int:
    """Returns world_size if it is a positive integer; ValueError otherwise. Chapter 10."""
    if not _is_count(world_size):
        raise ValueError(f"world_size must be a positive integer (the number of processes), got {world_size!r}")
    return world_size


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which slice of every split dimension one rank of a tensor-parallel group holds. Chapter 10.

    Query heads, MLP columns and vocabulary rows are cut into world_size equal contiguous pieces. K/V heads are
    cut the same way when world_size divides n_kv_heads; when n_kv_heads divides world_size instead (more ranks
    than K/V heads, as for Llama 3 70B on 16 GPUs), each K/V head is copied to world_size // n_kv_heads ranks, so
    that every rank holds exactly the K/V head its query heads read.
    """

    world_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int

    @property
    def local_heads(self) -> int:
        return self.n_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.n_kv_heads // self.world_size)

    @property
    def kv_replicas(self) -> int:
        """How many ranks hold a copy of each K/V head (1: split, no copies)."""
        return max(1, self.world_size // self.n_kv_heads)

    def head_range(self, rank: int) -> tuple[int, int]:
        """Query heads [start, stop) of rank."""
        return rank * self.local_heads, (rank + 1) * self.local_heads

    def kv_head_range(self, rank: int) -> tuple[int, int]:
        """K/V heads [start, stop) of rank: a piece of them, or the one K/V head its query heads share."""
        first = rank // self.kv_replicas * self.local_kv_heads
        return first, first + self.local_kv_heads

    def mlp_range(self, rank: int) -> tuple[int, int]:
        """MLP columns [start, stop) of rank (rows of gate/up, columns of down)."""
        width = self.hidden_dim // self.world_size
        return rank * width, (rank + 1) * width

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """Vocabulary rows [start, stop) of rank (of the embedding table and the output head)."""
        rows = self.vocab_size // self.world_size
        return rank * rows, (rank + 1) * rows


def tensor_parallel_plan(config, world_size: int) -> TensorParallelPlan:
    """The split of config over world_size ranks; ValueError if a dimension does not divide. Chapter 10."""
    check_world_size(world_size)
    if getattr(config, "is_moe", False):
        raise ValueError(f"tensor parallelism splits each layer's dense MLP by columns, and this {config.model_type} "
                         f"model's feed-forward is a mixture of {config.n_experts} experts; split its experts "
                         "across ranks with expert parallelism (llminfer.parallel.expert) instead")
    fix = f"choose a world_size that divides it (for this model: {_divisors_text(config)})"
    if config.n_heads % world_size:
        raise ValueError(f"tensor parallelism over {world_size} ranks splits the {config.n_heads} attention heads "
                         f"(n_heads) into equal groups, but {config.n_heads} is not divisible by {world_size}; {fix}")
    if config.n_kv_heads % world_size and world_size % config.n_kv_heads:
        raise ValueError(f"tensor parallelism over {world_size} ranks needs world_size to divide the "
                         f"{config.n_kv_heads} K/V heads (n_kv_heads), or n_kv_heads to divide world_size (then each "
                         f"K/V head is copied to world_size // n_kv_heads ranks); neither holds; {fix}")
    if config.hidden_dim % world_size:
        raise ValueError(f"tensor parallelism over {world_size} ranks splits the MLP width hidden_dim="
                         f"{config.hidden_dim} into equal column blocks, but it is not divisible by {world_size}; "
                         f"{fix}")
    if config.vocab_size % world_size:
        raise ValueError(f"tensor parallelism over {world_size} ranks splits the vocabulary (vocab_size="
                         f"{config.vocab_size}) into equal row blocks of the embedding and output head, but it is "
                         f"not divisible by {world_size}; {fix}")
    return TensorParallelPlan(world_size, config.n_heads, config.n_kv_heads, config.head_dim, config.hidden_dim,
                              config.vocab_size)


def _divisors_text(config) -> str:
    """'1, 2, 4': the tensor-parallel degrees up to 64 that config allows."""
    ok = []
    for degree in range(1, 65):
        if (config.n_heads % degree == 0 and (config.n_kv_heads % degree == 0 or degree % config.n_kv_heads == 0)
                and config.hidden_dim % degree == 0 and config.vocab_size % degree == 0):
            ok.append(str(degree))
    return ", ".join(ok)


@dataclass(frozen=True)
class PipelinePlan:
    """The layers [start, stop) of each pipeline stage, as even as the layer count allows. Chapter 10."""

    n_layers: int
    n_stages: int

    def layer_range(self, stage: int) -> tuple[int, int]:
        base, extra = divmod(self.n_layers, self.n_stages)
        start = stage * base + min(stage, extra)          # the first `extra` stages take one layer more
        return start, start + base + (1 if stage < extra else 0)

    def ranges(self) -> list[tuple[int, int]]:
        return [self.layer_range(stage) for stage in range(self.n_stages)]


def pipeline_plan(config, n_stages: int) -> PipelinePlan:
    """The layer split of config into n_stages stages; ValueError for more stages than layers. Chapter 10."""
    if not _is_count(n_stages):
        raise ValueError(f"the number of pipeline stages must be a positive integer, got {n_stages!r}")
    if n_stages > config.n_layers:
        raise ValueError(f"a pipeline of {n_stages} stages needs at least {n_stages} layers, but the model has "
                         f"n_layers={config.n_layers}; use at most {config.n_layers} stages")
    return PipelinePlan(config.n_layers, n_stages)


def split_micro_batches(batch_size: int, n_micro_batches: int) -> list[int]:
    """Sizes of n_micro_batches micro-batches covering batch_size sequences, as even as possible. Chapter 10."""
    if not _is_count(n_micro_batches):
        raise ValueError(f"n_micro_batches must be a positive integer, got {n_micro_batches!r}")
    if not _is_count(batch_size):
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if n_micro_batches > batch_size:
        raise ValueError(f"{n_micro_batches} micro-batches need at least {n_micro_batches} sequences, but the batch "
                         f"holds {batch_size}; use n_micro_batches <= {batch_size} or a larger batch")
    base, extra = divmod(batch_size, n_micro_batches)
    return [base + (1 if i < extra else 0) for i in range(n_micro_batches)]


def default_backend(world_size: int) -> str:
    """'nccl' when there is one CUDA GPU per process, else 'gloo' (the CPU path). Chapter 10."""
    if torch.cuda.is_available() and dist.is_nccl_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def check_backend(backend: str | None, world_size: int) -> str:
    """The backend to use ('gloo' or 'nccl'); ValueError if it cannot run here with world_size processes. Chapter 10."""
    check_world_size(world_size)
    if backend is None:
        return default_backend(world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (CUDA GPUs), got {backend!r}")
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("backend 'gloo' is not available in this build of torch; install a torch build with "
                         "distributed support")
    if backend == "nccl":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise ValueError(f"backend 'nccl' needs CUDA GPUs, but this machine has none (torch "
                             f"{torch.__version__}, cuda available: {torch.cuda.is_available()}); use "
                             "backend='gloo', which runs the same code on the CPU")
        if torch.cuda.device_count() < world_size:
            raise ValueError(f"backend 'nccl' runs one process per GPU, so {world_size} processes need {world_size} "
                             f"GPUs, but this machine has {torch.cuda.device_count()}; use backend='gloo' (the CPU "
                             f"path) or world_size <= {torch.cuda.device_count()}")
    return backend


def check_port(port: int | None) -> socket.socket:
    """A listening socket on 127.0.0.1:port (port None or 0: a free one); ValueError if port is taken. Chapter 10.

    The launcher keeps this socket and hands it to the rendezvous store, so the port chosen is the port used:
    no other program can take it in between, and nothing listens beyond this machine.
    """
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535):
        raise ValueError(f"port must be None (pick a free one) or an integer in 0..65535, got {port!r}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port or 0))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ValueError(f"port {port} on {LOOPBACK} is already in use ({exc.strerror}); pass port=None to pick a "
                         "free port, or choose another one") from None
    return sock


def loopback_interface() -> str | None:
    """The name of the loopback network interface ('lo' on Linux, 'lo0' on macOS), or None if not found."""
    try:
        names = [name for _index, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return None
