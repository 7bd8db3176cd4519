"""`python -m llminfer.bench prefill-decode`: prefill and decode beside the machine's measured ceilings and beside transformers. Chapter 04.

One run, one device, the same random weights for every contender:
ceilings (copy and matvec bandwidth, matmul rate) -> prefill (tokens/s, FLOP/s, MFU)
-> decode contenders (llminfer with and without its cache, transformers `generate` with and without its
cache) -> a batch sweep (tokens/s, bytes per token, MBU) -> scaling of the per-token latency with context,
set against the FLOP-count prediction. Results go to the terminal, to <out>/<device-name>.json and a PNG.

Decode speed is timed per token (the gap between consecutive tokens), and its median is quoted: on a busy
machine the median resists the stalls that other processes cause; the contenders take turns, one
repeat each, so that each ratio compares runs made at the same moment.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .. import costs, timing
from ..checkpoint import load_random
from ..device import check_fits, dtype_bytes, resolve_device
from ..generate import decode_step, generate, prefill
from . import figures, transformers_contender
from .engine_decode import EngineSettings, engine_section, engine_table
from .figures import paired_ratio, utilisation
from .measure import interleave, shape_config, threads
from .report import device_slug, load_average, machine, publish

__all__ = ["Settings", "parse_args", "add_arguments", "settings_from", "check_settings", "estimate_bytes", "run",
           "command", "assemble", "table", "plot", "TARGETS", "SUMMARY"]

SUMMARY = "prefill and decode beside the measured ceilings and transformers (chapter 04)"

MAX_BATCH = 1024


@dataclass
class Settings:
    """What one benchmark run measures. Chapter 04."""
    shape: str | None = None                  # preset name; None: smollm2-135m on CPU, llama-3.2-1b on CUDA
    device: str | None = None                 # None: CUDA when present
    dtype: str | None = None                  # None: float32 on CPU, bfloat16 on CUDA
    prompt_len: int = 128
    new_tokens: int = 64
    recompute_new_tokens: int = 16            # uncached decoding re-runs the context: fewer tokens keep it short
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (128, 256, 512, 1024, 2048)
    repeats: int = 5
    quick: bool = False
    transformers: bool = True
    cuda_graphs: bool = True
    decode_layout: bool = True                # CPU: Transformer.use_decode_layout() before timing
    out: str = "data/benchmarks"
    seed: int = 0
    threads: int | None = None                # CPU threads for every contender (None: torch's default)
    engine: bool = True                       # CPU: the engine section (bench/engine_decode.py), 8 requests vs one

    @classmethod
    def quick_run(cls, **changes) -> "Settings":
        """The --quick settings: a small prompt, few tokens and contexts (well under 2 minutes on 2 cores)."""
        base = dict(prompt_len=32, new_tokens=8, recompute_new_tokens=4, batch_sizes=(1, 4),
                    contexts=(32, 64), repeats=2, quick=True, engine=False)
        return cls(**{**base, **changes})


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,4,16") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the prefill-decode options to parser, each default stated once. Chapter 04."""
    base, quick = Settings(), Settings.quick_run()

    def default(name, text=""):
        normal, short = getattr(base, name), getattr(quick, name)
        shown = ",".join(map(str, normal)) if isinstance(normal, tuple) else normal
        short = ",".join(map(str, short)) if isinstance(short, tuple) else short
        return f"{text}(default: {shown}" + (f"; --quick: {short})" if short != normal else ")")
    parser.add_argument("--quick", action="store_true", help="a short run for tests (< 2 minutes)")
    parser.add_argument("--shape", help="preset shape, e.g. smollm2-135m, llama-3.2-1b "
                                        "(default: smollm2-135m on a CPU, llama-3.2-1b on CUDA)")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="(default: float32 on a CPU, bfloat16 on CUDA)")
    parser.add_argument("--prompt-len", type=int, help=default("prompt_len"))
    parser.add_argument("--new-tokens", type=int, help=default("new_tokens"))
    parser.add_argument("--batch-sizes", type=_int_list, help=default("batch_sizes", "comma-separated "))
    parser.add_argument("--contexts", type=_int_list, help=default("contexts", "context lengths for scaling "))
    parser.add_argument("--repeats", type=int, help=default("repeats"))
    parser.add_argument("--threads", type=int, help="CPU threads for every contender (default: torch's)")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="skip the transformers contenders")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                        help="skip the CUDA-graph contender")
    parser.add_argument("--no-decode-layout", dest="decode_layout", action="store_false",
                        help="time llminfer with its weights in the default (row-major) order")
    parser.add_argument("--out", help=f"folder for the JSON and PNG (default: {base.out})")
    parser.add_argument("--engine", dest="engine", action="store_true", default=None,
                        help="run the engine section (CPU; on by default, off with --quick)")
    parser.add_argument("--no-engine", dest="engine", action="store_false",
                        help="skip the engine section: 8 requests through LLMEngine vs one fast request")


