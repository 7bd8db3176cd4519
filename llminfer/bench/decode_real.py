"""`python -m llminfer.bench real`: llminfer against
llama.cpp on one real GGUF file, SmolLM2-135M-Instruct by default. Chapter 08.

Both engines decode the same chat prompt greedily from the same weights, at the same thread count:

    q4_1   the file as stored: llminfer keeps its Q4_1 / Q8_0 blocks (`quant.keep_quantized`), llama.cpp
           reads the file itself
    f32    the file dequantized to float32: llminfer's model, and a GGUF of it written for llama.cpp
    bf16   the same rounded to bfloat16, both sides

llminfer runs its fast path (fused projections, native CPU kernels, the step compiled unless --no-compile).
The contenders take turns, one generation each per round, with the decode benchmark's bandwidth probes
(`decode.BandwidthCeiling`, the size of the float32 weights at least) sampled after each generation, so every
tokens/s stands beside a ceiling measured under the same load (MBU = bytes read per token × tokens/s ÷ the fastest
probe sample, or, for a file small enough that the cache holds part of it, ÷ the faster of that and a streaming
read of its own bytes: `BandwidthCeiling.for_bytes`). With real weights the text is no longer one repeated token, so the tokens of llminfer and
llama.cpp are compared in every round: where they part, and how far they agree. Results: the terminal and
data/benchmarks/decode-real-<machine>.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import costs
from ..checkpoint import load_pretrained
from ..fast import compile_decode
from ..gguf_reader import INSTALLED, installed_gguf, read_header
from ..quant.checkpoint import keep_quantized
from ..quant.gguf_export import llama_cpp_available, write_gguf
from .llama_peer import LlamaCppProcess
from .measure import BandwidthCeiling, interleave, threads as torch_threads
from .report import device_slug, llama_cpp_version, load_average, machine, publish

# interleave is the measurement layer's (llminfer.timing.interleave); chapter 08 calls it from here
__all__ = ["FORMATS", "DEFAULT_PROMPT", "compare_tokens", "summarise", "interleave", "file_bytes_by_type",
           "llminfer_contender", "llama_cpp_contender", "add_arguments", "command", "run", "table", "SUMMARY"]

SUMMARY = "llminfer against llama.cpp on one real GGUF file, tokens compared (chapter 08)"

FORMATS = ("q4_1", "f32", "bf16")
GGUF_KIND = {"q4_1": None, "f32": "F32", "bf16": "BF16"}       # None: llama.cpp reads the file as it is
DEFAULT_PROMPT = ("Explain in a few sentences why the sky is blue, as you would to a curious child.")


def _log(message: str) -> None:
    print(f"[bench.decode_real] {message}", file=sys.stderr, flush=True)


def compare_tokens(reference: list[int], other: list[int]) -> dict:
    """How two greedy runs agree: same (bool), the index of the first difference (None if none), the length of
    their common prefix, and the fraction of positions that agree. Chapter 08."""
    common = 0
    for a, b in zip(reference, other):
        if a != b:
            break
        common += 1
    same = common == len(reference) == len(other)
    positions = max(len(reference), len(other))
    agree = sum(a == b for a, b in zip(reference, other))
    return {"same": same, "first_difference": None if same else common, "common_prefix": common,
            "agreement": agree / positions if positions else 1.0}


def summarise(results) -> dict:
    """tokens/s (1 ÷ the median gap between tokens over every round), the same per round, the median TTFT and
    the number of distinct tokens generated, from a list of GenerationResults. Chapter 08."""
    if not results:
        raise ValueError("summarise needs at least one GenerationResult, got none")
    gaps = [gap for result in results for gap in result.itl_s]
    if not gaps:
        raise ValueError("summarise needs runs of at least 2 new tokens (no gap between tokens to time)")
    return {"tokens_per_s": 1.0 / statistics.median(gaps),
            "round_tokens_per_s": [1.0 / statistics.median(r.itl_s) for r in results if r.itl_s],
            "ttft_median_s": statistics.median(r.ttft_s for r in results),
            "distinct_tokens": len(set(results[0].token_ids)), "rounds": len(results)}


def file_bytes_by_type(path) -> dict[str, int]:
    """Bytes of a GGUF file's tensors by stored type ('Q4_1', 'Q8_0', 'F32', ...), from its header. Chapter 08."""
    totals: dict[str, int] = {}
    for tensor in read_header(path).tensors.values():
        totals[tensor.type_name] = totals.get(tensor.type_name, 0) + tensor.nbytes
    return totals


