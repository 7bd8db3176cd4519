"""Attention on a handful of tokens: edit the query or a key and watch scores, weights and output follow. Chapter 02.

Everything drawn comes from the pure function ``attention_state(query, keys, values, tokens, scaled)``,
which runs ``llminfer.attention.attention`` on one query and returns an ``AttentionState``:
the raw scores q·k, the scale used, the softmax weights and the output (the weighted mix of the values).
``format_row`` and ``format_vector`` turn its numbers into the text the widget shows, e.g.
``"I 0.212 · love 0.212 · AI 0.576"`` and ``"[1.940, 1.000]"``.

``attention_widget()`` builds the ipywidgets box and displays nothing itself. The box keeps the last
computed state in ``box.state`` and its inputs in ``box.query_inputs`` and ``box.key_inputs``.

CSS classes for browser tests: ``llminfer-attn-query`` (the query inputs), ``llminfer-attn-q0`` and
``llminfer-attn-q1`` (one input each), ``llminfer-attn-keys`` (the key inputs), ``llminfer-attn-k{i}-{j}``
(component j of token i's key), ``llminfer-attn-scaled`` (the 1/√d checkbox), ``llminfer-attn-scores``,
``llminfer-attn-weights`` and ``llminfer-attn-output`` (the three lines of text), ``llminfer-attn-chart``
(the bar chart of the weights).
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch

from llminfer.attention import attention

# The worked example of chapter 02: three tokens with two-dimensional keys and values.
EXAMPLE_TOKENS = ("I", "love", "AI")
EXAMPLE_KEYS = ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0))
EXAMPLE_VALUES = ((1.0, 0.0), (0.0, 2.0), (3.0, 1.0))
EXAMPLE_QUERY = (1.0, 1.0)
INPUT_BOUND = 5.0  # query and key components are kept within [-INPUT_BOUND, INPUT_BOUND]
INPUT_STEP = 0.5
SEPARATOR = " · "


@dataclass(frozen=True)
class AttentionState:
    """One query attending over a few tokens: what the chapter 02 widget draws."""

    tokens: tuple[str, ...]
    query: tuple[float, ...]
    keys: tuple[tuple[float, ...], ...]
    values: tuple[tuple[float, ...], ...]
    scale: float
    scores: tuple[float, ...]   # q·k for each token, before scaling
    weights: tuple[float, ...]  # softmax(scale · scores), sums to 1
    output: tuple[float, ...]   # sum of weight × value


def _as_matrix(name: str, rows, n_rows: int, n_cols: int | None) -> torch.Tensor:
    """Returns rows as a float64 (n_rows, n_cols) tensor, or raises ValueError naming the bad shape or value."""
    matrix = torch.as_tensor(rows, dtype=torch.float64)
    if matrix.dim() != 2 or matrix.shape[0] != n_rows or (n_cols is not None and matrix.shape[1] != n_cols):
        want = f"({n_rows}, {n_cols if n_cols is not None else 'd'})"
        raise ValueError(f"{name} has shape {tuple(matrix.shape)}; expected {want}: one row per token")
    if not torch.isfinite(matrix).all():
        raise ValueError(f"{name} contains a value that is not finite: {matrix.tolist()}; use finite numbers")
    return matrix


def attention_state(query, keys=EXAMPLE_KEYS, values=EXAMPLE_VALUES, tokens=EXAMPLE_TOKENS,
                    scaled: bool = False) -> AttentionState:
    """Returns the AttentionState of one query over the tokens (scale 1, or 1/√d if scaled). Chapter 02."""
    tokens = tuple(str(t) for t in tokens)
    if not tokens:
        raise ValueError("tokens is empty; attention needs at least one token to look at")
    q = torch.as_tensor(query, dtype=torch.float64)
    if q.dim() != 1:
        raise ValueError(f"query has shape {tuple(q.shape)}; expected a single vector (d,)")
    k = _as_matrix("keys", keys, len(tokens), q.shape[0])
    v = _as_matrix("values", values, len(tokens), None)
    if not torch.isfinite(q).all():
        raise ValueError(f"query contains a value that is not finite: {q.tolist()}; use finite numbers")
    scale = 1.0 / math.sqrt(q.shape[0]) if scaled else 1.0
    output, weights = attention(q[None, :], k, v, causal=False, scale=scale)  # (1, d_v), (1, T)
    scores = k @ q  # (T,)
    return AttentionState(
        tokens=tokens,
        query=tuple(q.tolist()),
        keys=tuple(tuple(row) for row in k.tolist()),
        values=tuple(tuple(row) for row in v.tolist()),
        scale=scale,
        scores=tuple(scores.tolist()),
        weights=tuple(weights[0].tolist()),
        output=tuple(output[0].tolist()),
    )


def format_row(tokens, numbers, digits: int = 3) -> str:
    """Returns 'I 0.212 · love 0.212 · AI 0.576': each token with its number. Chapter 02."""
    if len(tokens) != len(numbers):
        raise ValueError(f"{len(tokens)} tokens but {len(numbers)} numbers; pass one number per token")
    return SEPARATOR.join(f"{token} {number:.{digits}f}" for token, number in zip(tokens, numbers))


def format_vector(numbers, digits: int = 3) -> str:
    """Returns '[1.940, 1.000]'. Chapter 02."""
    return "[" + ", ".join(f"{number:.{digits}f}" for number in numbers) + "]"


def weights_figure(state: AttentionState):
    """Returns a matplotlib Figure: one bar per token, its attention weight written on top. Chapter 02."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.0, 2.4), dpi=100)
    ax = fig.add_subplot()
    bars = ax.bar(state.tokens, state.weights, color="#1565c0")
    ax.bar_label(bars, labels=[f"{w:.3f}" for w in state.weights])
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("attention weight")
    scale = "1" if state.scale == 1.0 else f"1/√{len(state.query)}"
    ax.set_title(f"query {format_vector(state.query, 1)}, scale {scale}", fontsize=10)
    fig.tight_layout()
    return fig


