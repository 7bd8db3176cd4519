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
