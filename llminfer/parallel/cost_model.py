"""What splitting a model costs: memory per device, bytes on the wire, and predicted step times. Chapter 10.

A model, not a measurement. Communication follows the α–β (Hockney) model: sending n bytes takes
α + n / β, a fixed latency plus the bytes over the bandwidth. An all-reduce over p ranks moves
2 (p − 1) / p · n bytes through each rank's link (ring algorithm) and pays its latency once per step of a tree
(⌈log2 p⌉ steps), which is how NCCL handles the small messages of a decode step:

    allreduce_seconds(n, p, link) = link.alpha_s · ⌈log2 p⌉ + 2 (p − 1) / p · n / link.bytes_per_s

A decode step is memory-bound (chapter 04), so each device's compute time is the bytes it reads (its weights and
its share of the KV cache) over its memory bandwidth. Tensor parallelism adds two all-reduces per layer; pipeline
parallelism adds one send per stage boundary. Counts come from `llminfer.costs`; nothing here touches a tensor.

The interconnect and accelerator figures below are datasheet numbers, each with its source; the latencies α are
assumptions of the right order (replace them with nccl-tests numbers from your own cluster).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from llminfer import costs
from llminfer.config import PRESETS, ModelConfig

__all__ = ["Link", "Accelerator", "LINKS", "ACCELERATORS", "SHAPES", "SHAPE_SOURCES", "AlphaBeta", "fit_alpha_beta",
           "allreduce_seconds", "send_seconds", "tp_collectives", "tp_bytes_per_token", "device_memory",
           "DeviceMemory", "predict_decode_step", "StepPrediction", "fitting_layouts"]


@dataclass(frozen=True)
class Link:
    """An interconnect in the α–β model: latency alpha_s, bandwidth per direction bytes_per_s. Chapter 10."""

    name: str
    alpha_s: float
    bytes_per_s: float
    scope: str          # "node": between GPUs of one server; "cluster": between servers
    source: str
    note: str = ""


@dataclass(frozen=True)
class Accelerator:
    """A GPU in the model: its memory and memory bandwidth. Chapter 10."""

    name: str
    memory_bytes: float
    hbm_bytes_per_s: float
    source: str


GB = 1e9

# Bandwidths per direction, from the datasheets; α: assumed (see the module docstring).
LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4 via NVSwitch (H100/H200 SXM)", 5e-6, 450 * GB, "node",
                    "https://www.nvidia.com/en-us/data-center/h100/ (NVLink 900 GB/s, both directions together)",
                    "α assumed: 5 µs per tree step"),
    "pcie5": Link("PCIe Gen5 x16", 10e-6, 64 * GB, "node",
                  "https://www.nvidia.com/en-us/data-center/h100/ (PCIe Gen5 128 GB/s, both directions together)",
                  "α assumed: 10 µs per tree step"),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s per GPU", 10e-6, 50 * GB, "cluster",
                   "https://docs.nvidia.com/dgx/dgxh100-user-guide/introduction-to-dgxh100.html (8 × ConnectX-7 "
                   "400 Gb/s for the compute fabric)", "α assumed: 10 µs per tree step"),
    "roce-400": Link("RoCE 400 GbE per GPU", 15e-6, 50 * GB, "cluster",
                     "https://www.nvidia.com/en-us/networking/ethernet-adapters/ (ConnectX-7 400 GbE)",
                     "α assumed: 15 µs per tree step"),
}

ACCELERATORS: dict[str, Accelerator] = {
    "h100-sxm": Accelerator("H100 SXM 80 GB", 80 * GB, 3.35e12, "https://www.nvidia.com/en-us/data-center/h100/"),
    "h200-sxm": Accelerator("H200 SXM 141 GB", 141 * GB, 4.8e12, "https://www.nvidia.com/en-us/data-center/h200/"),
}

SHAPE_SOURCES: dict[str, str] = {
    "llama-3-8b": "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
    "llama-3-70b": "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
    "llama-3.1-405b": "https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json",
}

# The shapes of chapter 10: the presets, and Llama 3.1 405B copied from its config.json.
SHAPES: dict[str, ModelConfig] = {
    **PRESETS,
    "llama-3.1-405b": ModelConfig(vocab_size=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                  hidden_dim=53248, max_seq_len=131072, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                  bos_token_id=128000, eos_token_id=128001),
}


# --- the α–β model --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlphaBeta:
    """t(n) = alpha_s + n / bytes_per_s, fitted to measured times. Chapter 10."""

    alpha_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.bytes_per_s

    def as_link(self, name: str = "this machine (measured)") -> Link:
        return Link(name, self.alpha_s, self.bytes_per_s, "node", "measured in this run")


def fit_alpha_beta(sizes_bytes, seconds) -> AlphaBeta:
    """The α and β minimising the *relative* error of α + n/β over the measurements. Chapter 10.

    Relative error, because the times span four orders of magnitude: an ordinary least-squares fit would
    serve the largest messages and leave α meaningless.
    """
    sizes, times = list(map(float, sizes_bytes)), list(map(float, seconds))
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"need at least two (size, time) pairs of equal count, got {len(sizes)} sizes and "
                         f"{len(times)} times")
    if min(times) <= 0 or min(sizes) < 0:
        raise ValueError("times must be > 0 and sizes >= 0")
    # minimise Σ ((α + n·g − t) / t)², g = 1/β: weighted linear least squares, solved in closed form
    w = [1.0 / t ** 2 for t in times]
    s11 = sum(w)
    s12 = sum(wi * n for wi, n in zip(w, sizes))
    s22 = sum(wi * n * n for wi, n in zip(w, sizes))
    b1 = sum(wi * t for wi, t in zip(w, times))
    b2 = sum(wi * n * t for wi, n, t in zip(w, sizes, times))
    det = s11 * s22 - s12 * s12
    if det <= 0:
        raise ValueError("the sizes must differ to fit a bandwidth")
    alpha = (b1 * s22 - b2 * s12) / det
    inverse_bw = (s11 * b2 - s12 * b1) / det
    if alpha < 0:                                   # refit the slope alone through the origin
        alpha, inverse_bw = 0.0, b2 / s22
    if inverse_bw <= 0:
        raise ValueError("the times do not grow with the message size; no bandwidth can be fitted")
    return AlphaBeta(alpha, 1.0 / inverse_bw)


def allreduce_seconds(nbytes: float, world_size: int, link: Link) -> float:
    """Predicted seconds of one all-reduce of nbytes over world_size ranks on link. Chapter 10."""
    if world_size <= 1:
        return 0.0
    steps = math.ceil(math.log2(world_size))
    return link.alpha_s * steps + 2 * (world_size - 1) / world_size * nbytes / link.bytes_per_s


def send_seconds(nbytes: float, link: Link) -> float:
    """Predicted seconds of one point-to-point send of nbytes on link. Chapter 10."""
    return link.alpha_s + nbytes / link.bytes_per_s


# --- communication of tensor parallelism ----------------------------------------------------------------------

def tp_collectives(cfg, world_size: int, batch_size: int = 1, n_tokens: int = 1, dtype_bytes: int = 2,
                   logits_positions: int = 1) -> list[tuple[str, int, int]]:
    """(kind, count, bytes each) of the collectives one forward makes under tensor parallelism. Chapter 10.

    Two all-reduces of the residual stream per layer carry the split; the vocabulary-split embedding adds one
    more, and the vocabulary-split output head gathers each rank's logits (float32 rows of vocab / world_size).
    """
    if world_size <= 1:
        return []
    activations = batch_size * n_tokens * cfg.dim * dtype_bytes
    return [("all-reduce (attention, MLP)", 2 * cfg.n_layers, activations),
            ("embedding all-reduce", 1, activations),
            ("logits all-gather", 1, batch_size * logits_positions * cfg.vocab_size // world_size * dtype_bytes)]


def tp_bytes_per_token(cfg, batch_size: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes all-reduced per decode step: 2 all-reduces per layer × dim × batch × bytes. Chapter 10."""
    return 2 * cfg.n_layers * cfg.dim * batch_size * dtype_bytes


