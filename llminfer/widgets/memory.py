"""KV cache memory calculator over published model shapes. Chapter 04.

``memory_estimate`` is the pure function: weights and KV cache bytes for a
shape, context length, batch and dtype. The widget compares the total with
what the device can still hold (``llminfer.timing.free_memory_bytes``).

CSS classes for browser tests: ``llminfer-memory-model``, ``llminfer-memory-context``,
``llminfer-memory-batch``, ``llminfer-memory-dtype`` (inputs), ``llminfer-memory-result`` (the table).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llminfer.timing import free_memory_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float8_e4m3fn": torch.float8_e4m3fn}
GIB = 1024**3


def format_bytes(n_bytes: float) -> str:
    """A byte count with a binary unit, 3 significant digits, e.g. '1.5 GiB'. Chapter 04."""
    for unit, size in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n_bytes) >= size:
            return f"{n_bytes / size:.3g} {unit}"
    return f"{int(n_bytes)} B"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes for one model shape at a context length, batch and dtype. Chapter 04."""

    kv_bytes_per_token: int  # one sequence, all layers, K and V
    kv_bytes: int
    weight_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.weight_bytes


def memory_estimate(config, context_len: int, batch_size: int = 1,
                    dtype: torch.dtype = torch.float16) -> MemoryEstimate:
    """Weights and KV cache bytes of ``config`` holding ``context_len`` tokens per sequence. Chapter 04."""
    import llminfer

    if context_len < 1 or batch_size < 1:
        raise ValueError(f"context_len={context_len} and batch_size={batch_size} must both be at least 1")
    element_bytes = torch.empty((), dtype=dtype).element_size()
    return MemoryEstimate(
        kv_bytes_per_token=llminfer.costs.kv_bytes_per_token(config, element_bytes),
        kv_bytes=llminfer.kv_cache_bytes(config, context_len, element_bytes, batch_size),
        weight_bytes=llminfer.costs.weight_bytes(config, element_bytes),
    )


def estimate_table_html(name: str, estimate: MemoryEstimate, context_len: int, batch_size: int, dtype_name: str,
                        available: int) -> str:
    """The calculator's result as an HTML table. Chapter 04."""
    rows = [("KV cache per token (one sequence)", format_bytes(estimate.kv_bytes_per_token)),
            (f"KV cache for {batch_size} × {context_len} tokens", format_bytes(estimate.kv_bytes)),
            ("weights", format_bytes(estimate.weight_bytes)),
            ("total", format_bytes(estimate.total_bytes)),
            ("KV cache / weights", f"{estimate.kv_bytes / estimate.weight_bytes:.3g}×")]
    if available < 1 << 60:  # free_memory_bytes returns 2**62 when it cannot tell
        verdict = "fits" if estimate.total_bytes <= available else "does NOT fit"
        rows.append((f"this device has {format_bytes(available)} free", verdict))
    body = "".join(f"<tr><td>{k}</td><td style='text-align:right'><b>{v}</b></td></tr>" for k, v in rows)
    return f"<b>{name}, {dtype_name}</b><table>{body}</table>"


def build_memory_widget(presets: dict | None = None, device: str | torch.device = "cpu",
                        default: str = "llama-3-8b"):
    """A VBox: model shape, context length, batch and dtype in; weights and KV bytes out. Chapter 04."""
    import ipywidgets as widgets

    import llminfer

    presets = dict(llminfer.PRESETS if presets is None else presets)
    names = sorted(presets)
    model_pick = widgets.Dropdown(options=names, value=default if default in presets else names[0],
                                  description="model")
    context = widgets.IntSlider(value=4096, min=1, max=presets[model_pick.value].max_seq_len, step=1,
                                description="context")
    batch = widgets.IntSlider(value=1, min=1, max=256, description="batch")
    dtype_pick = widgets.Dropdown(options=list(DTYPES), value="bfloat16", description="dtype")
    result = widgets.HTML()
    for control, css in ((model_pick, "model"), (context, "context"), (batch, "batch"), (dtype_pick, "dtype"),
                         (result, "result")):
        control.add_class(f"llminfer-memory-{css}")
    message = widgets.HTML()
    message.add_class("llminfer-memory-message")
    box = widgets.VBox([model_pick, context, batch, dtype_pick, result, message])
    box.message = message
    try:                                  # the estimate still works without the device; only the verdict needs it
        available = free_memory_bytes(llminfer.resolve_device(device))
    except (ValueError, RuntimeError) as err:
        available = 1 << 62
        message.value = (f"<span style='color:#c62828'>{err}. The estimates below still hold; "
                         "the fit against free memory is left out.</span>")

    def refresh(_change=None):
        config = presets[model_pick.value]
        context.max = config.max_seq_len  # the slider cannot go past what the model was trained for
        estimate = memory_estimate(config, context.value, batch.value, DTYPES[dtype_pick.value])
        box.state = estimate
        result.value = estimate_table_html(model_pick.value, estimate, context.value, batch.value,
                                           dtype_pick.value, available)

    for control in (model_pick, context, batch, dtype_pick):
        control.observe(refresh, names="value")
    refresh()
    box.model_pick, box.context, box.batch, box.dtype_pick, box.result = model_pick, context, batch, dtype_pick, result
    return box