def settings_from(args: argparse.Namespace) -> Settings:
    """Returns the Settings that parsed arguments give. Chapter 04."""
    names = {f.name for f in fields(Settings)}
    given = {name: value for name, value in vars(args).items()
             if name in names and value is not None
             and name not in ("quick", "transformers", "cuda_graphs", "decode_layout")}
    given.update(transformers=args.transformers, cuda_graphs=args.cuda_graphs, decode_layout=args.decode_layout)
    return Settings.quick_run(**given) if args.quick else Settings(**given)


def parse_args(argv: list[str] | None = None) -> Settings:
    """Returns the Settings given on the command line (the options after `prefill-decode`). Chapter 04."""
    parser = argparse.ArgumentParser(prog="python -m llminfer.bench prefill-decode")
    add_arguments(parser)
    return settings_from(parser.parse_args(argv))


def estimate_bytes(cfg, dtype: torch.dtype, settings: Settings, device=torch.device("cpu")) -> int:
    """Returns the peak memory the run needs: weights (twice with transformers), caches, activations."""
    elem = dtype_bytes(dtype)
    weights = cfg.n_params() * elem * (2 if settings.transformers else 1)
    runs = [costs.generation_bytes(cfg, batch, settings.prompt_len, settings.new_tokens, elem)
            for batch in settings.batch_sizes]
    longest = max(settings.contexts) + 1
    runs += [costs.kv_cache_bytes(cfg, longest, elem) + costs.activation_bytes(cfg, longest, elem)]
    scores = cfg.n_heads * longest * longest * 4        # attention scores, if the kernel materialises them
    probes = 3 * 2 * ((1 << 30) if device.type == "cuda" else (256 << 20))   # copy (2 buffers) and matvec
    return weights + max(runs) + scores + probes


def _check_writable(folder: str) -> None:
    path = Path(folder)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".llminfer-bench-"):
            pass
    except OSError as exc:
        raise ValueError(f"--out {folder!r} is not a writable folder ({exc.strerror or exc}); "
                         "pass --out to a folder you can write") from None


def check_settings(settings: Settings):
    """Returns (device, dtype, cfg) after checking every setting; raises before anything is allocated. Chapter 04."""
    device = resolve_device(settings.device)                 # an absent device: RuntimeError
    shape = settings.shape or ("llama-3.2-1b" if device.type == "cuda" else "smollm2-135m")
    cfg = shape_config(shape)
    dtype_name = settings.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    for name in ("prompt_len", "new_tokens", "recompute_new_tokens", "repeats", "threads"):
        value = getattr(settings, name)
        if (value is not None or name != "threads") and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if settings.new_tokens < 2:
        raise ValueError(f"new_tokens={settings.new_tokens}: decoding is timed between tokens, so pass >= 2")
    if not settings.batch_sizes or any(not isinstance(b, int) or not 1 <= b <= MAX_BATCH
                                       for b in settings.batch_sizes):
        raise ValueError(f"batch sizes {list(settings.batch_sizes)} are not allowed: each must be an integer "
                         f"from 1 to {MAX_BATCH}, e.g. --batch-sizes 1,4,16")
    if not settings.contexts or min(settings.contexts) < 1:
        raise ValueError(f"contexts {list(settings.contexts)} must be positive lengths, e.g. --contexts 128,512")
    longest = max(max(settings.contexts) + 1, settings.prompt_len + settings.new_tokens)
    if longest > cfg.max_seq_len:
        raise ValueError(f"the run needs {longest} positions but {shape} holds max_seq_len={cfg.max_seq_len}; "
                         "pass shorter --contexts, --prompt-len or --new-tokens")
    check_fits(estimate_bytes(cfg, dtype, settings, device), device,
               f"benchmarking {shape} in {dtype_name} (weights, caches, activations"
               f"{', a transformers copy' if settings.transformers else ''})",
               fix="pass a smaller --shape, --batch-sizes or --contexts")
    _check_writable(settings.out)                            # before minutes of measuring, not after
    return device, dtype, cfg.replace(max_seq_len=max(longest, settings.prompt_len + settings.new_tokens))


