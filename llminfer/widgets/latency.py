"""Per-token latency with and without the KV cache, measured on the reader's device. Chapter 04.

``plan_run`` checks a request (device present, lengths within the model's
limit, memory estimate within what is free) before anything is allocated.
``time_generation`` runs one greedy generation step by step and times every
step with ``llminfer.timing.time_fn`` (CUDA events on a GPU, the
``torch.utils.benchmark`` clock elsewhere): step 0 is the prefill (TTFT), each
later step one decoded token. ``context_sweep`` times a single step at chosen
context lengths. ``summarize`` turns two runs into TTFT, TPOT and speedups.

CSS classes for browser tests: ``llminfer-latency-run`` (the Run button),
``llminfer-latency-plot`` (the figure), ``llminfer-latency-summary`` (the numbers
or the refusal message), ``llminfer-latency-prompt``, ``llminfer-latency-new``,
``llminfer-latency-model``, ``llminfer-latency-device`` (the inputs).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from llminfer import timing
from llminfer.device import check_fits, dtype_bytes

BENCHMARK_DIR = Path(__file__).resolve().parents[2] / "data" / "benchmarks"


def step_times(run) -> list[float]:
    """Seconds of each step of a GenerationResult: [0] the prefill (TTFT), then each inter-token gap. Chapter 04."""
    return [run.ttft_s, *run.itl_s]


def estimate_run_bytes(config, prompt_len: int, new_tokens: int, dtype: torch.dtype) -> int:
    """Bytes a timing run needs at its peak: weights, then the larger of the cached and uncached runs. Chapter 04."""
    from llminfer import costs

    element = dtype_bytes(dtype)
    weights = config.n_params() * element
    runs = (costs.generation_bytes(config, 1, prompt_len, new_tokens, element, use_cache=use_cache)
            for use_cache in (True, False))
    return weights + max(runs)


def plan_run(config, prompt_len: int, new_tokens: int, device: str, dtype: torch.dtype) -> int:
    """The run's memory estimate in bytes; raises ValueError, RuntimeError or MemoryError saying the fix. Chapter 04."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was chosen but this machine has no CUDA GPU "
                           f"(torch {torch.__version__}); choose 'cpu'")
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"prompt_len={prompt_len} and new_tokens={new_tokens} must both be at least 1")
    if prompt_len + new_tokens > config.max_seq_len:
        raise ValueError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the model's "
                         f"max_seq_len={config.max_seq_len}; shorten the prompt or generate fewer tokens")
    needed = estimate_run_bytes(config, prompt_len, new_tokens, dtype)
    dtype_name = str(dtype).replace("torch.", "")
    check_fits(needed, device, f"{config.n_params() / 1e6:,.0f}M parameters in {dtype_name} with a KV cache "
                      f"of {prompt_len + new_tokens} positions")
    return needed


def time_generation(model, prompt_ids: list[int], new_tokens: int, use_cache: bool):
    """Greedy generation of new_tokens, every token timed: `llminfer.generate`'s GenerationResult. Chapter 04."""
    import llminfer

    return llminfer.generate(model, prompt_ids, max_new_tokens=new_tokens, use_cache=use_cache, ignore_eos=True)


def median_run(runs: list):
    """One GenerationResult whose every step time is the median over runs (which must agree on tokens). Chapter 04."""
    import llminfer

    steps = [statistics.median(times) for times in zip(*(step_times(run) for run in runs))]
    first = runs[0]
    return llminfer.GenerationResult(first.token_ids, steps[0], steps[1:], sum(steps), first.num_prompt_tokens,
                                     first.use_cache)


def measure_both(model, prompt_len: int, new_tokens: int, repeats: int = 3, seed: int = 0) -> dict:
    """Median step times with ('cached') and without ('recomputed') the cache on a random prompt, the two taking
    turns after one warm-up run each (`llminfer.timing.interleave`). Chapter 04."""
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=generator).tolist()
    runs = timing.interleave({name: (lambda use_cache=use_cache: time_generation(model, prompt, new_tokens, use_cache))
                              for name, use_cache in (("cached", True), ("recomputed", False))}, repeats, warmup=1)
    return {name: median_run(found) for name, found in runs.items()}


