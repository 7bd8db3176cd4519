"""Recomputation versus caching, drawn from real K/V counts. Chapter 03.

The widget runs the model twice under ``llminfer.instrument.count_kv`` (once
with the KV cache, once without), then derives everything it draws from those
counts with pure functions:

- ``kv_grid(per_forward, prompt_len)``: a positions x forward-calls grid whose
  cells are ``NEW`` (K/V computed for the first time), ``RECOMPUTED`` (computed
  again), ``CACHED`` (read from the cache) or ``ABSENT`` (not in the context yet);
- ``kv_totals(grid, step)``: how many cells of each kind up to and including
  forward call ``step`` (0 is the prefill);
- ``format_counts(totals)``: the text of the counts line, always exactly
  ``"computed {new} · recomputed {recomputed} · read from cache {cached}"``
  with plain integers, e.g. ``"computed 7 · recomputed 11 · read from cache 0"``.

CSS classes for browser tests: ``llminfer-recompute-step`` (the step slider),
``llminfer-recompute-cache`` (the cache toggle), ``llminfer-recompute-counts``
(the counts line), ``llminfer-recompute-grid`` (the grid).
"""
from __future__ import annotations

import html
import io
from dataclasses import dataclass
from itertools import accumulate

ABSENT, NEW, RECOMPUTED, CACHED = "absent", "new", "recomputed", "cached"
COLOURS = {NEW: "#2e7d32", RECOMPUTED: "#c62828", CACHED: "#1565c0", ABSENT: "#eeeeee"}
LABELS = {NEW: "computed for the first time", RECOMPUTED: "recomputed", CACHED: "read from cache",
          ABSENT: "not in the context yet"}
COUNTS_FORMAT = "computed {new} · recomputed {recomputed} · read from cache {cached}"


def kv_grid(per_forward: list[int], prompt_len: int) -> list[list[str]]:
    """Status of each position (rows) at each forward call (columns), from K/V counts. Chapter 03.

    Forward call ``s`` sees a context of ``prompt_len + s`` tokens and computes K/V
    for the last ``per_forward[s]`` of them; the earlier ones must come from the cache.
    """
    if prompt_len < 1:
        raise ValueError(f"prompt_len={prompt_len} must be at least 1")
    n_positions = prompt_len + len(per_forward) - 1
    grid = [[ABSENT] * len(per_forward) for _ in range(n_positions)]
    seen = 0  # positions [0, seen) have had K/V computed at least once
    for step, n_computed in enumerate(per_forward):
        context_len = prompt_len + step
        first_computed = context_len - n_computed
        if not 1 <= n_computed <= context_len:
            raise ValueError(f"forward {step} computed {n_computed} positions but its context has "
                             f"{context_len}; counts must come from one generation with one new token per step")
        if first_computed > seen:
            raise ValueError(f"forward {step} reads positions up to {first_computed - 1} from the cache, "
                             f"but only {seen} positions were ever computed")
        for pos in range(context_len):
            if pos < first_computed:
                grid[pos][step] = CACHED
            else:
                grid[pos][step] = RECOMPUTED if pos < seen else NEW
        seen = max(seen, context_len)
    return grid


def kv_totals(grid: list[list[str]], step: int) -> dict[str, int]:
    """Counts of new, recomputed and cached cells in forward calls 0..step. Chapter 03."""
    n_steps = len(grid[0]) if grid else 0
    if not 0 <= step < n_steps:
        raise ValueError(f"step={step} is outside 0..{n_steps - 1}")
    totals = {NEW: 0, RECOMPUTED: 0, CACHED: 0}
    for row in grid:
        for cell in row[: step + 1]:
            if cell in totals:
                totals[cell] += 1
    return totals


def format_counts(totals: dict[str, int]) -> str:
    """The counts line, e.g. 'computed 7 · recomputed 11 · read from cache 0'. Chapter 03."""
    return COUNTS_FORMAT.format(new=totals[NEW], recomputed=totals[RECOMPUTED], cached=totals[CACHED])


