"""`python -m llminfer.bench decode`: decode at every precision beside llama.cpp, transformers and the
measured bandwidth, in one interleaved run. Chapter 08.

One random-weight model of a published shape (SmolLM2-135M by default) runs as:

    llminfer fast    fused projections + compiled step (`llminfer.fast`), at fp32, bf16, int8, int4 and
                     int4a8 (int4 with int8 activations, W4A8: it changes the numbers)
    llminfer fused   the same fused model with its step left eager
    llminfer eager   `llminfer.generate` as shipped, fp32
    transformers     `generate` on the same weights, fp32 and bf16
    llama.cpp        the same weights as GGUF (F32, BF16, Q8_0, Q4_0), if llama-cpp-python is installed

The contenders take turns, one generation each per round; after each generation the bandwidth probes
(`BandwidthCeiling`) are sampled, so every tokens/s has a ceiling measured under the same load: the fastest
sample of torch's matrix-vector product and torch's streaming read from 2 MiB pages (as the fast path's weights
are read), both the size of the fp32 weights, and the native reads, where every thread streams a working set
several times the last-level cache from 2 MiB pages with the widest loads the kernels use
(`cpu.stream_read`). A contender whose bytes per token are fewer than that working set can read part of
them from the cache (an int4 SmolLM2-135M is 92 MB, and a Xeon's last-level cache can be 480 MiB): its ceiling is
the faster of that bandwidth and a native streaming read of its own bytes, sampled alongside too. MBU = (weight +
KV bytes read per token) × tokens/s ÷ the contender's ceiling. A contender that streams faster than its ceiling
means the ceiling is wrong: the benchmark says so and stops.

The report names the kernels' instruction-set level (`cpu.isa()`) and, per weight format, which decode
loops ran (`cpu.decode_loops()`, from the kernels' static table; LLMINFER_ISA forces a level's own loops).
Prefill of the prompt runs, per precision, on the path the kernels take (`cpu.prefill_path`), on both paths forced (the
blocked kernel, torch's matmul), and on the plain model (no fast path), against the best matmul rate for the
precision sampled alongside (MFU: the fastest sample of torch's square matmul and the native kernel's, square and
on a layer's products, in float32; for bf16 the better of those and the same in bfloat16, for int8 and int4 the
better of those and the blocked kernel on the format's own layer products; a prefill above that rate means the
ceiling is wrong, and the benchmark says so and stops); beside llama.cpp, the prefill is compared by time to the
first token. Results: the terminal,
data/benchmarks/decode-<machine>.json and a PNG of tokens/s against bytes per token.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from .. import costs, timing
from ..checkpoint import load_random
from ..config import get_preset
from ..cuda_graphs import COMPILE_OPTIONS
from ..fast import compile_decode
from ..generate import generate
from .. import cpu as native_cpu
from ..quant.gguf_export import llama_cpp_available, write_gguf
from ..quant.linear import quantize, quantized_weight_bytes
from .measure import BandwidthCeiling  # noqa: F401 (chapter 08 imports it from here)
from .measure import QUANT_WEIGHTS, interleave, layer_probe, matmul_probes, threads as torch_threads
from .report import device_slug, llama_cpp_version, load_average, machine, publish

# BandwidthCeiling lives in the measurement layer (`bench.measure`); chapter 08 imports it from here too
__all__ = ["add_arguments", "command", "run", "table", "plot", "GGUF_BYTES_PER_WEIGHT", "BandwidthCeiling", "SUMMARY"]

SUMMARY = "decode at every precision beside llama.cpp, transformers and the measured bandwidth (chapter 08)"

# bytes per weight of llama.cpp's formats: Q8_0 = 32 int8 + one fp16 scale per block, Q4_0 = 32 nibbles + scale
GGUF_BYTES_PER_WEIGHT = {"F32": 4.0, "BF16": 2.0, "F16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32}
PRECISIONS = {"fp32": ("F32", torch.float32, None), "bf16": ("BF16", torch.bfloat16, None),
              "int8": ("Q8_0", None, ("int8", None)), "int4": ("Q4_0", None, ("int4", 32)),
              "int4a8": ("Q4_0", None, ("int4", 32))}
ACTIVATIONS = {"int4a8": "int8"}           # precisions whose activations are rounded to int8 (W4A8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the decode benchmark's options to parser. Chapter 08."""
    parser.add_argument("--shape", default="smollm2-135m", help="a published shape, with random weights")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each generation decodes")
    parser.add_argument("--repeats", type=int, default=3, help="rounds: the contenders take turns in each")
    parser.add_argument("--threads", default="auto", help="an integer, or 'auto': the count where llama.cpp is fastest")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated")
    parser.add_argument("--quant-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="activation dtype of the int8/int4 models")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="leave the fast path's step eager")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="skip the transformers contenders")
    parser.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="skip llama.cpp")
    parser.add_argument("--out", default="data/benchmarks", help="folder for decode-<machine>.json and .png")


