"""FlashAttention's tiles, stepped through one at a time, drawn from the real tiled loop. Chapter 07.

``flash_trace(seq_len, head_dim, block, seed)`` runs ``llminfer.flash.tiled_attention`` on a small
causal example with an ``on_tile`` callback and keeps every ``TileStep`` it reports (running max,
running sum, running output, bytes read so far), next to the traffic that ``naive_attention`` counts
on the same inputs. Everything the widget shows comes from that trace through pure functions:

- ``tile_states(trace, step)``: for every tile, ``"skipped"``, ``"done"``, ``"current"`` or ``"pending"``;
- ``format_counter(trace, step)``: the counter line, always exactly
  ``"tile {n} of {total} · read from HBM so far {read} B · naive attention reads {naive} B"``
  with plain integers, e.g. ``"tile 1 of 10 · read from HBM so far 192 B · naive attention reads 2816 B"``;
- ``state_rows(trace, step)``: (query position, m, l, output row) for the rows of the current query block.

``build_flash_widget(trace)`` builds the ipywidgets box and displays nothing itself.

CSS classes for browser tests: ``llminfer-flash`` (the box), ``llminfer-flash-step`` (the tile slider),
``llminfer-flash-grid`` (the tile grid), ``llminfer-flash-counter`` (the counter line),
``llminfer-flash-state`` (the table of running max, sum and output).
"""
from __future__ import annotations

import html
from dataclasses import dataclass

import torch

from llminfer.flash import HBMTraffic, TileStep, naive_attention, tile_grid, tiled_attention

SKIPPED, DONE, CURRENT, PENDING = "skipped", "done", "current", "pending"
COLOURS = {SKIPPED: "#bdbdbd", DONE: "#90caf9", CURRENT: "#ef6c00", PENDING: "#ffffff"}
LABELS = {SKIPPED: "above the diagonal: never loaded", DONE: "computed", CURRENT: "being computed",
          PENDING: "still to come"}
COUNTER_FORMAT = "tile {n} of {total} · read from HBM so far {read} B · naive attention reads {naive} B"
MAX_SEQ_LEN = 64   # the widget draws every tile and prints every row: keep the example small


@dataclass(frozen=True)
class FlashTrace:
    """A small causal attention run tile by tile: the inputs, every step, and both traffic counts."""

    q: torch.Tensor                 # (1, 1, T, D)
    k: torch.Tensor
    v: torch.Tensor
    block: int
    grid: list[list[str]]           # tile_grid: 'full', 'diagonal' or 'skipped' per tile
    steps: list[TileStep]           # one per computed tile, in the loop's order
    output: torch.Tensor            # (1, 1, T, D) the tiled loop's result
    tiled: HBMTraffic               # the tiled loop's final counts
    naive: HBMTraffic               # naive_attention's counts on the same inputs


def flash_trace(seq_len: int = 16, head_dim: int = 4, block: int = 4, seed: int = 0) -> FlashTrace:
    """Runs tiled_attention (causal, block × block tiles) on random inputs and records each tile. Chapter 07."""
    for name, value in (("seq_len", seq_len), ("head_dim", head_dim), ("block", block)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if seq_len > MAX_SEQ_LEN:
        raise ValueError(f"seq_len={seq_len} is more than the widget can draw ({MAX_SEQ_LEN}); pick a smaller one")
    if block > seq_len:
        raise ValueError(f"block={block} is larger than seq_len={seq_len}; there would be a single tile")
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 1, seq_len, head_dim, generator=generator) for _ in range(3))  # (1, 1, T, D)
    steps: list[TileStep] = []
    result = tiled_attention(q, k, v, causal=True, block_m=block, block_n=block, on_tile=steps.append)
    _, naive = naive_attention(q, k, v, causal=True)
    return FlashTrace(q, k, v, block, tile_grid(seq_len, seq_len, block, block, causal=True), steps,
                      result.out, result.traffic, naive)


def _check_step(trace: FlashTrace, step: int) -> None:
    if not isinstance(step, int) or not 0 <= step < len(trace.steps):
        raise ValueError(f"step={step!r} is outside 0..{len(trace.steps) - 1} (one step per computed tile)")


def tile_states(trace: FlashTrace, step: int) -> list[list[str]]:
    """Each tile's state after `step` (0-based): skipped, done, current or pending. Chapter 07."""
    _check_step(trace, step)
    order = {(s.q_block, s.k_block): i for i, s in enumerate(trace.steps)}
    states = []
    for q_block, row in enumerate(trace.grid):
        states.append([SKIPPED if kind == "skipped" else
                       CURRENT if order[(q_block, k_block)] == step else
                       DONE if order[(q_block, k_block)] < step else PENDING
                       for k_block, kind in enumerate(row)])
    return states