def cumulative_computed(per_forward: list[int]) -> list[int]:
    """Running total of K/V positions computed after each forward call. Chapter 03."""
    return list(accumulate(per_forward))


def closed_form_totals(prompt_len: int, n_forwards: int) -> tuple[int, int]:
    """(without cache, with cache) K/V positions computed in n_forwards calls: sum(P+i) and P+n-1. Chapter 03."""
    without = n_forwards * prompt_len + n_forwards * (n_forwards - 1) // 2
    return without, prompt_len + n_forwards - 1


def grid_html(grid: list[list[str]], token_labels: list[str], step: int) -> str:
    """An HTML table of the grid up to forward call ``step``, one coloured cell per position. Chapter 03."""
    head = "".join(f"<th style='padding:0 4px;white-space:nowrap'>{'prefill' if s == 0 else f'decode {s}'}</th>"
                   for s in range(len(grid[0])))
    rows = []
    for pos, row in enumerate(grid):
        label = html.escape(token_labels[pos] if pos < len(token_labels) else f"#{pos}")
        cells = []
        for s, cell in enumerate(row):
            shown = cell if s <= step else ABSENT
            cells.append(f"<td class='kv-{shown}' title='{LABELS[shown]}' "
                         f"style='background:{COLOURS[shown]};width:56px;height:18px'></td>")
        rows.append(f"<tr><td style='text-align:right;padding-right:6px'><code>{pos}: {label}</code></td>"
                    + "".join(cells) + "</tr>")
    legend = " ".join(f"<span style='background:{COLOURS[k]};color:white;padding:1px 6px'>{LABELS[k]}</span>"
                      for k in (NEW, RECOMPUTED, CACHED))
    return (f"<table style='border-collapse:separate;border-spacing:2px'><tr><th></th>{head}</tr>"
            + "".join(rows) + f"</table><div>{legend}</div>")


def plot_grid(ax, grid: list[list[str]], token_labels: list[str], title: str = "") -> None:
    """Draw the grid on a matplotlib axis: rows are positions, columns forward calls. Chapter 03."""
    from matplotlib.colors import ListedColormap

    order = [ABSENT, NEW, RECOMPUTED, CACHED]
    codes = [[order.index(cell) for cell in row] for row in grid]
    ax.imshow(codes, cmap=ListedColormap([COLOURS[k] for k in order]), vmin=0, vmax=3, aspect="auto")
    ax.set_xticks(range(len(grid[0])), ["prefill"] + [f"decode {s}" for s in range(1, len(grid[0]))],
                  rotation=30, ha="right")
    ax.set_yticks(range(len(grid)), [f"{p}: {t}" for p, t in enumerate(token_labels[: len(grid)])])
    ax.set_xticks([x - 0.5 for x in range(1, len(grid[0]))], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(grid))], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="minor", length=0)
    ax.set_title(title)


def split_per_forward(per_forward: list[int], prompt_len: int) -> list[dict[str, int]]:
    """Each forward call's computed positions, split three ways: the prompt's positions computed again, earlier
    generated positions computed again, and positions computed for the first time. Chapter 03.

    e.g. split_per_forward([5, 6, 7], 5) -> [{prompt: 0, generated: 0, new: 5}, {5, 0, 1}, {5, 1, 1}]
    (keys "prompt", "generated", "new"): without a cache every decode call runs the whole prompt again.
    """
    grid = kv_grid(per_forward, prompt_len)
    split = []
    for step in range(len(per_forward)):
        column = [row[step] for row in grid]
        split.append({"prompt": sum(cell == RECOMPUTED for cell in column[:prompt_len]),
                      "generated": sum(cell == RECOMPUTED for cell in column[prompt_len:]),
                      "new": sum(cell == NEW for cell in column)})
    return split