def figure_png(fig) -> bytes:
    """Returns the figure rendered as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _bounded_input(value: float, description: str, css_class: str):
    """Returns a BoundedFloatText kept within ±INPUT_BOUND, tagged with css_class."""
    import ipywidgets as widgets

    if not -INPUT_BOUND <= value <= INPUT_BOUND:
        raise ValueError(f"{description}={value} is outside [-{INPUT_BOUND}, {INPUT_BOUND}]; pick a smaller value")
    box = widgets.BoundedFloatText(value=value, min=-INPUT_BOUND, max=INPUT_BOUND, step=INPUT_STEP,
                                   description=description, layout=widgets.Layout(width="140px"),
                                   style={"description_width": "50px"})
    box.add_class(css_class)
    return box


def attention_widget(query=EXAMPLE_QUERY, keys=EXAMPLE_KEYS, values=EXAMPLE_VALUES, tokens=EXAMPLE_TOKENS,
                     scaled: bool = False):
    """Returns an ipywidgets VBox to edit the query and keys and see scores, weights and output. Chapter 02."""
    import ipywidgets as widgets

    first = attention_state(query, keys, values, tokens, scaled)  # validates everything before building
    if len(first.query) != 2:
        raise ValueError(f"the widget edits two-dimensional queries; got d={len(first.query)}")

    query_inputs = [_bounded_input(x, f"q[{j}]", f"llminfer-attn-q{j}") for j, x in enumerate(first.query)]
    key_inputs = [[_bounded_input(x, f"[{j}]", f"llminfer-attn-k{i}-{j}") for j, x in enumerate(key)]
                  for i, key in enumerate(first.keys)]
    scaled_box = widgets.Checkbox(value=scaled, description="scale scores by 1/√d", indent=False)
    scaled_box.add_class("llminfer-attn-scaled")
    scores_html, weights_html, output_html = widgets.HTML(), widgets.HTML(), widgets.HTML()
    for html_widget, name in ((scores_html, "scores"), (weights_html, "weights"), (output_html, "output")):
        html_widget.add_class(f"llminfer-attn-{name}")
    chart = widgets.Image(format="png", layout=widgets.Layout(width="400px"))
    chart.add_class("llminfer-attn-chart")

    def label(text, width="90px"):
        return widgets.Label(text, layout=widgets.Layout(width=width))

    query_row = widgets.HBox([label("query"), *query_inputs])
    query_row.add_class("llminfer-attn-query")
    key_rows = widgets.VBox([
        widgets.HBox([label(f"key of {token}"), *row, label(f"value {format_vector(value, 0)}", "120px")])
        for token, row, value in zip(first.tokens, key_inputs, first.values)
    ])
    key_rows.add_class("llminfer-attn-keys")

    readout = widgets.VBox([
        widgets.HBox([label("scores"), scores_html]),
        widgets.HBox([label("weights"), weights_html]),
        widgets.HBox([label("output"), output_html]),
    ])
    message = widgets.HTML()
    message.add_class("llminfer-attn-message")
    box = widgets.VBox([query_row, key_rows, scaled_box, readout, message, chart])
    box.message = message
    box.add_class("llminfer-attn")
    box.query_inputs, box.key_inputs, box.scaled_box = query_inputs, key_inputs, scaled_box
    box.scores_html, box.weights_html, box.output_html, box.chart = scores_html, weights_html, output_html, chart

    def show(state: AttentionState) -> None:
        box.state = state
        scores_html.value = format_row(state.tokens, [s * state.scale for s in state.scores])
        weights_html.value = format_row(state.tokens, state.weights)
        output_html.value = format_vector(state.output)
        chart.value = figure_png(weights_figure(state))

    def update(_change=None) -> None:
        try:
            state = attention_state(
                [w.value for w in query_inputs],
                [[w.value for w in row] for row in key_inputs],
                first.values, first.tokens, scaled_box.value,
            )
        except ValueError as err:              # e.g. NaN typed into a box: say so, keep the last good result
            message.value = f"<span style='color:#c62828'>{err}</span>"
            return
        message.value = ""
        show(state)

    for w in (*query_inputs, *(w for row in key_inputs for w in row), scaled_box):
        w.observe(update, names="value")
    show(first)
    return box
