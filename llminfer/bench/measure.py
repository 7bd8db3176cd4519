"""The measurements of `python -m llminfer.bench`: prefill and decode beside the machine's measured ceilings and beside transformers. Chapter 04.

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
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import costs, timing
from ..checkpoint import bundled_models, load_random, model_folder
from ..config import ModelConfig, get_preset
from ..device import check_fits, dtype_bytes, resolve_device
from ..generate import decode_step, generate, prefill
from . import figures, report as bench_report, transformers_contender

__all__ = ["Settings", "parse_args", "check_settings", "estimate_bytes", "run", "main"]

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


def parse_args(argv: list[str] | None = None) -> Settings:
    """Returns the Settings given on the command line. Chapter 04."""
    parser = argparse.ArgumentParser(prog="python -m llminfer.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run for tests (< 2 minutes)")
    parser.add_argument("--shape", help="preset shape, e.g. smollm2-135m, llama-3.2-1b")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when present)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--prompt-len", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--batch-sizes", type=_int_list, help="comma-separated, e.g. 1,4,16")
    parser.add_argument("--contexts", type=_int_list, help="context lengths for scaling, e.g. 128,512,2048")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--threads", type=int, help="CPU threads for every contender (default: torch's)")
    parser.add_argument("--no-transformers", dest="transformers", action="store_false")
    parser.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false")
    parser.add_argument("--no-decode-layout", dest="decode_layout", action="store_false",
                        help="time llminfer with its weights in the default (row-major) order")
    parser.add_argument("--out", help="folder for the JSON and PNG (default data/benchmarks)")
    parser.add_argument("--engine", dest="engine", action="store_true", default=None,
                        help="run the engine section (CPU; on by default, off with --quick)")
    parser.add_argument("--no-engine", dest="engine", action="store_false",
                        help="skip the engine section: 8 requests through LLMEngine vs one fast request")
    args = parser.parse_args(argv)
    given = {name: value for name, value in vars(args).items()
             if value is not None and name not in ("quick", "transformers", "cuda_graphs", "decode_layout")}
    given.update(transformers=args.transformers, cuda_graphs=args.cuda_graphs, decode_layout=args.decode_layout)
    return Settings.quick_run(**given) if args.quick else Settings(**given)


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


def shape_config(shape: str) -> ModelConfig:
    """Returns the config of a published shape (PRESETS) or of a bundled model, by name."""
    if shape in bundled_models():
        return ModelConfig.from_hf(json.loads((model_folder(shape) / "config.json").read_text()))
    return get_preset(shape)                                 # an unknown shape: ValueError naming the known ones


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
    times, alongside = [], []
    one_prefill()                                                            # warm-up
    for _ in range(max(3, settings.repeats)):
        times += timing.time_fn(one_prefill, model.device, 0, 1).times_s
        alongside += probes["matmul_flops"].sample()
    result = timing.TimingResult.from_times(times)
    return {"median_s": result.median_s, "iqr_s": result.iqr_s,
            "matmul_flop_per_s_alongside": probes["matmul_flops"].rate_of(alongside)}


def bench_contenders(model, cfg, ids, settings, hf_model, probes) -> dict[str, dict]:
    """Returns per-token decode latencies of each contender, the contenders taking turns per repeat."""
    def llminfer_run(use_cache):
        n = settings.new_tokens if use_cache else settings.recompute_new_tokens + 1
        return generate(model, ids, max_new_tokens=n, use_cache=use_cache)

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
    for runner in runners.values():                        # warm-up: allocators, kernels, graph capture
        runner()
    found = {name: {"ttft_s": [], "latencies_s": [], "repeat_medians_s": []} for name in runners}
    alongside = []
    for _ in range(settings.repeats):
        for name, runner in runners.items():
            result = runner()                                  # a GenerationResult, whoever made it
            found[name]["ttft_s"].append(result.ttft_s)
            found[name]["latencies_s"].extend(result.itl_s)
            found[name]["repeat_medians_s"].append(statistics.median(result.itl_s))
            found[name]["token_ids"] = result.token_ids
        alongside += probes["matvec_bandwidth"].sample(2)   # the ceilings, under the same load as this round
        probes["copy_bandwidth"].sample()
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
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(settings.threads or threads)
        return _measure(settings, device, dtype, cfg)
    finally:
        torch.set_num_threads(threads)


def _measure(settings: Settings, device, dtype, cfg) -> dict:
    started, load_before = time.perf_counter(), bench_report.load_average()
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
            latencies[batch] += generate(model, batch_ids, max_new_tokens=settings.new_tokens).itl_s
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
        from .engine_decode import EngineSettings, engine_section
        print("[bench] engine section", file=sys.stderr)
        engine = engine_section(EngineSettings(shape=settings.shape or "smollm2-135m", threads=settings.threads or 2))
    report = bench_report.assemble(settings=settings, device=device, dtype=dtype, cfg=cfg, ceilings=ceilings,
                                 prefill=prefill_figures, contenders=contenders, decode=decode, scaling=scaling,
                                 hf_note=hf_note, elapsed_s=time.perf_counter() - started,
                                 load_before=load_before)
    if engine is not None:
        report["engine"] = engine
    return report


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark from the command line; bad input exits with status 2 and one clear line."""
    try:
        settings = parse_args(argv)
        report = run(settings)
    except (ValueError, RuntimeError, MemoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(bench_report.table(report))
    if "engine" in report:
        from .engine_decode import engine_table
        print(engine_table(report["engine"]))
    json_path, png_path = bench_report.write(report, Path(settings.out))
    print(f"\nwrote {json_path} and {png_path}")
    return 0

