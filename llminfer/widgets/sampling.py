"""What each stage of the sampling pipeline does to a next-token distribution, drawn. Chapter 13.

Everything drawn comes from ``llminfer.sampling.stages(logits, settings, history)``, the distribution after each
stage (model, penalties, mask, temperature, top-k, top-p, min-p), through two functions:

- ``stage_table(stage_probs, top_n)``: the tokens to show (the ``top_n`` most likely at any stage, ordered by the
  model's own probability), each stage's probability of each, and how many tokens each stage leaves;
- ``stages_figure(stage_probs, tokenizer, top_n)``: a matplotlib Figure with one panel per stage, a bar per token,
  and in each panel's title how many tokens are left;
- ``build_sampling_widget(logits, tokenizer, history, settings)``: sliders for each setting, a line saying what the
  pipeline leaves (``summary_line``) and the figure, redrawn as a slider moves.

Nothing displays at import.
"""
from __future__ import annotations

import dataclasses
import html
import io
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StageTable:
    """The numbers the figure draws: token ids, each stage's probabilities of them, each stage's support."""

    token_ids: tuple[int, ...]                      # ordered by the model's probability, most likely first
    probs: dict[str, tuple[float, ...]]             # stage -> probability of each token shown
    left: dict[str, int]                            # stage -> tokens with a probability above 0


def stage_table(stage_probs: dict[str, torch.Tensor], top_n: int = 10) -> StageTable:
    """The top_n tokens most likely at any stage, ordered by the first stage's (the model's) probability, with each
    stage's probability of each and the number of tokens it leaves. Chapter 13."""
    if not stage_probs:
        raise ValueError("stage_probs is empty; pass llminfer.sampling.stages(logits, settings)")
    if top_n < 1:
        raise ValueError(f"top_n must be at least 1, got {top_n}")
    table = torch.stack([p.float() for p in stage_probs.values()])          # (stages, vocab)
    best = table.amax(dim=0)                                                 # each token's largest probability
    shown = torch.topk(best, min(top_n, best.numel())).indices
    first = table[0, shown]
    shown = shown[torch.argsort(first, descending=True, stable=True)]
    probs = {name: tuple(float(x) for x in p.float()[shown]) for name, p in stage_probs.items()}
    left = {name: int((p > 0).sum()) for name, p in stage_probs.items()}
    return StageTable(tuple(int(i) for i in shown), probs, left)


def token_label(tokenizer, token_id: int) -> str:
    """How a token is written under its bar: its text, quoted so a space shows (its id without a tokenizer)."""
    return str(token_id) if tokenizer is None else repr(tokenizer.decode([token_id]))


def stages_figure(stage_probs: dict[str, torch.Tensor], tokenizer=None, top_n: int = 10, columns: int = 4):
    """A matplotlib Figure: one panel per stage with a bar per shown token (stage_table's), the panel's title
    naming the stage and the tokens it leaves. Chapter 13."""
    from matplotlib.figure import Figure

    table = stage_table(stage_probs, top_n)
    labels = [token_label(tokenizer, i) for i in table.token_ids]
    rows = -(-len(table.probs) // columns)
    fig = Figure(figsize=(3.2 * columns, 2.6 * rows), dpi=100)
    axes = fig.subplots(rows, columns, squeeze=False, sharey=True)
    for ax, (name, probs) in zip(axes.flat, table.probs.items()):
        ax.bar(range(len(probs)), probs, color=["#1565c0" if p > 0 else "#bdbdbd" for p in probs])
        ax.set_xticks(range(len(probs)), labels, rotation=60, fontsize=7)
        left = table.left[name]
        ax.set_title(f"{name}\n{left:,} token{'s' if left != 1 else ''} left", fontsize=9)
        ax.set_ylim(0, 1.05)
    for ax in list(axes.flat)[len(table.probs):]:
        ax.set_visible(False)
    axes[0, 0].set_ylabel("probability")
    fig.tight_layout()
    return fig


def summary_line(stage_probs: dict[str, torch.Tensor], settings, tokenizer=None) -> str:
    """One line: the settings, the tokens the whole pipeline leaves, and the most likely of them."""
    final = stage_probs[list(stage_probs)[-1]]
    top = int(final.argmax())
    left = int((final > 0).sum())
    return (f"temperature {settings.temperature:.2f} · top-k {settings.top_k or 'off'} · top-p "
            f"{settings.top_p if settings.top_p is not None else 'off'} · min-p "
            f"{settings.min_p if settings.min_p is not None else 'off'} · repetition penalty "
            f"{settings.repetition_penalty:.2f} → {left:,} token{'s' if left != 1 else ''} left · most likely "
            f"{token_label(tokenizer, top)} at {float(final[top]):.3f}")


def build_sampling_widget(logits: torch.Tensor, tokenizer=None, history=None, settings=None, top_n: int = 8):
    """Sliders for temperature, top-k, top-p, min-p and the repetition penalty over one row's logits (vocab,); each
    change reruns `llminfer.sampling.stages` and redraws the summary line and the stages figure. Chapter 13.

    top-k 0, top-p 1 and min-p 0 mean no cut. The presence and frequency penalties stay as `settings` has them."""
    import ipywidgets as widgets

    from ..sampling import SamplerSettings, stages

    settings = settings or SamplerSettings(temperature=1.0)
    wide = {"description_width": "150px"}
    controls = {
        "temperature": widgets.FloatSlider(value=settings.temperature, min=0.0, max=2.0, step=0.05,
                                           description="temperature", style=wide),
        "top_k": widgets.IntSlider(value=settings.top_k or 0, min=0, max=100, description="top-k (0: off)",
                                   style=wide),
        "top_p": widgets.FloatSlider(value=1.0 if settings.top_p is None else settings.top_p, min=0.05, max=1.0,
                                     step=0.05, description="top-p (1: off)", style=wide),
        "min_p": widgets.FloatSlider(value=settings.min_p or 0.0, min=0.0, max=0.5, step=0.01,
                                     description="min-p (0: off)", style=wide),
        "repetition_penalty": widgets.FloatSlider(value=settings.repetition_penalty, min=1.0, max=2.0, step=0.05,
                                                  description="repetition penalty", style=wide),
    }
    for name, control in controls.items():
        control.add_class(f"llminfer-sampling-{name.replace('_', '-')}")
    summary = widgets.HTML()
    summary.add_class("llminfer-sampling-summary")
    chart = widgets.Image(format="png")
    chart.add_class("llminfer-sampling-chart")

    def chosen() -> SamplerSettings:
        values = {name: control.value for name, control in controls.items()}
        return dataclasses.replace(settings, temperature=round(values["temperature"], 4),
                                   top_k=values["top_k"] or None,
                                   top_p=None if values["top_p"] >= 1 else round(values["top_p"], 4),
                                   min_p=round(values["min_p"], 4) or None,
                                   repetition_penalty=round(values["repetition_penalty"], 4))

    def redraw(_change=None):
        current = chosen()
        probs = stages(logits, current, history)
        figure = stages_figure(probs, tokenizer, top_n=top_n)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        chart.value = buffer.getvalue()               # the figure first: a new summary line means both are new
        summary.value = f"<code>{html.escape(summary_line(probs, current, tokenizer))}</code>"

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    box = widgets.VBox([*controls.values(), summary, chart])
    box.add_class("llminfer-sampling")
    return box