def format_counter(trace: FlashTrace, step: int) -> str:
    """The counter line, e.g. 'tile 1 of 10 · read from HBM so far 192 B · naive attention reads 2816 B'."""
    _check_step(trace, step)
    return COUNTER_FORMAT.format(n=step + 1, total=len(trace.steps), read=trace.steps[step].traffic.read_bytes,
                                 naive=trace.naive.read_bytes)


def state_rows(trace: FlashTrace, step: int) -> list[tuple[int, float, float, list[float]]]:
    """(query position, running max m, running sum l, running output row) for the current query block."""
    _check_step(trace, step)
    current = trace.steps[step]
    first = current.q_block * trace.block
    return [(first + i, current.row_max[0, 0, i].item(), current.row_sum[0, 0, i].item(),
             current.output[0, 0, i].tolist()) for i in range(current.row_max.shape[-1])]


def grid_html(trace: FlashTrace, step: int) -> str:
    """An HTML table of the tiles: rows are query blocks, columns key blocks, coloured by state. Chapter 07."""
    states = tile_states(trace, step)
    block = trace.block
    head = "".join(f"<th style='padding:0 4px;font-weight:normal;white-space:nowrap'>"
                   f"K {j * block}–{(j + 1) * block - 1}</th>"
                   for j in range(len(states[0])))
    rows = []
    for i, row in enumerate(states):
        cells = "".join(f"<td class='flash-{state}' title='{LABELS[state]}' style='background:{COLOURS[state]};"
                        f"width:48px;height:28px;border:1px solid #9e9e9e'></td>" for state in row)
        rows.append(f"<tr><td style='text-align:right;padding-right:6px;white-space:nowrap'>"
                    f"Q {i * block}–{(i + 1) * block - 1}</td>"
                    f"{cells}</tr>")
    legend = " ".join(f"<span style='background:{COLOURS[s]};border:1px solid #9e9e9e;padding:1px 6px'>"
                      f"{LABELS[s]}</span>" for s in (CURRENT, DONE, PENDING, SKIPPED))
    return (f"<table style='border-collapse:separate;border-spacing:2px'><tr><th></th>{head}</tr>"
            + "".join(rows) + f"</table><div style='margin-top:4px'>{legend}</div>")


def state_html(trace: FlashTrace, step: int) -> str:
    """An HTML table of the current query block's running max, sum and output rows. Chapter 07."""
    _check_step(trace, step)
    current = trace.steps[step]
    first_key = current.k_block * trace.block
    caption = (f"query block {current.q_block} after key tile {current.k_block} "
               f"(keys {first_key}–{first_key + trace.block - 1})")
    cell = "style='padding:0 10px;text-align:right'"
    body = "".join(
        f"<tr><td {cell}>{pos}</td><td {cell}>{m:.3f}</td><td {cell}>{l:.3f}</td><td {cell}><code>"
        + html.escape("[" + ", ".join(f"{x:.3f}" for x in out) + "]") + "</code></td></tr>"
        for pos, m, l, out in state_rows(trace, step))
    return (f"<div>{html.escape(caption)}</div><table style='border-collapse:collapse'>"
            "<tr><th style='padding:0 10px'>query</th><th style='padding:0 10px'>running max m</th>"
            "<th style='padding:0 10px'>running sum l</th><th style='padding:0 10px'>output so far (acc / l)</th></tr>"
            f"{body}</table>")


def build_flash_widget(trace: FlashTrace | None = None):
    """A VBox with a tile slider (and play button), the tile grid, the counter and the running state. Chapter 07."""
    import ipywidgets as widgets

    trace = flash_trace() if trace is None else trace
    n_steps = len(trace.steps)
    slider = widgets.IntSlider(value=0, min=0, max=n_steps - 1, description="tile")
    slider.add_class("llminfer-flash-step")
    play = widgets.Play(value=0, min=0, max=n_steps - 1, interval=900, description="play")
    widgets.jslink((play, "value"), (slider, "value"))
    grid_view = widgets.HTML()
    grid_view.add_class("llminfer-flash-grid")
    counter = widgets.HTML()
    counter.add_class("llminfer-flash-counter")
    state = widgets.HTML()
    state.add_class("llminfer-flash-state")
    box = widgets.VBox([widgets.HBox([play, slider]), counter, grid_view, state])
    box.add_class("llminfer-flash")

    def refresh(_change=None):
        step = slider.value
        grid_view.value = grid_html(trace, step)
        counter.value = html.escape(format_counter(trace, step))
        state.value = state_html(trace, step)

    slider.observe(refresh, names="value")
    refresh()
    box.trace = trace
    box.slider = slider
    return box