def _check(args, parser) -> None:
    precisions = [p for p in args.precisions.split(",") if p] if isinstance(args.precisions, str) else args.precisions
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"unknown precision(s) {unknown}; choose from {', '.join(PRECISIONS)}")
    if args.threads != "auto" and (not str(args.threads).isdigit() or int(args.threads) < 1):
        parser.error(f"--threads {args.threads!r} must be a positive integer or 'auto'")
    if args.prompt_len < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("--prompt-len >= 1, --new-tokens >= 2 and --repeats >= 1 are needed")
    args.precisions = precisions


def _log(message: str) -> None:
    print(f"[bench.decode] {message}", file=sys.stderr, flush=True)


def _tokens_per_s(results) -> float:
    gaps = [gap for result in results for gap in result.itl_s]
    return 1.0 / statistics.median(gaps)


def _kv_bytes_per_token(cfg, prompt_len: int, new_tokens: int, element: int) -> float:
    """Mean K/V bytes a decode step reads over a run (positions prompt_len+1 .. prompt_len+new_tokens-1)."""
    steps = new_tokens - 1
    return sum((prompt_len + 1 + i) * costs.kv_bytes_per_token(cfg, element) for i in range(steps)) / steps


def _choose_threads(llama_f32_path, ids, cfg, new_tokens) -> tuple[int, dict]:
    """The thread count where llama.cpp F32 decodes fastest (1 .. cores), and what each count gave."""
    found = {}
    for threads in range(1, (os.cpu_count() or 1) + 1):
        with LlamaCppProcess(llama_f32_path, len(ids) + new_tokens + 8, threads) as peer:
            peer.generate(ids, 8)
            found[threads] = _tokens_per_s([peer.generate(ids, min(new_tokens, 32)) for _ in range(2)])
    return max(found, key=found.get), found