def llminfer_contender(model, ids: list[int], new_tokens: int, compile: bool = False):
    """A runner () -> GenerationResult: llminfer's fast path (fused, native kernels, compiled if asked) decoding
    new_tokens after ids greedily; the model is changed in place. Returns (runner, decoder). Chapter 08."""
    decoder = compile_decode(model, max_seq_len=len(ids) + new_tokens + 8, compile=compile)
    prompt = torch.tensor([ids])
    return (lambda: decoder.generate(prompt, new_tokens)), decoder


def llama_cpp_contender(path, ids: list[int], new_tokens: int, threads: int):
    """A runner () -> GenerationResult: llama.cpp on the GGUF file at `threads` threads, greedy, in a process of
    its own (`llama_peer.LlamaCppProcess`). Chapter 08."""
    peer = LlamaCppProcess(path, len(ids) + new_tokens + 8, threads)
    return lambda: peer.generate(ids, new_tokens)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the real-file benchmark's options to parser. Chapter 08."""
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help=f"an installed model ({', '.join(INSTALLED)}) or a path to a llama-architecture .gguf")
    parser.add_argument("--formats", default=",".join(FORMATS), help="comma-separated")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message, sent through the chat template")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each generation decodes")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: the contenders take turns in each")
    parser.add_argument("--threads", type=int, default=None, help="for both engines (default: torch's count)")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="leave the fast path's step eager")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="skip llama.cpp")
    parser.add_argument("--out", default="data/benchmarks", help="folder for decode-real-<machine>.json")


def _check(args, parser) -> None:
    formats = [f for f in args.formats.split(",") if f] if isinstance(args.formats, str) else args.formats
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        parser.error(f"--formats {args.formats!r}: unknown {unknown}; choose from {', '.join(FORMATS)}")
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error(f"--new-tokens {args.new_tokens} must be >= 2 and --repeats {args.repeats} >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads} must be a positive integer")
    args.formats = formats


def _path(model: str) -> Path:
    if model in INSTALLED:
        return installed_gguf(model)
    path = Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(f"--model {model!r} is neither an installed model ({', '.join(INSTALLED)}) nor a .gguf "
                         "file; pass one of those")
    return path


def run(args) -> dict:
    """Returns the report of one interleaved run on the real file (and writes nothing). Chapter 08."""
    started, load_before = time.perf_counter(), load_average()
    path = _path(args.model)
    with torch_threads(args.threads) as threads, tempfile.TemporaryDirectory(prefix="llminfer-decode-real-") as work:
        return _measure(args, path, threads, Path(work), started, load_before)


