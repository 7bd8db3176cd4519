"""Quantize the bundled model at a chosen bit width and group size, and see what it costs. Chapter 08.

``quantization_run`` is the pure function: it quantizes a copy of the model, and returns the rounding
error of one weight matrix (in units of its own step), the capitals a sample of countries still gets
right, the bytes a decode step reads, and the measured decode speed. The widget draws it.

CSS classes for browser tests: ``llminfer-quant-bits``, ``llminfer-quant-group``, ``llminfer-quant-matrix``
(inputs), ``llminfer-quant-run`` (the Run button), ``llminfer-quant-result`` (the numbers or the refusal),
``llminfer-quant-plot`` (the histogram).
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass

import torch

GROUPS = {"per channel": None, "32": 32, "64": 64, "128": 128}
BITS = (2, 3, 4, 8)


@dataclass
class QuantizationRun:
    """What one setting costs on the bundled model. Chapter 08."""
    bits: int
    group_size: int | None
    matrix: str
    error_in_steps: torch.Tensor     # (N·K,) (dequantized − float) / step, within ±0.5
    relative_error: float            # ‖W_q − W‖ / ‖W‖ of the matrix
    correct: int
    total: int
    weight_bytes: int
    float_bytes: int
    tokens_per_s: float


def linear_names(model) -> list[str]:
    """Names of the model's nn.Linear layers, the matrices the widget can inspect. Chapter 08."""
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def quantization_run(model, tokenizer, bits: int, group_size: int | None, matrix: str, n_countries: int = 40,
                     new_tokens: int = 16) -> QuantizationRun:
    """Quantizes a copy of model and measures error, accuracy, bytes and decode speed. Chapter 08."""
    import llminfer
    from llminfer.quant import accuracy, quantize, quantized_weight_bytes
    from llminfer.quant.weights import check_scheme, quantize_tensor, dequantize

    names = linear_names(model)
    if matrix not in names:
        raise ValueError(f"matrix {matrix!r} is not a linear layer of the model; choose one of {names[:4]}...")
    if bits == 8 and group_size is not None:
        raise ValueError("int8 uses one scale per output channel; choose 'per channel' for 8 bits")
    weight = model.get_submodule(matrix).weight.detach()
    check_scheme(bits, group_size, weight.shape[1])                  # refuses a group that does not divide
    qt = quantize_tensor(weight, bits, "channel" if group_size is None else "group", group_size)
    error = dequantize(qt) - weight.float()
    quantized = quantize(copy.deepcopy(model), f"int{bits}", group_size)
    countries = accuracy.load_countries()[:: max(1, 195 // n_countries)][:n_countries]
    correct = sum(accuracy.capitals_correct(quantized, tokenizer, countries))
    prompt = tokenizer.encode("The capital of France is")
    runs = [llminfer.generate(quantized, prompt, max_new_tokens=new_tokens, ignore_eos=True) for _ in range(3)]
    gaps = [gap for run in runs for gap in run.itl_s]
    return QuantizationRun(bits, group_size, matrix, (error / qt.step).flatten(),
                           float(error.norm() / weight.float().norm()), correct, len(countries),
                           quantized_weight_bytes(quantized), quantized_weight_bytes(model),
                           1.0 / statistics.median(gaps))


def draw(run: QuantizationRun):
    """The histogram of one matrix's rounding errors, in steps. Chapter 08."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.hist(run.error_in_steps.cpu().numpy(), bins=60, color="tab:blue")
    ax.axvline(-0.5, color="tab:red", linestyle="--", label="± half a step")
    ax.axvline(0.5, color="tab:red", linestyle="--")
    group = "per channel" if run.group_size is None else f"groups of {run.group_size}"
    ax.set_title(f"{run.matrix}: int{run.bits}, {group}")
    ax.set_xlabel("rounding error (steps of its own block)")
    ax.set_ylabel("weights")
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


BLOCK_COLOURS = {"scale": "#fdd0a2", "minimum": "#c7e9c0", "codes": "white", "low": "tab:blue", "high": "tab:purple"}


def plot_q4_1_block(axes, raw, scale: float, minimum: float, codes) -> None:
    """One Q4_1 block drawn from its bytes (chapter 08's concept figure). axes: two matplotlib axes. The top one
    shows the 20 bytes in hex: the float16 scale d (bytes 0-1), the float16 minimum m (2-3), then 16 bytes of
    codes, each holding weight j in its low nibble and weight j + 16 in its high nibble (the nibble values under
    it). The bottom one shows the 32 weights rebuilt, w = code · d + m, on the block's 16 levels. scale, minimum
    and codes are what the caller read from raw, so the figure shows the caller's decoding. Chapter 08."""
    import numpy as np

    raw, codes = np.asarray(raw, dtype=np.uint8), np.asarray(codes)
    if raw.shape != (20,) or codes.shape != (32,):
        raise ValueError(f"a Q4_1 block is 20 bytes holding 32 codes; got bytes of shape {raw.shape} and codes of "
                         f"shape {codes.shape}: pass one block, e.g. bytes [0:20] of a row")
    from matplotlib.patches import Rectangle

    top, bottom = axes
    top.set_axis_off()
    regions = ["scale"] * 2 + ["minimum"] * 2 + ["codes"] * 16
    for i, (byte, region) in enumerate(zip(raw, regions)):
        face = BLOCK_COLOURS[region]
        top.add_patch(Rectangle((i, 0), 0.92, 1, facecolor=face, edgecolor="#555555"))
        top.text(i + 0.46, 0.5, f"{byte:02x}", ha="center", va="center", fontsize=8, family="monospace")
        if region == "codes":
            top.text(i + 0.46, -0.35, str(byte & 0x0F), ha="center", va="center", fontsize=7,
                     color=BLOCK_COLOURS["low"])
            top.text(i + 0.46, -0.8, str(byte >> 4), ha="center", va="center", fontsize=7, color=BLOCK_COLOURS["high"])
    top.text(0.96, 1.2, f"scale d\n{scale:.4g}", ha="center", va="bottom", fontsize=8)
    top.text(2.96, 1.2, f"minimum m\n{minimum:.4g}", ha="center", va="bottom", fontsize=8)
    top.text(12, 1.2, "codes: byte 4 + j holds weight j (low nibble) and weight j + 16 (high nibble)",
             ha="center", va="bottom", fontsize=8)
    top.text(-0.3, -0.35, "low", ha="right", va="center", fontsize=7, color=BLOCK_COLOURS["low"])
    top.text(-0.3, -0.8, "high", ha="right", va="center", fontsize=7, color=BLOCK_COLOURS["high"])
    top.set_xlim(-1.5, 20.2)
    top.set_ylim(-1.1, 2.1)
    for level in range(16):
        bottom.axhline(minimum + level * scale, color="#dddddd", lw=0.8, zorder=0)
    index = np.arange(32)
    weights = codes * np.float32(scale) + np.float32(minimum)
    for half, colour in ((index < 16, BLOCK_COLOURS["low"]), (index >= 16, BLOCK_COLOURS["high"])):
        bottom.scatter(index[half], weights[half], s=18, color=colour, zorder=3)
    bottom.set_xlabel("weight j of the block")
    bottom.set_ylabel("w = code · d + m")
    codes_axis = bottom.twinx()                                  # the same levels, named by their codes
    codes_axis.set_ylim(bottom.get_ylim())
    codes_axis.set_yticks([minimum + k * scale for k in (0, 5, 10, 15)], ["0", "5", "10", "15"])
    codes_axis.set_ylabel("code")
    bottom.set_title("the 32 weights on the block's 16 levels (grey): code 0 is m, code 15 is m + 15d", fontsize=9)


def summary_html(run: QuantizationRun) -> str:
    """The run's numbers as an HTML table. Chapter 08."""
    rows = [("capitals right", f"{run.correct} / {run.total}"),
            ("relative error of the matrix", f"{run.relative_error:.3g}"),
            ("bytes read per token", f"{run.weight_bytes / 2**20:.3g} MiB (float: {run.float_bytes / 2**20:.3g} MiB)"),
            ("decode speed", f"{run.tokens_per_s:.0f} tokens/s")]
    body = "".join(f"<tr><td>{k}</td><td style='text-align:right'><b>{v}</b></td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def build_quantization_widget(model, tokenizer):
    """A VBox: bits, group size and a weight matrix in; error histogram, accuracy, bytes, speed out. Chapter 08."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    bits = widgets.SelectionSlider(options=list(BITS), value=4, description="bits")
    group = widgets.Dropdown(options=list(GROUPS), value="32", description="group")
    names = linear_names(model)
    matrix = widgets.Dropdown(options=names, value=names[0], description="matrix")
    run_button = widgets.Button(description="Run", button_style="primary")
    result = widgets.HTML()
    plot = widgets.Output()
    for control, name in ((bits, "bits"), (group, "group"), (matrix, "matrix"), (run_button, "run"),
                          (result, "result"), (plot, "plot")):
        control.add_class(f"llminfer-quant-{name}")

    def on_run(_=None):
        result.value = "<i>quantizing and measuring…</i>"
        plot.clear_output()
        try:
            run = quantization_run(model, tokenizer, bits.value, GROUPS[group.value], matrix.value)
        except ValueError as error:
            result.value = f"<b>Cannot run:</b> {error}"
            return
        result.value = summary_html(run)
        with plot:
            fig = draw(run)
            display(fig)
            plt.close(fig)

    run_button.on_click(on_run)
    return widgets.VBox([widgets.HBox([bits, group]), matrix, run_button, result, plot])