def summarize(runs: dict, config=None) -> dict[str, float]:
    """TTFT, TPOT and the decode speedup of the cache, measured and (with config) predicted from FLOPs. Chapter 04."""
    cached, recomputed = runs["cached"], runs["recomputed"]
    summary = {"ttft_cached_s": cached.ttft_s, "ttft_recomputed_s": recomputed.ttft_s,
               "tpot_cached_s": cached.tpot_s, "tpot_recomputed_s": recomputed.tpot_s,
               "tpot_speedup": recomputed.tpot_s / cached.tpot_s,
               "total_speedup": recomputed.e2e_s / cached.e2e_s}
    if config is not None:
        from llminfer import costs

        new_tokens = len(step_times(cached))
        summary["predicted_speedup"] = costs.cache_vs_recompute_flops(config, cached.num_prompt_tokens,
                                                                      new_tokens).speedup
    return summary


@torch.inference_mode()
def context_sweep(model, context_lens: list[int], repeats: int = 3, progress: bool = True) -> dict[str, list[float]]:
    """Median seconds of one decode step at each context length, cached and recomputed. Chapter 04."""
    import llminfer

    if max(context_lens) > model.config.max_seq_len:
        raise ValueError(f"context length {max(context_lens)} exceeds max_seq_len={model.config.max_seq_len}; "
                         "drop it from context_lens")
    device = model.device
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, max(context_lens)), generator=generator).to(device)
    cached, recomputed = [], []
    lengths = context_lens
    if progress:
        from tqdm.auto import tqdm

        lengths = tqdm(context_lens, desc="context lengths")
    for length in lengths:
        cache = model.new_cache(batch_size=1, max_seq_len=length)
        if length > 1:
            llminfer.prefill(model, ids[:, : length - 1], cache)  # positions 0 .. length-2, untimed
        last = ids[:, length - 1]  # (1,)
        def step():                       # one decode step at position length - 1, then rolled back
            llminfer.decode_step(model, last, cache, check_ids=False)
            cache.truncate(length - 1)
        cached.append(timing.time_fn(step, device, warmup=1, repeats=repeats).median_s)
        recomputed.append(timing.time_fn(lambda: model(ids[:, :length], last_only=True), device,
                                         warmup=1, repeats=repeats).median_s)
    return {"context_len": list(context_lens), "cached_s": cached, "recomputed_s": recomputed}


def load_reference_results(folder: Path = BENCHMARK_DIR, gpu_only: bool = True) -> list[dict]:
    """Context-scaling curves from `python -m llminfer.bench` reports in data/benchmarks/*.json. Chapter 04.

    Each is {"name", "context_len", "cached_s", "recomputed_s"}; a bench row's context_len counts the cached
    positions, so one is added to count the new token too, as ``context_sweep`` does.
    """
    results = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if not isinstance(report, dict) or report.get("schema") != 1 or not report.get("scaling"):
            continue
        gpu = (report.get("machine") or {}).get("gpu")
        if gpu_only and not gpu:
            continue
        rows = sorted(report["scaling"], key=lambda row: row["context_len"])
        shape = (report.get("shape") or {}).get("name", "?")
        results.append({"name": f"{gpu or report.get('device_name', path.stem)}, {shape}, {report.get('dtype', '?')}",
                        "context_len": [row["context_len"] + 1 for row in rows],
                        "cached_s": [row["cached_s"] for row in rows],
                        "recomputed_s": [row["recompute_s"] for row in rows]})
    return results


def plot_runs(ax, runs: dict) -> None:
    """Milliseconds per step against context length, one line per strategy. Chapter 04."""
    for name, style in (("recomputed", "o-"), ("cached", "s-")):
        run = runs[name]
        contexts = [run.num_prompt_tokens + i for i in range(1, len(run.itl_s) + 1)]
        ax.plot(contexts, [s * 1e3 for s in run.itl_s], style, markersize=3,
                label=f"{'without' if name == 'recomputed' else 'with'} cache")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("ms per decoded token")
    ax.legend()


@dataclass
class LatencyState:
    """What the timing widget shows: the refusal message, or the runs and their summary. Chapter 04."""

    message: str = ""
    runs: dict | None = None
    summary: dict | None = None


def _load(name: str, config, device: str, dtype: torch.dtype):
    """The model to time: the bundled one by name, a preset with random weights, or a bare config."""
    import llminfer

    if name == "tiny-capitals":
        return llminfer.load_pretrained(name, device=device, dtype=dtype)[0]
    return llminfer.load_random(name if name in llminfer.PRESETS else config, device=device, dtype=dtype)


