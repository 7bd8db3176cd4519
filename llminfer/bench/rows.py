"""`python -m llminfer.bench rows`: a layer-stack step of several rows of x against one row. Chapters 05, 08, 09.

A decode step reads every weight once, so B sequences (or the k + 1 positions a speculative verification checks)
should cost about what one costs. This prints, for each weight format and thread count, the median time of one step
of the native layer stack (`cpu.stack.PreparedStack`, every layer in one call, random weights of a published shape)
over 1, 2, 4, 8 and 16 rows of x (positions of one sequence, as a verification forward has them), and its ratio to
one row. Up to `cpu.MAX_TOKENS` rows the multi-row matrix-vector loops run, past it the blocked kernel. The rows
take turns within each format and thread count. The table is printed and the record written to
<out>/rows-<machine>.json (data/benchmarks/ by default).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from .. import cpu as native_cpu
from ..checkpoint import load_random
from ..cpu.stack import CacheKind, PreparedStack
from ..fast import optimize_decode
from ..quant import quantize
from .decode import ACTIVATIONS, PRECISIONS
from .measure import shape_config, threads
from .report import device_slug, load_average, machine, publish

__all__ = ["SUMMARY", "add_arguments", "row_steps", "run", "table", "command"]

SUMMARY = "a layer-stack step over 1-16 rows against one row, each format (chapters 05, 08, 09)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="smollm2-135m", help="a published shape, random weights")
    parser.add_argument("--formats", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20, help="steps per row count (the median is kept)")
    parser.add_argument("--out", default="data/benchmarks", help="folder for rows-<machine>.json")


def row_steps(stack, rows: list[int], context: int = 32) -> list:
    """Returns, for each row count, a function that runs one step of `stack` (a NativeDecoderStack) over that many
    positions of one sequence after `context` cached ones."""
    (n_heads, head_dim), first = stack.heads, stack.weights[0]
    n_kv = (first.qkv.weight.shape[0] * (8 if first.qkv.weight.dim() == 3 else 1) // head_dim - n_heads) // 2
    slots = context + max(rows)
    keys = [torch.zeros(1, n_kv, slots, head_dim, dtype=stack.dtype) for _ in stack.weights]
    values = [torch.zeros_like(k) for k in keys]
    prepared = PreparedStack(stack.weights, n_heads, head_dim, CacheKind.CONTIGUOUS, keys, values)
    dim = first.input_norm.numel()
    steps = []
    for r in rows:
        x = torch.randn(1, r, dim).to(stack.dtype)
        cos, sin = torch.ones(r, head_dim, dtype=stack.dtype), torch.zeros(r, head_dim, dtype=stack.dtype)
        positions = torch.arange(context, context + r)
        steps.append(lambda x=x, cos=cos, sin=sin, positions=positions: prepared.step(x, cos, sin, positions))
    return steps


def run(shape: str = "smollm2-135m", formats=tuple(PRECISIONS), rows=(1, 2, 4, 8, 16), thread_counts=(1, 2),
        rounds: int = 20) -> dict:
    """The report: for each format and thread count, the median ms of one layer-stack step over each row count,
    and its ratio to the first row count."""
    report = {"machine": machine("cpu"), "slug": device_slug("cpu"), "load_average_before": load_average(),
              "shape": shape, "isa": native_cpu.isa(), "max_tokens": native_cpu.MAX_TOKENS, "rows": list(rows),
              "rounds": rounds, "results": []}
    base = load_random(shape_config(shape), dtype=torch.float32, seed=0, device="cpu")
    for name in formats:
        _, dtype, scheme = PRECISIONS[name]
        model = copy.deepcopy(base).to(dtype or torch.float32)
        if scheme:
            quantize(model, scheme[0], scheme[1], activations=ACTIVATIONS.get(name, "float"))
        stack = optimize_decode(model).layers
        with torch.inference_mode():
            steps = row_steps(stack, list(rows))
            for n in thread_counts:
                with threads(n):
                    times = [[] for _ in steps]
                    for _ in range(rounds):                           # the row counts take turns
                        for step, kept in zip(steps, times):
                            start = time.perf_counter()
                            step()
                            kept.append(time.perf_counter() - start)
                medians = [statistics.median(t[1:] or t) * 1e3 for t in times]
                report["results"].append({"format": name, "threads": n, "ms": medians,
                                          "ratio": [m / medians[0] for m in medians]})
    report["load_average_after"] = load_average()
    return report


def table(report: dict) -> str:
    """The report as the printed table: ms per step, and in brackets the ratio to the first row count."""
    lines = [f"{report['shape']}, random weights; ms per layer-stack step (ratio to {report['rows'][0]} row(s)); "
             f"up to {report['max_tokens']} rows the multi-row loops, past it the blocked kernel; "
             f"{report['isa']} level",
             f"{'format':<8}{'threads':>8}" + "".join(f"{r:>16}" for r in report["rows"])]
    for result in report["results"]:
        lines.append(f"{result['format']:<8}{result['threads']:>8}"
                     + "".join(f"{m:>9.2f} ({r:.2f})" for m, r in zip(result["ms"], result["ratio"])))
    return "\n".join(lines)


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not native_cpu.available():
        parser.error(f"the native CPU kernels are unavailable: {native_cpu.why_unavailable()}")
    if min(args.rows) < 1 or min(args.threads) < 1 or args.rounds < 1:
        parser.error("--rows, --threads and --rounds must be positive")
    report = run(args.shape, args.formats, args.rows, args.threads, args.rounds)
    publish(report, args.out, f"rows-{report['slug']}", table)
    return 0
