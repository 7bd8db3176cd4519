"""The two ways to run an MoE layer's experts, timed against each other, beside the bytes each call reads.
Chapter 14.

    rows = time_experts()                              # SMALL_MOE's layer, batch 1, 8 and 64, prefill and decode
    for row in rows:
        print(row.phase, row.batch_size, row.distinct_experts, row.bytes_read, row.seconds)

Each contender runs the same MoE feed-forward on the same hidden states: `loop` (each expert finds its tokens),
`grouped` (the tokens sorted by expert, one product per contiguous slice) and, where the native CPU kernels
build, `grouped-native` (the same slices through `llminfer.cpu.gemv`, `llminfer.fast.NativeMoEFeedForward`). They
take turns in one interleaved run (`llminfer.timing.interleave`), so a busy machine slows them alike. A decode
call is batch_size tokens, one a sequence; a prefill call is batch_size prompts of prompt_len tokens. Beside
each time: how many experts the routing touched and the bytes that call reads (router, those experts' weights,
the hidden states in and out), which the routing fixes and the implementation does not.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import cpu as native_cpu
from ..config import ModelConfig
from ..device import dtype_bytes
from ..fast import NativeMoEFeedForward
from ..moe import MoEFeedForward
from ..timing import interleave, medians, stopwatch

__all__ = ["SMALL_MOE", "ExpertTiming", "experts_bytes_read", "time_experts"]

# One MoE layer the size of a small model's: 32 experts of 256, 4 a token, on a 512-wide stream (48 MiB of
# experts in float32, more than a CPU's last-level cache, so a call streams what it touches from memory).
SMALL_MOE = ModelConfig(vocab_size=1024, dim=512, n_layers=1, n_heads=8, n_kv_heads=2, hidden_dim=256,
                        model_type="qwen3_moe", n_experts=32, n_experts_per_tok=4, moe_hidden_dim=256,
                        norm_topk_prob=True)


@dataclass(frozen=True)
class ExpertTiming:
    """One phase and batch size: the median seconds of each contender, and what the call reads. Chapter 14."""

    phase: str                  # 'prefill' or 'decode'
    batch_size: int             # sequences
    tokens: int                 # rows through the layer: batch_size (decode) or batch_size · prompt_len (prefill)
    distinct_experts: int       # experts the routing sent at least one token to
    bytes_read: int             # router + those experts' weights + hidden states in and out
    seconds: dict[str, float]   # contender -> median seconds of a call

    def speedup(self, over: str = "loop", of: str = "grouped") -> float:
        """How many times faster `of` ran than `over` (medians)."""
        return self.seconds[over] / self.seconds[of]


def experts_bytes_read(moe: MoEFeedForward, ids: torch.Tensor, tokens: int) -> int:
    """The bytes one call of `moe` reads for routing `ids` (T, k): its router, each expert chosen at least once
    (gate, up and down), the shared expert if any, and the tokens' hidden states in and out. Chapter 14."""
    size = dtype_bytes(moe.w_gate.dtype)
    expert = (moe.w_gate[0].numel() + moe.w_up[0].numel() + moe.w_down[0].numel()) * size
    shared = sum(p.numel() for p in moe.shared_expert.parameters()) * size if moe.shared_expert is not None else 0
    router = moe.router.weight.numel() * size
    return router + int(ids.unique().numel()) * expert + shared + 2 * tokens * moe.router.in_features * size


def time_experts(config: ModelConfig = SMALL_MOE, batch_sizes=(1, 8, 64), prompt_len: int = 32, rounds: int = 7,
                 dtype: torch.dtype = torch.float32, seed: int = 0, native: bool = True) -> list[ExpertTiming]:
    """Loop against grouped (and grouped on the native kernels where they build, with native=True), on one MoE
    layer of `config` with N(0, 0.02²) weights, for decode and prefill at each batch size, in one interleaved
    run per case. Returns one ExpertTiming a case, decode first. Chapter 14."""
    if not config.is_moe:
        raise ValueError(f"time_experts needs a config with experts, got n_experts={config.n_experts}; pass an MoE "
                         "config such as llminfer.bench.moe.SMALL_MOE")
    generator = torch.Generator().manual_seed(seed)
    moe = MoEFeedForward.from_config(config).to(dtype).eval()
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    contenders = {"loop": ("loop", moe), "grouped": ("grouped", moe)}
    if native and native_cpu.available():
        contenders["grouped-native"] = ("grouped", NativeMoEFeedForward.of(moe))
    rows = []
    for phase in ("decode", "prefill"):
        for batch in batch_sizes:
            tokens = batch * (prompt_len if phase == "prefill" else 1)
            x = torch.randn(tokens, config.dim, generator=generator).to(dtype)
            with torch.no_grad():
                _, ids = moe.route(x)

            def timed(impl: str, module: MoEFeedForward, x=x):
                module.impl = impl
                with torch.no_grad(), stopwatch("cpu") as watch:
                    module(x)
                return watch.seconds

            results = interleave({name: (lambda c=c: timed(*c)) for name, c in contenders.items()}, rounds)
            rows.append(ExpertTiming(phase, batch, tokens, int(ids.unique().numel()),
                                     experts_bytes_read(moe, ids, tokens), medians(results)))
    return rows
