"""What each stage of the sampling pipeline does to a next-token distribution, drawn. Chapter 13.

Everything drawn comes from ``llminfer.sampling.stages(logits, settings, history)``, the distribution after each
stage (model, penalties, mask, temperature, top-k, top-p, min-p), through two functions:

- ``stage_table(stage_probs, top_n)``: the tokens to show (the ``top_n`` most likely at any stage, ordered by the
  model's own probability), each stage's probability of each, and how many tokens each stage leaves;
- ``stages_figure(stage_probs, tokenizer, top_n)``: a matplotlib Figure with one panel per stage, a bar per token,
  and in each panel's title how many tokens are left.

Nothing displays at import.
"""
from __future__ import annotations

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