PART_COLOURS = {"prompt": COLOURS[RECOMPUTED], "generated": "#ef9a9a", "new": COLOURS[NEW]}
PART_LABELS = {"prompt": "prompt positions run again", "generated": "generated positions run again",
               "new": "positions computed for the first time"}


def plot_per_forward(ax, per_forward_uncached: list[int], per_forward_cached: list[int], prompt_len: int) -> None:
    """Positions each forward call computes, without (left bar) and with (right bar) the cache, stacked by
    split_per_forward's three parts. Chapter 03."""
    width = 0.38
    for offset, counts, hatch in ((-width / 2, per_forward_uncached, ""), (width / 2, per_forward_cached, "//")):
        bottom = [0] * len(counts)
        for part, values in zip(PART_COLOURS, zip(*[[s[p] for p in PART_COLOURS]
                                                    for s in split_per_forward(counts, prompt_len)])):
            ax.bar([s + offset for s in range(len(counts))], values, width, bottom=bottom, color=PART_COLOURS[part],
                   hatch=hatch, edgecolor="white", linewidth=0.5)
            bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(per_forward_cached)),
                  ["prefill"] + [f"decode {s}" for s in range(1, len(per_forward_cached))], rotation=30, ha="right")
    ax.set_ylabel("positions computed in the call")


def part_handles() -> list:
    """Legend patches for plot_per_forward: its three colours, and the hatching of the cached bars. Chapter 03."""
    from matplotlib.patches import Patch

    return ([Patch(color=PART_COLOURS[p], label=PART_LABELS[p]) for p in PART_COLOURS]
            + [Patch(facecolor="white", edgecolor="#555555", label="left bar: no cache"),
               Patch(facecolor="white", edgecolor="#555555", hatch="//", label="right bar (hatched): cache")])


def legend_handles() -> list:
    """Coloured patches naming the three kinds of cell, for a figure legend. Chapter 03."""
    from matplotlib.patches import Patch

    return [Patch(color=COLOURS[kind], label=LABELS[kind]) for kind in (NEW, RECOMPUTED, CACHED)]


def plot_cumulative(ax, per_forward_uncached: list[int], per_forward_cached: list[int], step: int | None = None):
    """Cumulative K/V positions computed per forward call, both strategies on one axis. Chapter 03."""
    from matplotlib.ticker import MaxNLocator
    for counts, name, colour in ((per_forward_uncached, "without cache", COLOURS[RECOMPUTED]),
                                 (per_forward_cached, "with cache", COLOURS[CACHED])):
        ax.plot(range(len(counts)), cumulative_computed(counts), "o-", color=colour, label=name)
    if step is not None:
        ax.axvline(step, color="grey", linestyle=":")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # forward calls are whole numbers
    ax.set_xlabel("forward call (0 = prefill)")
    ax.set_ylabel("K/V positions computed so far")
    ax.legend()


@dataclass
class RecomputeState:
    """What the recomputation widget shows right now. Chapter 03."""

    step: int
    use_cache: bool
    grid: list[list[str]]
    totals: dict[str, int]
    counts_text: str


def count_generation(model, input_ids: list[int], max_new_tokens: int, use_cache: bool,
                     eos_token_id: int | None = None):
    """(per-forward K/V counts, generated token ids) of one greedy generation. Chapter 03."""
    import llminfer
    from llminfer import instrument

    with instrument.count_kv(model) as counts:
        result = llminfer.generate(model, input_ids, max_new_tokens=max_new_tokens, use_cache=use_cache,
                                   eos_token_id=eos_token_id, ignore_eos=eos_token_id is None)
    return list(counts.per_forward), list(result.token_ids)