def _random_ids(cfg, batch: int, length: int, seed: int, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=generator).to(device)


def bench_prefill(model, cfg, ids, probes, settings) -> dict:
    """Returns prefill time, tokens/s and FLOP/s for one prompt, sampling the matmul probe in between. Chapter 04."""
    cache = model.new_cache(ids.shape[0], max_seq_len=ids.shape[1])

    def one_prefill():
        cache.reset()
        prefill(model, ids, cache)
    alongside = []
    found = interleave({"prefill": lambda: timing.time_fn(one_prefill, model.device, 0, 1).median_s},
                       max(3, settings.repeats), warmup=1,
                       between=lambda: alongside.extend(probes["matmul_flops"].sample()))
    result = timing.TimingResult.from_times(found["prefill"])
    return {"median_s": result.median_s, "iqr_s": result.iqr_s,
            "matmul_flop_per_s_alongside": probes["matmul_flops"].rate_of(alongside)}


def bench_contenders(model, cfg, ids, settings, hf_model, probes) -> dict[str, dict]:
    """Returns per-token decode latencies of each contender, the contenders taking turns per repeat."""
    def llminfer_run(use_cache):
        n = settings.new_tokens if use_cache else settings.recompute_new_tokens + 1
        return generate(model, ids, max_new_tokens=n, use_cache=use_cache, ignore_eos=True)   # n tokens to time

    runners = {"llminfer (cache)": lambda: llminfer_run(True),
               "llminfer (no cache)": lambda: llminfer_run(False)}
    if hf_model is not None:
        runners["transformers (cache)"] = lambda: transformers_contender.generate(
            hf_model, ids, settings.new_tokens, use_cache=True)
        runners["transformers (no cache)"] = lambda: transformers_contender.generate(
            hf_model, ids, settings.recompute_new_tokens + 1, use_cache=False)
    if model.device.type == "cuda" and settings.cuda_graphs:
        from ..cuda_graphs import StaticDecoder
        graphed = StaticDecoder(model, batch_size=ids.shape[0], max_seq_len=ids.shape[1] + settings.new_tokens,
                                mode="graph")
        runners["llminfer (CUDA graphs)"] = lambda: graphed.generate(ids, settings.new_tokens)
    alongside = []

    def sample_ceilings():                                    # the ceilings, under the same load as each run
        alongside.extend(probes["matvec_bandwidth"].sample(2))
        probes["copy_bandwidth"].sample()
    # one warm-up each (allocators, kernels, graph capture), then the contenders take turns
    results = interleave(runners, settings.repeats, warmup=1, between=sample_ceilings)
    found = {}
    for name, runs in results.items():                          # GenerationResults, whoever made them
        found[name] = {"ttft_s": [r.ttft_s for r in runs], "latencies_s": [gap for r in runs for gap in r.itl_s],
                       "repeat_medians_s": [statistics.median(r.itl_s) for r in runs], "token_ids": runs[-1].token_ids}
    for name, entry in found.items():
        entry["new_tokens"] = len(entry["token_ids"]) if isinstance(entry["token_ids"][0], int) else None
        entry["token_s"] = statistics.median(entry["latencies_s"])
        entry["tokens_per_s"] = 1.0 / entry["token_s"]
        entry["ttft_median_s"] = statistics.median(entry["ttft_s"])
    found["llminfer (cache)"]["matvec_alongside_s"] = alongside
    return found