# --- memory per device ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceMemory:
    """Bytes on the busiest device of a TP × PP layout. Chapter 10."""

    weight_bytes: float
    kv_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes


def _stage_layers(n_layers: int, pp: int) -> int:
    return math.ceil(n_layers / pp)


def _local_kv_heads(cfg, tp: int) -> int:
    return max(1, cfg.n_kv_heads // tp)             # more ranks than K/V heads: each holds a copy of one


def device_memory(cfg, tp: int = 1, pp: int = 1, context_len: int = 0, batch_size: int = 1,
                  dtype_bytes: int = 2) -> DeviceMemory:
    """Weights and KV cache on the busiest device when cfg is split tp × pp ways. Chapter 10.

    Layer weights and the vocabulary (embedding, head) are split tp ways; layers pp ways (the first stage also
    holds the embedding, the last the head). K/V heads are split tp ways down to one per device.
    """
    for name, value in (("tp", tp), ("pp", pp), ("batch_size", batch_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if pp > cfg.n_layers:
        raise ValueError(f"pp={pp} stages need at least {pp} layers; the model has {cfg.n_layers}")
    layers = _stage_layers(cfg.n_layers, pp)
    norms = 2 * cfg.dim
    per_layer = costs.layer_matmul_params(cfg) / tp + norms
    bias = (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim / tp if getattr(cfg, "qkv_bias", False) else 0
    table = cfg.vocab_size * cfg.dim / tp
    if pp == 1:
        ends = table * (1 if cfg.tie_embeddings else 2) + cfg.dim
    else:
        ends = table + cfg.dim                      # the first stage's embedding or the last stage's head
    weights = (layers * (per_layer + bias) + ends) * dtype_bytes
    kv = 2 * layers * _local_kv_heads(cfg, tp) * cfg.head_dim * dtype_bytes * context_len * batch_size
    return DeviceMemory(weights, kv)


def fitting_layouts(cfg, device_bytes: float, context_len: int, batch_size: int, dtype_bytes: int,
                    degrees=(1, 2, 4, 8, 16), max_devices: int = 64, headroom: float = 0.9,
                    gpus_per_node: int = 8) -> list[tuple[int, int]]:
    """(tp, pp) layouts whose busiest device holds weights + KV within headroom × device_bytes: fewest devices
    first, then those keeping TP inside a node of gpus_per_node, then less PP. Chapter 10."""
    found = []
    for tp in degrees:
        if cfg.n_heads % tp or (cfg.n_kv_heads % tp and tp % cfg.n_kv_heads):
            continue
        for pp in degrees:
            if tp * pp > max_devices or pp > cfg.n_layers:
                continue
            need = device_memory(cfg, tp, pp, context_len, batch_size, dtype_bytes).total_bytes
            if need <= headroom * device_bytes:
                found.append((tp, pp))
    return sorted(found, key=lambda layout: (layout[0] * layout[1], layout[0] > gpus_per_node, layout[1]))


# --- predicted decode step ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPrediction:
    """Seconds of one decode step split into memory-bound compute and communication. Chapter 10."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.pp_comm_s


def predict_decode_step(cfg, tp: int, pp: int, accelerator: Accelerator, node_link: Link,
                        cluster_link: Link | None = None, gpus_per_node: int = 8, batch_size: int = 1,
                        context_len: int = 1024, dtype_bytes: int = 2) -> StepPrediction:
    """The α–β model's decode step for a tp × pp layout: stages run one after the other for a token. Chapter 10.

    Each device reads its weights and K/V at its memory bandwidth. TP groups larger than a node all-reduce over
    cluster_link (their slowest link); pipeline boundaries cross servers once the layout spans more than one.
    """
    memory = device_memory(cfg, tp, pp, context_len, batch_size, dtype_bytes)
    compute = pp * memory.total_bytes / accelerator.hbm_bytes_per_s      # stages work one after the other
    cluster_link = cluster_link or node_link
    tp_link = node_link if tp <= gpus_per_node else cluster_link
    layers = cfg.n_layers                                                # every layer runs once per token
    activations = batch_size * cfg.dim * dtype_bytes
    tp_comm = 2 * layers * allreduce_seconds(activations, tp, tp_link)
    pp_link = node_link if tp * pp <= gpus_per_node else cluster_link
    pp_comm = (pp - 1) * send_seconds(activations, pp_link) if pp > 1 else 0.0
    return StepPrediction(compute, tp_comm, pp_comm)