def build_recompute_widget(per_forward_uncached: list[int], per_forward_cached: list[int], prompt_len: int,
                           token_labels: list[str]):
    """A VBox with a step slider, a cache toggle, the grid, the counts line and the cumulative plot. Chapter 03."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    if len(per_forward_uncached) != len(per_forward_cached):
        raise ValueError(f"the two runs made {len(per_forward_uncached)} and {len(per_forward_cached)} forward "
                         "calls; generate the same tokens with and without the cache")
    grids = {False: kv_grid(per_forward_uncached, prompt_len), True: kv_grid(per_forward_cached, prompt_len)}
    n_steps = len(per_forward_cached)
    step_slider = widgets.IntSlider(value=n_steps - 1, min=0, max=n_steps - 1, description="forward call")
    step_slider.add_class("llminfer-recompute-step")
    cache_toggle = widgets.ToggleButton(value=False, description="KV cache", tooltip="cache on/off")
    cache_toggle.add_class("llminfer-recompute-cache")
    grid_view = widgets.HTML()
    grid_view.add_class("llminfer-recompute-grid")
    counts_view = widgets.HTML()
    counts_view.add_class("llminfer-recompute-counts")
    # a PNG rather than an Output widget: it renders without a kernel; shown at its own size (5 x 3 in at 80 dpi)
    plot_view = widgets.Image(format="png", layout=widgets.Layout(width="420px"))
    box = widgets.VBox([widgets.HBox([step_slider, cache_toggle]), counts_view, grid_view, plot_view])
    box.add_class("llminfer-recompute")

    def refresh(_change=None):
        step, use_cache = step_slider.value, cache_toggle.value
        grid = grids[use_cache]
        totals = kv_totals(grid, step)
        box.state = RecomputeState(step, use_cache, grid, totals, format_counts(totals))
        counts_view.value = box.state.counts_text
        grid_view.value = grid_html(grid, token_labels, step)
        cache_toggle.description = "KV cache on" if use_cache else "KV cache off"
        fig, ax = plt.subplots(figsize=(5, 3))
        plot_cumulative(ax, per_forward_uncached, per_forward_cached, step)
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
        plt.close(fig)
        plot_view.value = png.getvalue()

    step_slider.observe(refresh, names="value")
    cache_toggle.observe(refresh, names="value")
    refresh()
    box.step_slider, box.cache_toggle = step_slider, cache_toggle
    box.counts_view, box.grid_view, box.plot_view = counts_view, grid_view, plot_view
    return box


def recompute_widget(model, tokenizer, prompt: str = "The capital of France is", max_new_tokens: int = 8,
                     eos_token_id: int | None = None):
    """Run the model with and without the cache under count_kv and return the widget. Chapter 03.

    Input that cannot make a grid (no new tokens, an empty prompt) gets a widget holding the message."""
    import ipywidgets as widgets

    input_ids = tokenizer.encode(prompt) if isinstance(prompt, str) else None
    problem = None
    if input_ids is None or not input_ids:
        problem = f"the prompt {prompt!r} holds no tokens; type some text"
    elif isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        problem = (f"max_new_tokens={max_new_tokens!r}: the grid needs at least one new token; "
                   "pass max_new_tokens=1 or more")
    elif len(input_ids) + max_new_tokens > model.config.max_seq_len:
        problem = (f"{len(input_ids)} prompt tokens + max_new_tokens={max_new_tokens} exceed the model's "
                   f"max_seq_len={model.config.max_seq_len}; pass max_new_tokens <= "
                   f"{model.config.max_seq_len - len(input_ids)}")
    if problem:
        message = widgets.HTML(f"<span style='color:#c62828'>{problem}</span>")
        message.add_class("llminfer-recompute-message")
        box = widgets.VBox([message])
        box.add_class("llminfer-recompute")
        box.message, box.state = message, None
        return box
    uncached, tokens_uncached = count_generation(model, input_ids, max_new_tokens, False, eos_token_id)
    cached, tokens_cached = count_generation(model, input_ids, max_new_tokens, True, eos_token_id)
    if tokens_uncached != tokens_cached:
        raise RuntimeError(f"cached and uncached generation differ: {tokens_cached} vs {tokens_uncached}")
    labels = tokenizer.tokens(input_ids + tokens_cached)
    return build_recompute_widget(uncached, cached, len(input_ids), labels)