def bench_scaling(model, cfg, settings, probes) -> list[dict]:
    """Returns per-token latency with and without the cache at each context length, and the FLOP prediction."""
    elem = dtype_bytes(model.dtype)
    rows = []
    repeats = max(2, settings.repeats // 2)
    for context in sorted(settings.contexts):
        ids = _random_ids(cfg, 1, context + 1, settings.seed + context, model.device)
        cache = model.new_cache(1, max_seq_len=context + 1)
        prefill(model, ids[:, :context], cache)                                # the cache holds `context` positions

        def cached_step():                            # the step at position `context`, then rolled back
            decode_step(model, ids[:, context], cache, check_ids=False)
            cache.truncate(context)
        cached = timing.time_fn(cached_step, model.device, warmup=2, repeats=3 * settings.repeats)
        with torch.inference_mode():
            recompute = timing.time_fn(lambda: model(ids, last_only=True), model.device, warmup=1,
                                       repeats=repeats)
        probes["matvec_bandwidth"].sample()
        probes["matmul_flops"].sample()
        flops_cached = costs.decode_step_flops(cfg, cached_len=context)
        flops_recompute = costs.forward_flops(cfg, context + 1, 0, logits_positions=1)
        rows.append({"context_len": context, "cached_s": cached.median_s, "cached_iqr_s": cached.iqr_s,
                     "recompute_s": recompute.median_s, "recompute_iqr_s": recompute.iqr_s,
                     "speedup": recompute.median_s / cached.median_s,
                     "flop_speedup": flops_recompute / flops_cached,
                     "flops_cached": flops_cached, "flops_recompute": flops_recompute,
                     "bytes_cached": costs.decode_step_bytes(cfg, cached_len=context, dtype_bytes=elem),
                     "bytes_recompute": costs.weight_bytes_read(cfg, elem)})
        del cache
    return rows


def run(settings: Settings) -> dict:
    """Returns the full report of one benchmark run (and writes nothing). Chapter 04."""
    device, dtype, cfg = check_settings(settings)
    with threads(settings.threads):
        return _measure(settings, device, dtype, cfg)


def _measure(settings: Settings, device, dtype, cfg) -> dict:
    started, load_before = time.perf_counter(), load_average()
    torch.manual_seed(settings.seed)
    print(f"[bench] ceilings on {device} in {str(dtype).removeprefix('torch.')}", file=sys.stderr)
    probes = timing.ceiling_probes(device, dtype, quick=settings.quick)
    for probe in probes.values():
        probe.sample(2 if settings.quick else 3)
    model = load_random(cfg, device=device, dtype=dtype, seed=settings.seed)
    hf_model, hf_note = (transformers_contender.load_same_weights(model) if settings.transformers
                         else (None, "skipped"))
    if settings.decode_layout and device.type == "cpu":
        model.use_decode_layout()                 # same values, memory order for fast matvecs (transformers: as shipped)
    ids = _random_ids(cfg, 1, settings.prompt_len, settings.seed, device)
    print("[bench] prefill", file=sys.stderr)
    prefill_figures = bench_prefill(model, cfg, ids, probes, settings)
    print("[bench] decode contenders", file=sys.stderr)
    contenders = bench_contenders(model, cfg, ids, settings, hf_model, probes)
    del hf_model
    latencies = {1: contenders["llminfer (cache)"]["latencies_s"]}
    alongside = {1: contenders["llminfer (cache)"].pop("matvec_alongside_s")}
    print("[bench] batch sweep", file=sys.stderr)
    for batch in sorted(set(settings.batch_sizes) - {1}):
        batch_ids = _random_ids(cfg, batch, settings.prompt_len, settings.seed + batch, device)
        latencies[batch], alongside[batch] = [], []
        for _ in range(max(2, settings.repeats // 2)):
            latencies[batch] += generate(model, batch_ids, max_new_tokens=settings.new_tokens, ignore_eos=True).itl_s
            alongside[batch] += probes["matvec_bandwidth"].sample()
    print("[bench] scaling with context", file=sys.stderr)
    scaling = bench_scaling(model, cfg, settings, probes)
    ceilings = {name: probe.ceiling() for name, probe in probes.items()}      # medians of every sample
    # MFU and MBU against the probe samples taken alongside (same load); the run-wide ceilings are reported too
    prefill_timing = prefill_figures
    prefill_figures = figures.prefill_figures(cfg, ids.shape[1], ids.shape[0], prefill_timing["median_s"],
                                              prefill_timing["matmul_flop_per_s_alongside"],
                                              ceilings["matmul_flops"].rate)
    prefill_figures["iqr_s"] = prefill_timing["iqr_s"]
    elem = dtype_bytes(dtype)
    decode = [figures.decode_figures(cfg, elem, latencies[batch], batch, settings.prompt_len, settings.new_tokens,
                                     probes["matvec_bandwidth"].rate_of(alongside[batch]),
                                     ceilings["copy_bandwidth"].rate)
              for batch in sorted(latencies)]
    for row in decode:
        row["mbu_matvec_vs_run_ceiling"] = figures.utilisation(row["bytes_per_s"], ceilings["matvec_bandwidth"].rate,
                                                               "decode MBU against the run's matvec bandwidth")
    figures.add_roofline(scaling, ceilings["matmul_flops"].rate, ceilings["matvec_bandwidth"].rate)
    engine = None
    if settings.engine and device.type == "cpu":
        print("[bench] engine section", file=sys.stderr)
        engine = engine_section(EngineSettings(shape=settings.shape or "smollm2-135m", threads=settings.threads or 2))
    report = assemble(settings=settings, device=device, dtype=dtype, cfg=cfg, ceilings=ceilings,
                                 prefill=prefill_figures, contenders=contenders, decode=decode, scaling=scaling,
                                 hf_note=hf_note, elapsed_s=time.perf_counter() - started,
                                 load_before=load_before)
    if engine is not None:
        report["engine"] = engine
    return report


WEIGHTS_NOTE = ("The weights are random (N(0, 0.02^2), seeded), not a trained checkpoint: no weights can be "
                "downloaded here, and none are needed, because every kernel does the same work whatever the values "
                "are (dense matmuls, a fixed number of tokens: greedy decoding runs exactly new_tokens steps, EOS "
                "is not used). Timing depends on the shape, the dtype and the lengths only.")

# (figure, target, device type, dtype): the goals the benchmark is judged by.
TARGETS = [
    ("decode tokens/s, llminfer (cache) / transformers (cache)", 1.2, "cpu", "float32"),
    ("decode MBU vs matvec bandwidth", 0.8, "cpu", "float32"),
    ("prefill MFU vs matmul rate", 0.7, "cpu", "float32"),
    ("decode tokens/s, llminfer (CUDA graphs) / transformers (cache)", 1.5, "cuda", "bfloat16"),
    ("decode MBU vs copy bandwidth, llminfer (CUDA graphs)", 0.6, "cuda", "bfloat16"),
]



def _ratio(contenders: dict, mine: str, theirs: str) -> dict | None:
    if mine not in contenders or theirs not in contenders:
        return None
    # each repeat ran both contenders back to back: their ratio compares like with like on a busy machine
    return paired_ratio(contenders[mine]["repeat_medians_s"], contenders[theirs]["repeat_medians_s"])


def assemble(*, settings, device, dtype, cfg, ceilings, prefill, contenders, decode, scaling, hf_note,
             elapsed_s, load_before) -> dict:
    """Returns the JSON-ready report, the ratios and the verdict on each target."""
    dtype_name = str(dtype).removeprefix("torch.")
    for entry in contenders.values():
        entry["repeat_medians_s"] = [round(x, 6) for x in entry["repeat_medians_s"]]
    ratios = {
        "decode_vs_transformers_cache": _ratio(contenders, "llminfer (cache)", "transformers (cache)"),
        "decode_vs_transformers_no_cache": _ratio(contenders, "llminfer (cache)", "transformers (no cache)"),
        "cache_vs_no_cache": _ratio(contenders, "llminfer (cache)", "llminfer (no cache)"),
        "graphs_vs_transformers_cache": _ratio(contenders, "llminfer (CUDA graphs)", "transformers (cache)"),
    }
    graphs = contenders.get("llminfer (CUDA graphs)")
    graph_mbu = None
    if graphs:
        graph_mbu = utilisation(decode[0]["bytes_per_step"] / graphs["token_s"], ceilings["copy_bandwidth"].rate,
                                "CUDA-graph decode MBU against the copy bandwidth")
    values = [(ratios["decode_vs_transformers_cache"] or {}).get("paired_median"), decode[0]["mbu_matvec"],
              prefill["mfu"], (ratios["graphs_vs_transformers_cache"] or {}).get("paired_median"), graph_mbu]
    targets = []
    for (name, goal, device_type, target_dtype), value in zip(TARGETS, values):
        if device_type == device.type and target_dtype == dtype_name:
            targets.append({"figure": name, "target": goal, "value": value,
                            "met": None if value is None else bool(value >= goal)})
    slim = {name: {k: v for k, v in entry.items() if k not in ("latencies_s", "token_ids")}
            for name, entry in contenders.items()}
    same = None
    if "transformers (cache)" in contenders:
        same = contenders["transformers (cache)"]["token_ids"] == contenders["llminfer (cache)"]["token_ids"]
    return {
        "schema": 1, "device_name": device_slug(device), "machine": machine(device),
        "shape": {"name": settings.shape or ("llama-3.2-1b" if device.type == "cuda" else "smollm2-135m"),
                  "n_params": cfg.n_params(), **{k: getattr(cfg, k) for k in (
                      "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "head_dim",
                      "tie_embeddings")}},
        "dtype": dtype_name, "weights": WEIGHTS_NOTE,
        "settings": {key: value for key, value in asdict(settings).items() if key != "out"},
        "ceilings": {name: ceiling.as_dict() for name, ceiling in ceilings.items()},
        "prefill": prefill, "decode": decode, "contenders": slim, "ratios": ratios, "scaling": scaling,
        "targets": targets, "transformers": hf_note, "same_greedy_tokens_as_transformers": same,
        # utilisations above 1: the path beat the probe it is compared with, so that probe is not its ceiling
        "above_probe": figures.above_probe({"decode_mbu_matvec": decode[0]["mbu_matvec"],
                                            "decode_mbu_copy": decode[0]["mbu_copy"], "prefill_mfu": prefill["mfu"],
                                            "graph_mbu_copy": graph_mbu}),
        "llminfer_weight_layout": ("decode: wide weights column-major (Transformer.use_decode_layout)"
                                   if settings.decode_layout and device.type == "cpu" else "row-major, as loaded"),
        "contention": {"load_average_before": load_before, "load_average_after": load_average(),
                       "cpu_cores": os.cpu_count()},
        "elapsed_s": elapsed_s,
    }


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def table(report: dict) -> str:
    """Returns the report as a plain-text table for the terminal."""
    ceilings, prefill = report["ceilings"], report["prefill"]
    who = report["machine"].get("gpu") or f"{report['machine']['cpu']} ({report['machine']['torch_threads']} threads)"
    lines = [f"llminfer bench: {report['shape']['name']} shape, {report['dtype']}, on {who}",
             f"load average before/after: {report['contention']['load_average_before']} / "
             f"{report['contention']['load_average_after']}; llminfer weights: {report['llminfer_weight_layout']}", "",
             "ceiling                 rate        measured on",
             f"copy bandwidth      {_si(ceilings['copy_bandwidth']['rate'], 'B/s'):>12}   "
             f"{ceilings['copy_bandwidth']['what']}",
             f"matvec bandwidth    {_si(ceilings['matvec_bandwidth']['rate'], 'B/s'):>12}   "
             f"{ceilings['matvec_bandwidth']['what']}",
             f"matmul rate         {_si(ceilings['matmul_flops']['rate'], 'FLOP/s'):>12}   "
             f"{ceilings['matmul_flops']['what']}", "",
             f"prefill of {prefill['prompt_len']} tokens: {prefill['tokens_per_s']:.0f} tokens/s, "
             f"{_si(prefill['flop_per_s'], 'FLOP/s')}, MFU {prefill['mfu']:.2f} of the matmul rate measured alongside "
             f"({prefill['mfu_vs_run_ceiling']:.2f} of the run's median)", "",
             "decode contender            tokens/s   ms/token   TTFT ms   tokens"]
    for name, entry in report["contenders"].items():
        lines.append(f"{name:<26} {entry['tokens_per_s']:>9.1f} {1e3 * entry['token_s']:>10.1f} "
                     f"{1e3 * entry['ttft_median_s']:>9.1f} {entry['new_tokens']:>8}")
    lines += ["", "batch   tokens/s   bytes/token   MBU (matvec alongside)   MBU (matvec, run)   MBU (copy, run)"]
    for row in report["decode"]:
        lines.append(f"{row['batch_size']:>5} {row['tokens_per_s']:>10.1f} {_si(row['bytes_per_token'], 'B'):>13} "
                     f"{row['mbu_matvec']:>24.2f} {row['mbu_matvec_vs_run_ceiling']:>19.2f} {row['mbu_copy']:>17.2f}")
    lines += ["", "context   cached ms   recompute ms   speedup   FLOP prediction   roofline prediction"]
    for row in report["scaling"]:
        lines.append(f"{row['context_len']:>7} {1e3 * row['cached_s']:>11.1f} {1e3 * row['recompute_s']:>14.1f} "
                     f"{row['speedup']:>9.1f} {row['flop_speedup']:>17.1f} {row['roofline_speedup']:>21.1f}")
    lines += ["", "target                                                        value   goal   met"]
    for target in report["targets"]:
        value = "n/a" if target["value"] is None else f"{target['value']:.2f}"
        lines.append(f"{target['figure']:<60} {value:>7} {target['target']:>6}   {target['met']}")
    if report.get("above_probe"):
        lines += ["", f"above the probe (it is not their ceiling): {', '.join(report['above_probe'])}"]
    return "\n".join(lines)


def plot(report: dict):
    """Returns a matplotlib Figure of the contenders, the batch sweep and the context scaling. Chapter 04."""
    import matplotlib.pyplot as plt

    fig, (ax_c, ax_b, ax_s) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(report["contenders"])
    speeds = [report["contenders"][n]["tokens_per_s"] for n in names]
    ax_c.barh(names, speeds, color=["tab:blue" if n.startswith("llminfer") else "tab:gray" for n in names])
    ax_c.set_xlabel("decode tokens/s (batch 1, median)")
    ax_c.invert_yaxis()
    batches = [row["batch_size"] for row in report["decode"]]
    ax_b.plot(batches, [row["tokens_per_s"] for row in report["decode"]], "o-", label="tokens/s")
    ax_b.set_xscale("log", base=2)
    ax_b.set_xlabel("batch size")
    ax_b.set_ylabel("decode tokens/s")
    twin = ax_b.twinx()
    twin.plot(batches, [row["mbu_matvec"] for row in report["decode"]], "s--", color="tab:orange")
    twin.set_ylabel("MBU (of matvec bandwidth)", color="tab:orange")
    twin.set_ylim(0, 1.1)
    contexts = [row["context_len"] for row in report["scaling"]]
    ax_s.plot(contexts, [1e3 * r["cached_s"] for r in report["scaling"]], "o-", label="with cache")
    ax_s.plot(contexts, [1e3 * r["recompute_s"] for r in report["scaling"]], "o-", label="recompute")
    ax_s.plot(contexts, [1e3 * r["cached_s"] * r["flop_speedup"] for r in report["scaling"]], ":",
              color="tab:orange", label="cached x FLOP ratio")
    ax_s.set_xscale("log", base=2)
    ax_s.set_yscale("log")
    ax_s.set_xlabel("context length (tokens)")
    ax_s.set_ylabel("ms per new token")
    ax_s.legend(fontsize=8)
    who = report["machine"].get("gpu") or report["machine"]["cpu"]
    fig.suptitle(f"llminfer bench: {report['shape']['name']} shape, {report['dtype']}, {who}")
    fig.tight_layout()
    return fig




def command(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    """`python -m llminfer.bench prefill-decode`: runs, prints the table, writes <out>/<machine>.json and .png;
    bad input exits with status 2 and one clear line. Chapter 04."""
    try:
        settings = settings_from(args)
        report = run(settings)
    except (ValueError, RuntimeError, MemoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    publish(report, settings.out, report["device_name"], table=full_table, plot=plot)
    return 0


def full_table(report: dict) -> str:
    """The report's table, and the engine section's where it ran. Chapter 04."""
    return table(report) + ("\n" + engine_table(report["engine"]) if "engine" in report else "")
