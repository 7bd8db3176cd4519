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

`python -m llminfer.bench moe` runs them and writes data/benchmarks/moe-<cpu-class>.json and .png: the machine,
the load, the layer's shape and each case's times beside its bytes.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch

from .. import cpu as native_cpu
from ..config import ModelConfig
from ..device import dtype_bytes
from ..fast import NativeMoEFeedForward
from ..moe import MoEFeedForward
from ..timing import interleave, medians, stopwatch
from .measure import threads
from .report import device_slug, load_average, machine, publish

__all__ = ["SMALL_MOE", "ExpertTiming", "experts_bytes_read", "time_experts", "SUMMARY", "add_arguments", "run",
           "command", "table", "plot"]

SUMMARY = "an MoE layer's experts by a loop and grouped by expert, prefill and decode, beside the bytes (chapter 14)"

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


# --- the command line: python -m llminfer.bench moe -----------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the moe benchmark's options to parser, each default stated once. Chapter 14."""
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 64], help="sequences per call")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens of each prompt in a prefill call")
    parser.add_argument("--rounds", type=int, default=7, help="calls of each contender per case (the median is kept)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (steadier with 1)")
    parser.add_argument("--dim", type=int, default=SMALL_MOE.dim, help="width of the hidden states")
    parser.add_argument("--experts", type=int, default=SMALL_MOE.n_experts, help="experts of the layer, E")
    parser.add_argument("--top-k", type=int, default=SMALL_MOE.n_experts_per_tok, help="experts a token goes to")
    parser.add_argument("--expert-dim", type=int, default=SMALL_MOE.moe_hidden_dim, help="width of each expert")
    parser.add_argument("--no-native", dest="native", action="store_false",
                        help="leave out the grouped path on the native CPU kernels")
    parser.add_argument("--out", default="data/benchmarks", help="folder for moe-<machine>.json and .png")


def run(config: ModelConfig, batch_sizes, prompt_len: int, rounds: int, native: bool = True) -> dict:
    """Returns the report: the machine and its load, the layer's shape, one row per case (time_experts) with its
    grouped-over-loop speedup, and whether grouped beat the loop at every batch of 8 or more. Chapter 14."""
    report = {"machine": machine("cpu"), "slug": device_slug("cpu"), "load_average_before": load_average(),
              "layer": {key: getattr(config, key) for key in ("dim", "n_experts", "n_experts_per_tok",
                                                              "moe_hidden_dim")},
              "settings": {"batch_sizes": list(batch_sizes), "prompt_len": prompt_len, "rounds": rounds}}
    rows = time_experts(config, tuple(batch_sizes), prompt_len, rounds, native=native)
    report["rows"] = [{**dataclasses.asdict(row), "grouped_over_loop": row.speedup()} for row in rows]
    large = [row for row in rows if row.batch_size >= 8]            # chapter 14's target: grouped wins from batch 8
    report["target"] = {"grouped faster than the loop at batch >= 8": all(row.speedup() > 1 for row in large)
                        if large else None}
    report["load_average_after"] = load_average()
    report["created"] = time.strftime("%Y-%m-%d")
    return report


def table(report: dict) -> str:
    """One line per case: the experts touched, the MB read and each contender's milliseconds. Chapter 14."""
    names = list(report["rows"][0]["seconds"])
    lines = [f"{'phase':<8}{'B':>4}{'tokens':>8}{'experts':>9}{'MB read':>9}"
             + "".join(f"{name + ' ms':>20}" for name in names) + f"{'loop/grouped':>14}"]
    for row in report["rows"]:
        lines.append(f"{row['phase']:<8}{row['batch_size']:>4}{row['tokens']:>8}{row['distinct_experts']:>9}"
                     f"{row['bytes_read'] / 1e6:>9.2f}" + "".join(f"{row['seconds'][n] * 1e3:>20.3f}" for n in names)
                     + f"{row['grouped_over_loop']:>13.2f}x")
    lines += [f"{target}: {'met' if met else 'not met' if met is not None else 'no such batch'}"
              for target, met in report["target"].items()]
    return "\n".join(lines)


def plot(report: dict):
    """Each phase's milliseconds per call against the batch, one line per contender, the MB read beside them on
    a second axis. Chapter 14."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for axis, phase in zip(axes, ("decode", "prefill")):
        rows = [row for row in report["rows"] if row["phase"] == phase]
        batches = [row["batch_size"] for row in rows]
        for name in rows[0]["seconds"]:
            axis.loglog(batches, [row["seconds"][name] * 1e3 for row in rows], "o-", label=name)
        axis.set(title=f"{phase}, {report['slug']}", xlabel="batch (sequences)", ylabel="ms per call")
        axis.legend(fontsize=8, loc="upper left")
        read = axis.twinx()
        read.semilogx(batches, [row["bytes_read"] / 1e6 for row in rows], ":", color="grey")
        read.set_ylabel("MB read (dotted)")
        axis.set_xticks(batches, [str(b) for b in batches], minor=False)
        axis.xaxis.set_minor_locator(plt.NullLocator())
    figure.tight_layout()
    return figure


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`python -m llminfer.bench moe`: times the cases, prints the table, writes <out>/moe-<machine>.json and .png."""
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.rounds < 1 or args.threads < 1:
        parser.error(f"--batch-sizes {args.batch_sizes}, --prompt-len {args.prompt_len}, --rounds {args.rounds} "
                     f"and --threads {args.threads} must be positive integers")
    try:
        config = dataclasses.replace(SMALL_MOE, dim=args.dim, n_experts=args.experts, n_experts_per_tok=args.top_k,
                                     moe_hidden_dim=args.expert_dim)
    except ValueError as error:
        parser.error(f"the layer's shape is refused: {error}")
    with threads(args.threads):
        report = run(config, args.batch_sizes, args.prompt_len, args.rounds, args.native)
    publish(report, args.out, f"moe-{report['slug']}", table=table, plot=plot)
    return 0