def _measure(args, path: Path, threads: int, workdir: Path, started: float, load_before) -> dict:
    use_llama = args.llama_cpp and llama_cpp_available()
    fp32, tokenizer = load_pretrained(path, device="cpu", dtype=torch.float32)
    cfg = fp32.config
    ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
    by_type = file_bytes_by_type(path)
    n_matrix, norms = costs.matmul_params(cfg), cfg.n_layers * 2 * cfg.dim + cfg.dim
    weight_bytes = {"q4_1": sum(by_type.values()), "f32": 4 * (n_matrix + norms),
                    "bf16": 2 * (n_matrix + norms)}
    llama_weight_bytes = dict(weight_bytes, bf16=2 * n_matrix + 4 * norms)   # llama.cpp keeps norms in F32
    ggufs = {"q4_1": path}
    if use_llama:
        for name in args.formats:
            if GGUF_KIND[name]:                      # written before llminfer fuses the model in place
                _log(f"writing GGUF {GGUF_KIND[name]} of the dequantized file")
                ggufs[name] = write_gguf(fp32, workdir / f"{GGUF_KIND[name]}.gguf", GGUF_KIND[name])
    contenders, info = {}, {}
    for name in args.formats:
        _log(f"preparing llminfer {name}")
        if name == "q4_1":
            model, _ = load_pretrained(path, device="cpu", load_tokenizer=False, transform=keep_quantized())
        elif name == "f32":
            model = fp32
        else:
            model, _ = load_pretrained(path, device="cpu", dtype=torch.bfloat16, load_tokenizer=False)
        element = 2 if name == "bf16" else 4
        contenders[f"llminfer {name}"], decoder = llminfer_contender(model, ids, args.new_tokens, args.compile)
        info[f"llminfer {name}"] = {"format": name, "weight_bytes": weight_bytes[name], "kv_element_bytes": element,
                                    "compile_s": getattr(decoder, "compile_s", None)}
        if use_llama:
            contenders[f"llama.cpp {name}"] = llama_cpp_contender(ggufs[name], ids, args.new_tokens, threads)
            info[f"llama.cpp {name}"] = {"format": name, "weight_bytes": llama_weight_bytes[name],
                                         "kv_element_bytes": 2}    # llama.cpp's default KV cache is f16
    per_token = {label: meta["weight_bytes"] + (len(ids) + args.new_tokens / 2)
                 * costs.kv_bytes_per_token(cfg, meta["kv_element_bytes"]) for label, meta in info.items()}
    ceiling = BandwidthCeiling(weight_bytes["f32"], footprints=per_token.values())
    ceiling.warm()
    results = interleave(contenders, args.repeats, warmup=1, between=ceiling.sample, log=_log)
    bandwidth = ceiling.best()
    rows = {}
    for label, found in results.items():
        meta = info[label]
        row = summarise(found)
        own = ceiling.for_bytes(per_token[label])
        row.update(format=meta["format"], bytes_per_token=per_token[label], ceiling_bytes_per_s=own,
                   mbu=per_token[label] * row["tokens_per_s"] / own,
                   compile_s=meta.get("compile_s"), text=tokenizer.decode(found[0].token_ids),
                   same_tokens_every_round=all(r.token_ids == found[0].token_ids for r in found))
        rows[label] = row
    agreement, ratios = {}, {}
    for name in args.formats:
        mine, theirs = results.get(f"llminfer {name}"), results.get(f"llama.cpp {name}")
        if mine and theirs:
            agreement[name] = [compare_tokens(a.token_ids, b.token_ids) for a, b in zip(mine, theirs)]
            ratios[f"llminfer {name} / llama.cpp {name}"] = (rows[f"llminfer {name}"]["tokens_per_s"]
                                                             / rows[f"llama.cpp {name}"]["tokens_per_s"])
    description = machine("cpu")
    return {
        "what": "decode, batch 1, the real GGUF file, llminfer against llama.cpp interleaved, chapter 08",
        "machine": description, "cpu_flags": description["cpu_vector_flags"], "slug": device_slug("cpu"),
        "settings": {"model": args.model, "file": path.name, "prompt": args.prompt, "prompt_tokens": len(ids),
                     "new_tokens": args.new_tokens, "repeats": args.repeats, "threads": threads,
                     "compile": args.compile, "formats": args.formats,
                     "llama_cpp": llama_cpp_version() if use_llama else None},
        "file_bytes_by_type": by_type,
        "load_average_before": load_before, "load_average_after": load_average(),
        "bandwidth": {"ceiling_bytes_per_s": bandwidth, "by_probe": ceiling.rates(),
                      "footprint_read_bytes_per_s_by_mib": ceiling.footprint_rates(),
                      "median_by_probe": ceiling.medians(), "what": ceiling.what(),
                      "samples": ceiling.samples_per_probe()},
        "contenders": rows, "token_agreement": agreement, "ratios": ratios,
        "elapsed_s": time.perf_counter() - started,
    }


def _ceiling(report: dict) -> float:
    """The bandwidth the MBUs are against (older reports had only the torch read probe)."""
    band = report["bandwidth"]
    return band.get("ceiling_bytes_per_s", band.get("read_bytes_per_s"))


def table(report: dict) -> str:
    """The run as a text table. Chapter 08."""
    s = report["settings"]
    lines = [f"{report['machine']['cpu']}, {s['threads']} thread(s), {s['file']}, {s['prompt_tokens']}-token chat "
             f"prompt, {s['new_tokens']} new tokens, {s['repeats']} rounds; load {report['load_average_before']} -> "
             f"{report['load_average_after']}",
             f"bandwidth ceiling {_ceiling(report) / 1e9:.1f} GB/s "
             f"({report['bandwidth']['what']})",
             f"{'contender':<18}{'tokens/s':>10}{'MB/token':>10}{'ceiling GB/s':>13}{'MBU':>7}{'distinct':>10}"]
    for label, row in report["contenders"].items():
        lines.append(f"{label:<18}{row['tokens_per_s']:>10.1f}{row['bytes_per_token'] / 1e6:>10.0f}"
                     f"{row.get('ceiling_bytes_per_s', _ceiling(report)) / 1e9:>13.1f}"
                     f"{row['mbu']:>7.2f}{row['distinct_tokens']:>10}")
    for name, value in report["ratios"].items():
        lines.append(f"{name:<34}{value:>6.2f}x")
    for name, rounds in report["token_agreement"].items():
        parts = ", ".join("same" if r["same"] else f"part at {r['first_difference']}" for r in rounds)
        lines.append(f"tokens {name}, llminfer against llama.cpp, per round: {parts}")
    return "\n".join(lines)


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`python -m llminfer.bench real`: runs, prints the table, writes <out>/decode-real-<machine>.json. Chapter 08."""
    _check(args, parser)
    report = run(args)
    publish(report, args.out, f"decode-real-{report['slug']}", table=table)
    return 0