def run(args) -> dict:
    """Returns the report of one interleaved run (and writes nothing). Chapter 08."""
    started, load_before = time.perf_counter(), load_average()
    cfg = get_preset(args.shape)
    cfg = cfg.replace(max_seq_len=args.prompt_len + args.new_tokens + 8)
    base = load_random(cfg, dtype=torch.float32, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    id_list = ids[0].tolist()
    workdir = tempfile.TemporaryDirectory(prefix="llminfer-decode-bench-")
    use_llama = args.llama_cpp and llama_cpp_available()
    ggufs = {}
    if use_llama:
        for name in args.precisions:
            kind = PRECISIONS[name][0]
            _log(f"writing GGUF {kind}")
            ggufs[kind] = write_gguf(base, Path(workdir.name) / f"model-{kind}.gguf", kind)
    thread_sweep = None
    if args.threads == "auto":
        if use_llama and "F32" in ggufs:
            threads, thread_sweep = _choose_threads(ggufs["F32"], id_list, cfg, args.new_tokens)
            _log(f"llama.cpp F32 tokens/s by thread count: {thread_sweep}; using {threads}")
        else:
            threads = torch.get_num_threads()
    else:
        threads = int(args.threads)
    try:
        with torch_threads(threads):
            return _measure(args, cfg, base, ids, id_list, ggufs, threads, thread_sweep, started, load_before)
    finally:
        workdir.cleanup()


def _measure(args, cfg, base, ids, id_list, ggufs, threads, thread_sweep, started, load_before) -> dict:
    quant_dtype = getattr(torch, args.quant_dtype)
    contenders, info = {}, {}
    n_ctx = args.prompt_len + args.new_tokens + 8
    for name in args.precisions:
        kind, dtype, scheme = PRECISIONS[name]
        model = copy.deepcopy(base).to(dtype or quant_dtype)
        if scheme:
            quantize(model, scheme[0], scheme[1], activations=ACTIVATIONS.get(name, "float"))
        weight_bytes = quantized_weight_bytes(model)
        element = timing.dtype_bytes(dtype or quant_dtype)
        _log(f"compiling llminfer {name}" if args.compile else f"preparing llminfer {name}")
        decoder = compile_decode(model, max_seq_len=n_ctx, compile=args.compile)
        if args.compile:                                  # the same fused model, its step left eager
            plain = compile_decode(model, max_seq_len=n_ctx, compile=False)
            label = f"llminfer fused {name}"
            contenders[label] = lambda d=plain: d.generate(ids, args.new_tokens)
            info[label] = {"precision": name, "weight_bytes": weight_bytes, "kv_element_bytes": element}
        label = f"llminfer fast {name}"
        contenders[label] = lambda d=decoder: d.generate(ids, args.new_tokens)
        info[label] = {"precision": name, "compile_s": decoder.compile_s, "weight_bytes": weight_bytes,
                       "kv_element_bytes": element, "decoder": decoder}
        if (use := ggufs.get(kind)) and f"llama.cpp {kind}" not in contenders:
            peer = LlamaCppProcess(use, n_ctx, threads)           # a process of its own, alive for the run
            label = f"llama.cpp {kind}"
            contenders[label] = lambda p=peer: p.generate(id_list, args.new_tokens)
            n_matrix = costs.matmul_params(cfg)
            norms = cfg.n_layers * 2 * cfg.dim + cfg.dim
            info[label] = {"precision": name, "weight_bytes": int(n_matrix * GGUF_BYTES_PER_WEIGHT[kind] + 4 * norms),
                           "kv_element_bytes": 2}        # llama.cpp's default KV cache is f16
    eager = copy.deepcopy(base)
    contenders["llminfer eager fp32"] = lambda: generate(eager, ids, args.new_tokens, ignore_eos=True)
    info["llminfer eager fp32"] = {"precision": "fp32", "weight_bytes": costs.weight_bytes_read(cfg, 4),
                                   "kv_element_bytes": 4}
    hf_note = "skipped"
    if args.transformers:
        from .transformers_contender import generate as hf_generate, load_same_weights
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            if name not in args.precisions:
                continue
            hf_model, hf_note = load_same_weights(copy.deepcopy(base).to(dtype))
            if hf_model is None:
                break
            label = f"transformers {name}"
            contenders[label] = lambda m=hf_model: hf_generate(m, ids, args.new_tokens, use_cache=True)
            info[label] = {"precision": name, "weight_bytes": costs.weight_bytes_read(cfg, timing.dtype_bytes(dtype)),
                           "kv_element_bytes": timing.dtype_bytes(dtype)}
    per_token = {label: meta["weight_bytes"] + _kv_bytes_per_token(cfg, args.prompt_len, args.new_tokens,
                                                                    meta["kv_element_bytes"])
                 for label, meta in info.items()}
    # probes the size of the fp32 weights at least, and a streaming read of each contender's own bytes per token
    ceiling = BandwidthCeiling(costs.weight_bytes(cfg, 4), footprints=per_token.values())
    # the best matmul rate of each dtype: torch's and the native kernel's, square and on a layer's products
    matmuls = {"float32": matmul_probes(torch.float32, args.prompt_len)}
    if "bf16" in args.precisions:
        matmuls["bfloat16"] = matmul_probes(torch.bfloat16, args.prompt_len)
    if native_cpu.available():                  # and each quantized format's own products by the blocked kernel
        for fmt in sorted({PRECISIONS[name][2][0] for name in args.precisions if PRECISIONS[name][2]}):
            matmuls[fmt] = [layer_probe(QUANT_WEIGHTS[fmt], args.prompt_len)]
    _log("warm-up")
    tokens = {}
    for label, runner in contenders.items():
        _log(f"warm-up: {label}")
        tokens[label] = runner().token_ids
    _log("decode loops: " + ", ".join(f"{name} {level}" for name, level in native_cpu.decode_loops().items()))
    ceiling.warm()
    results = interleave(contenders, args.repeats, warmup=0, between=ceiling.sample, log=_log)   # warmed above
    bandwidth, probe_rates = ceiling.best(), ceiling.rates()
    prefill, matmul_times = _prefill_table(args, base, ids, info, quant_dtype, matmuls)
    rows = {}
    for label, found in results.items():
        meta = info[label]
        speed, own = _tokens_per_s(found), ceiling.for_bytes(per_token[label])
        rows[label] = {"precision": meta["precision"], "tokens_per_s": speed,
                       "round_tokens_per_s": [_tokens_per_s([r]) for r in found],
                       "ttft_median_s": statistics.median(r.ttft_s for r in found),
                       "bytes_per_token": per_token[label], "ceiling_bytes_per_s": own,
                       "mbu": per_token[label] * speed / own,
                       "compile_s": meta.get("compile_s"), "same_tokens_as_warmup": found[-1].token_ids ==
                       tokens[label]}
    ratios = {}
    for name in args.precisions:
        mine = rows.get(f"llminfer fast {name}")
        if mine is None:
            continue
        kind = PRECISIONS[name][0]
        if f"llama.cpp {kind}" in rows:
            ratios[f"{name} / llama.cpp {kind}"] = mine["tokens_per_s"] / rows[f"llama.cpp {kind}"]["tokens_per_s"]
        if f"transformers {name}" in rows:
            ratios[f"{name} / transformers {name}"] = mine["tokens_per_s"] / rows[f"transformers {name}"]["tokens_per_s"]
    for name in args.precisions:                     # prefill: llama.cpp's time to first token over ours
        kind = PRECISIONS[name][0]
        mine, theirs = rows.get(f"llminfer fast {name}"), rows.get(f"llama.cpp {kind}")
        if mine and theirs:
            ratios[f"prefill {name} / llama.cpp {kind}"] = theirs["ttft_median_s"] / mine["ttft_median_s"]
    for faster, slower in (("int4", "int8"), ("int4a8", "int8"), ("int4a8", "int4")):
        if f"llminfer fast {faster}" in rows and f"llminfer fast {slower}" in rows:
            ratios[f"fast {faster} / fast {slower}"] = (rows[f"llminfer fast {faster}"]["tokens_per_s"] /
                                                        rows[f"llminfer fast {slower}"]["tokens_per_s"])
    ratios["fast fp32 / eager fp32"] = (rows["llminfer fast fp32"]["tokens_per_s"] /
                                       rows["llminfer eager fp32"]["tokens_per_s"]) if "llminfer fast fp32" in rows \
        else None
    description = machine("cpu")
    report = {
        "what": "decode, batch 1, interleaved contenders, chapter 08",
        "machine": description, "cpu_flags": description["cpu_vector_flags"], "slug": device_slug("cpu"),
        "settings": {"shape": args.shape, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "repeats": args.repeats, "threads": threads, "thread_sweep_llama_cpp_f32": thread_sweep,
                     "quant_dtype": args.quant_dtype, "compile": args.compile, "compile_options": COMPILE_OPTIONS,
                     "llama_cpp": llama_cpp_version() if ggufs else None, "transformers": hf_note},
        "load_average_before": load_before, "load_average_after": None,
        "kernels": {"isa": native_cpu.isa(), "features": list(native_cpu.isa_features()),
                    "forced_by": os.environ.get(native_cpu.ISA_ENV), "matvec": {name: {"level": level} for name, level in native_cpu.decode_loops().items()}},
        "bandwidth": {"ceiling_bytes_per_s": bandwidth, "matvec_bytes_per_s": probe_rates["matvec"],
                      "read_bytes_per_s": probe_rates["read"],
                      "native_read_bytes_per_s": max(ceiling.native_rates().values(), default=None),
                      "native_read_by_width": ceiling.native_rates(), "median_by_probe": ceiling.medians(),
                      "footprint_read_bytes_per_s_by_mib": ceiling.footprint_rates(),
                      "what": ceiling.what(),
                      "samples": ceiling.samples_per_probe()},
        "contenders": rows, "ratios": ratios,
    }
    if prefill:
        flops = costs.prefill_flops(cfg, args.prompt_len)
        by_probe = {probe.what: probe.peak_rate_of(matmul_times[probe.what])
                    for probes in matmuls.values() for probe in probes}
        rates = {dtype: max(by_probe[probe.what] for probe in probes) for dtype, probes in matmuls.items()}
        sgemm = rates["float32"]
        for name, entry in prefill.items():
            # MFU against the best matmul rate measured alongside for the precision: bfloat16 weights can be
            # multiplied in bfloat16 (torch's matmul, or vdpbf16ps), every other format in float32; a quantized
            # format's own products by the blocked kernel count too
            scheme = PRECISIONS[name][2]
            own = "bfloat16" if name == "bf16" else scheme[0] if scheme else "float32"
            best = max(sgemm, rates.get(own, 0.0))
            entry["mfu_against_flop_per_s"] = best
            for path in ("chosen", "blocked", "torch", "plain"):
                if entry.get(f"{path}_s"):
                    entry[f"{path}_mfu"] = flops / entry[f"{path}_s"] / best
        report["prefill"] = {"prompt_len": args.prompt_len, "sgemm_flop_per_s_alongside": sgemm,
                             "matmul_flop_per_s_alongside": rates, "matmul_flop_per_s_by_probe": by_probe,
                             "flops": flops,
                             "by_precision": prefill}
    over = {label: row["bytes_per_token"] * row["tokens_per_s"] for label, row in rows.items() if row["mbu"] > 1.0}
    if over:
        report["ceiling_exceeded"] = over
    over_mfu = {f"{name} prefill, {path}": entry[f"{path}_mfu"] * entry["mfu_against_flop_per_s"]
                for name, entry in report.get("prefill", {}).get("by_precision", {}).items()
                for path in ("chosen", "blocked", "torch", "plain") if entry.get(f"{path}_mfu", 0.0) > 1.0}
    if over_mfu:
        report["matmul_ceiling_exceeded"] = over_mfu
    report["load_average_after"] = load_average()
    report["elapsed_s"] = time.perf_counter() - started
    return report


def weight_dtype_of(name: str) -> torch.dtype:
    """The dtype of a precision's weights as the kernels hold them (int4: uint8 nibbles), which keys its prefill
    path."""
    _, dtype, scheme = PRECISIONS[name]
    return QUANT_WEIGHTS[scheme[0]] if scheme else dtype


def _prefill_table(args, base, ids, info, quant_dtype, matmuls) -> tuple[dict, dict[str, list[float]]]:
    """Per precision, median seconds of a prompt's prefill: the fast path as chosen here, forced onto each path,
    and the plain model; with samples of each matmul probe (by dtype) taken between them."""
    table, matmul_times = {}, {probe.what: [] for probes in matmuls.values() for probe in probes}
    repeats = max(3, args.repeats)

    def sample_matmuls() -> None:
        for probes in matmuls.values():
            for probe in probes:
                matmul_times[probe.what].extend(probe.sample(1))

    def median_of(fn) -> float:
        seconds = interleave({"prefill": lambda: timing.time_fn(fn, "cpu", 0, 1).median_s}, repeats, warmup=1,
                             between=sample_matmuls)
        return statistics.median(seconds["prefill"])

    for name in args.precisions:
        decoder = info.get(f"llminfer fast {name}", {}).get("decoder")
        if decoder is None:
            continue
        kind, dtype, scheme = PRECISIONS[name]
        entry = {"measured_path": native_cpu.prefill_path(weight_dtype_of(name), args.prompt_len)}
        with torch.inference_mode():
            entry["chosen_s"] = median_of(lambda: decoder.prefill(ids))
            for path in native_cpu.PREFILL_PATHS:
                with native_cpu.force_prefill(path):
                    entry[f"{path}_s"] = median_of(lambda: decoder.prefill(ids))
            plain = copy.deepcopy(base).to(dtype or quant_dtype)
            if scheme:
                quantize(plain, scheme[0], scheme[1], activations=ACTIVATIONS.get(name, "float"))
            # the plain model's prefill: the forward over the prompt with the last position's logits, as a
            # prefill computes them (llminfer.generate.prefill); all 128 positions' logits cost it about a quarter
            # more products
            entry["plain_s"] = median_of(lambda: plain(ids, last_only=True))
            del plain
        entry["chosen_over_plain"] = entry["plain_s"] / entry["chosen_s"]
        table[name] = entry
    return table, matmul_times


def _ceiling(report: dict) -> float:
    """The bandwidth the MBUs are against (older reports had only the matvec probe)."""
    return report["bandwidth"].get("ceiling_bytes_per_s", report["bandwidth"]["matvec_bytes_per_s"])


def table(report: dict) -> str:
    """The run as a text table. Chapter 08."""
    kernels = report.get("kernels", {})
    loops = kernels.get("matvec") or {}
    decode_loops = ""
    if loops:
        decode_loops = "; decode loops " + ", ".join(f"{name} {entry['level']}" for name, entry in loops.items())
    lines = [f"{report['machine']['cpu']}, {report['settings']['threads']} thread(s), load "
             f"{report['load_average_before']} -> {report['load_average_after']}",
             f"native kernels: {kernels.get('isa', '?')} ({'+'.join(kernels.get('features', [])) or 'plain loops'})"
             + (f", forced by LLMINFER_ISA={kernels['forced_by']}" if kernels.get("forced_by") else "") + decode_loops,
             f"bandwidth ceiling {_ceiling(report) / 1e9:.1f} GB/s (matvec "
             f"{report['bandwidth']['matvec_bytes_per_s'] / 1e9:.1f}, read "
             f"{report['bandwidth'].get('read_bytes_per_s', float('nan')) / 1e9:.1f}, native read "
             f"{(report['bandwidth'].get('native_read_bytes_per_s') or float('nan')) / 1e9:.1f}"
             + "".join(f"; {what.split(', ')[1]} {rate / 1e9:.1f}"
                       for what, rate in report['bandwidth'].get('native_read_by_width', {}).items()) + ")"
             + ("; a streaming read of each contender's own bytes (its ceiling where a cache holds part of them): "
                + ", ".join(f"{size} MiB {rate / 1e9:.1f}" for size, rate in footprints.items())
                if (footprints := report['bandwidth'].get('footprint_read_bytes_per_s_by_mib')) else ""),
             f"{'contender':<24}{'tokens/s':>10}{'MB/token':>10}{'ceiling GB/s':>13}{'MBU':>7}{'compile s':>11}"
             f"{'TTFT ms':>9}"]
    for label, row in report["contenders"].items():
        compile_s = f"{row['compile_s']:.0f}" if row.get("compile_s") else "-"
        lines.append(f"{label:<24}{row['tokens_per_s']:>10.1f}{row['bytes_per_token'] / 1e6:>10.0f}"
                     f"{row.get('ceiling_bytes_per_s', _ceiling(report)) / 1e9:>13.1f}{row['mbu']:>7.2f}{compile_s:>11}"
                     + (f"{row['ttft_median_s'] * 1e3:>9.0f}" if row.get("ttft_median_s") else f"{'-':>9}"))
    for name, value in report["ratios"].items():
        if value is not None:
            lines.append(f"{name:<40}{value:>6.2f}x")
    if "prefill" in report and "by_precision" in report["prefill"]:
        p = report["prefill"]
        rates = p.get("matmul_flop_per_s_alongside", {"float32": p["sgemm_flop_per_s_alongside"]})
        lines.append(f"prefill of {p['prompt_len']} tokens, ms (MFU against the best matmul rate alongside for the "
                     "precision: " + ", ".join(f"{dtype} {rate / 1e9:.0f} GFLOP/s" for dtype, rate in rates.items())
                     + "); 'chosen' takes the path cpu.prefill_path gives here")
        for what, rate in p.get("matmul_flop_per_s_by_probe", {}).items():
            lines.append(f"  matmul probe {rate / 1e9:5.0f} GFLOP/s: {what}")
        lines.append(f"{'precision':<10}{'path':>10}{'chosen':>12}{'blocked':>12}{'torch':>12}{'plain':>12}"
                     f"{'plain/chosen':>14}")
        for name, e in p["by_precision"].items():
            cells = "".join(f"{e[f'{k}_s'] * 1e3:>6.0f} ({e[f'{k}_mfu']:.2f})" for k in ("chosen", "blocked", "torch",
                                                                                       "plain"))
            lines.append(f"{name:<10}{e['measured_path']:>10}{cells}{e['chosen_over_plain']:>13.2f}x")
    if report.get("ceiling_exceeded"):
        lines.append("STOPPED: " + ", ".join(f"{label} streamed {rate / 1e9:.1f} GB/s"
                                             for label, rate in report["ceiling_exceeded"].items())
                     + " above its ceiling (" + ", ".join(
                         f"{report['contenders'][label].get('ceiling_bytes_per_s', _ceiling(report)) / 1e9:.1f}"
                         for label in report["ceiling_exceeded"])
                     + " GB/s): the ceiling is wrong, so no MBU is reported; rerun on a quieter machine or with a "
                       "larger probe")
    if report.get("matmul_ceiling_exceeded"):
        lines.append("STOPPED: " + ", ".join(f"{label} ran at {rate / 1e9:.0f} GFLOP/s"
                                             for label, rate in report["matmul_ceiling_exceeded"].items())
                     + ", above the fastest matmul sampled alongside: the ceiling is wrong, so no MFU is reported; "
                       "rerun on a quieter machine")
    return "\n".join(lines)


def plot(report: dict):
    """Returns a matplotlib Figure: tokens/s against bytes per token for every contender, with the measured
    bandwidth's line. Chapter 08."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bandwidth = _ceiling(report)
    rows = report["contenders"]
    sizes = [row["bytes_per_token"] for row in rows.values()]
    xs = torch.linspace(min(sizes) * 0.8, max(sizes) * 1.2, 50)
    ax.plot(xs / 1e6, bandwidth / xs, color="grey", linestyle="--", label=f"bandwidth limit ({bandwidth / 1e9:.1f} GB/s)")
    for label, row in rows.items():
        marker = "o" if label.startswith("llminfer fast") else ("s" if label.startswith("llama.cpp") else "^")
        ax.scatter(row["bytes_per_token"] / 1e6, row["tokens_per_s"], marker=marker, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("bytes read per token (MB)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{report['settings']['shape']}, {report['settings']['threads']} thread(s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`python -m llminfer.bench decode`: runs, prints the table, writes <out>/decode-<machine>.json and .png; a
    contender above its ceiling stops it with nothing written (status 1). Chapter 08."""
    _check(args, parser)
    report = run(args)
    for row in report["contenders"].values():
        row.pop("decoder", None)
    if report.get("ceiling_exceeded") or report.get("matmul_ceiling_exceeded"):   # a wrong ceiling: nothing recorded
        print(table(report))
        print("\nnothing written: a contender ran above a measured ceiling", file=sys.stderr)
        return 1
    publish(report, args.out, f"decode-{report['slug']}", table=table, plot=plot)
    return 0