def default_shapes() -> dict:
    """Model shapes the widget offers: the bundled model, then every preset. Chapter 04."""
    import llminfer
    from llminfer.config import ModelConfig

    shapes = {}
    bundled = Path(__file__).resolve().parents[2] / "data" / "models" / "tiny-capitals" / "config.json"
    if bundled.is_file():
        shapes["tiny-capitals"] = ModelConfig.from_hf(json.loads(bundled.read_text()))
    shapes.update(llminfer.PRESETS)
    return shapes


def build_latency_widget(shapes: dict | None = None, default: str = "smollm2-135m", repeats: int = 1):
    """A VBox: prompt, new tokens, model shape, device, Run; latency curves, TTFT, TPOT, speedup. Chapter 04."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    shapes = default_shapes() if shapes is None else dict(shapes)
    names = list(shapes)
    model_pick = widgets.Dropdown(options=names, value=default if default in shapes else names[0],
                                  description="model")
    prompt_len = widgets.IntSlider(value=32, min=1, max=1024, description="prompt")
    new_tokens = widgets.IntSlider(value=16, min=2, max=256, description="new tokens")
    device_pick = widgets.Dropdown(options=["cpu", "cuda"], value="cuda" if torch.cuda.is_available() else "cpu",
                                   description="device")
    run_button = widgets.Button(description="Run", button_style="primary")
    summary_view, plot_view = widgets.HTML(), widgets.Output()
    for control, css in ((model_pick, "model"), (prompt_len, "prompt"), (new_tokens, "new"),
                         (device_pick, "device"), (run_button, "run"), (summary_view, "summary"),
                         (plot_view, "plot")):
        control.add_class(f"llminfer-latency-{css}")
    box = widgets.VBox([widgets.HBox([model_pick, device_pick]), prompt_len, new_tokens, run_button,
                        summary_view, plot_view])
    box.state = LatencyState()
    loaded = {}

    def bound_sliders(_change=None):
        limit = shapes[model_pick.value].max_seq_len
        new_tokens.max = min(256, limit - 1)
        # prompt + new tokens never exceed max_seq_len; a CPU recomputing 1024 tokens per step is slow enough
        longest = 4096 if device_pick.value == "cuda" else 1024
        prompt_len.max = min(longest, limit - new_tokens.value)

    def run(_button=None):
        name, device = model_pick.value, device_pick.value
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        try:
            plan_run(shapes[name], prompt_len.value, new_tokens.value, device, dtype)
        except (ValueError, RuntimeError, MemoryError) as err:
            box.state = LatencyState(message=str(err))
            summary_view.value = f"<span style='color:#c62828'>{err}</span>"
            return
        summary_view.value = "running…"
        key = (name, device, dtype)
        if key not in loaded:
            loaded.clear()  # hold one model at a time
            loaded[key] = _load(name, shapes[name], device, dtype).eval()
        runs = measure_both(loaded[key], prompt_len.value, new_tokens.value, repeats=repeats)
        summary = summarize(runs, shapes[name])
        box.state = LatencyState(runs=runs, summary=summary)
        summary_view.value = (
            f"{name} on {device} ({str(dtype).replace('torch.', '')}): "
            f"TTFT {summary['ttft_cached_s'] * 1e3:.3g} ms · "
            f"TPOT {summary['tpot_cached_s'] * 1e3:.3g} ms with cache, "
            f"{summary['tpot_recomputed_s'] * 1e3:.3g} ms without · "
            f"speedup {summary['total_speedup']:.3g}× measured, {summary['predicted_speedup']:.3g}× from FLOPs")
        plot_view.clear_output(wait=True)
        with plot_view:
            fig, ax = plt.subplots(figsize=(6, 3.5))
            plot_runs(ax, runs)
            ax.set_title(f"{name}, prompt {prompt_len.value}, {new_tokens.value} new tokens")
            plt.show()
            plt.close(fig)

    for control in (model_pick, new_tokens, device_pick):
        control.observe(bound_sliders, names="value")
    run_button.on_click(run)
    bound_sliders()
    box.model_pick, box.prompt_len, box.new_tokens, box.device_pick = model_pick, prompt_len, new_tokens, device_pick
    box.run_button, box.summary_view, box.plot_view = run_button, summary_view, plot_view
    return box
