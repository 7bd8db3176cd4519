"""The block pool, drawn: owners, ref counts, hashes and the free queue, step by step. Chapter 06.

A scenario is a list of events run on a real `LLMEngine` through its step API; after every event the
pool is snapshotted (`BlockManager.snapshot`). Pure functions turn a snapshot into what is shown:

- ``queue_text(snapshot)``: the free queue in eviction order, always
  ``"free queue (evicted first → last): 7 8 9 4 3 2"`` (block ids separated by single spaces; ``(empty)``
  when no block is free);
- ``counts_text(snapshot)``: ``"blocks used 4 · free 6 (of which 2 still cached)"``;
- ``pool_html(snapshot)``: the grid, one cell per block: its id, its owners, its ref count and the first
  four hex digits of its hash (blank until the block is full).

CSS classes for browser tests: ``llminfer-pool-step`` (the slider), ``llminfer-pool-label`` (what happened),
``llminfer-pool-counts``, ``llminfer-pool-queue``, ``llminfer-pool-grid``.
"""
from __future__ import annotations

import html
from dataclasses import dataclass

OWNER_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
FREE, CACHED_FREE, SHARED_BORDER = "#f0f0f0", "#fff2cc", "#000000"


@dataclass(frozen=True)
class Event:
    """One action of a scenario: add a request (prompt, max_new_tokens), or run one engine step."""
    kind: str                   # "add" or "step"
    prompt: tuple[int, ...] = ()
    max_new_tokens: int = 1
    label: str = ""


def record_snapshots(engine, events: list[Event]) -> list:
    """Runs events on engine; returns a PoolSnapshot after each (the first: before anything). Chapter 06."""
    from ..engine import SamplingParams

    snapshots = [engine.block_manager.snapshot([], 0, "start: every block free")]
    for event in events:
        if event.kind == "add":
            request_id = engine.add_request(list(event.prompt), SamplingParams(max_new_tokens=event.max_new_tokens))
            label = event.label or f"request {request_id} arrives ({len(event.prompt)} prompt tokens)"
        elif event.kind == "step":
            made = engine.step()
            done = [e.request_id for e in made if e.finished]
            label = event.label or (f"step {engine.stats.steps}: " + (f"request(s) {done} finish" if done else "run"))
        else:
            raise ValueError(f"an event is 'add' or 'step', got {event.kind!r}")
        snapshots.append(engine.block_manager.snapshot(engine.scheduler.running, engine.stats.steps, label))
    return snapshots


def queue_text(snapshot) -> str:
    """'free queue (evicted first → last): 7 8 9 4 3 2' for a snapshot. Chapter 06."""
    ids = " ".join(str(b) for b in snapshot.free_queue) or "(empty)"
    return f"free queue (evicted first → last): {ids}"


def counts_text(snapshot) -> str:
    """'blocks used 4 · free 6 (of which 2 still cached)' for a snapshot. Chapter 06."""
    free = len(snapshot.free_queue)
    return f"blocks used {snapshot.num_used} · free {free} (of which {snapshot.num_cached_free} still cached)"


def owner_colour(request_id: int) -> str:
    return OWNER_COLOURS[request_id % len(OWNER_COLOURS)]


def pool_html(snapshot, columns: int = 10) -> str:
    """An HTML grid of the pool: one cell per block, coloured by owner; shared blocks get a black border."""
    cells = []
    for block in snapshot.blocks:
        if block.owners:
            background = owner_colour(block.owners[0])
            text = "white"
        else:
            background = CACHED_FREE if block.block_hash is not None else FREE
            text = "#333"
        border = f"3px solid {SHARED_BORDER}" if len(block.owners) > 1 else "1px solid #999"
        owners = ",".join(f"r{o}" for o in block.owners) or "free"
        digest = f"{block.block_hash:016x}"[:4] if block.block_hash is not None else "····"
        cells.append(
            f"<div class='pool-block' data-block='{block.block_id}' data-ref='{block.ref_count}' "
            f"title='block {block.block_id}: ref count {block.ref_count}, owners {owners}' "
            f"style='background:{background};color:{text};border:{border};width:74px;height:58px;"
            f"margin:2px;padding:2px;font:11px monospace;box-sizing:border-box'>"
            f"<b>#{block.block_id}</b> ref {block.ref_count}<br>{html.escape(owners)}<br>{digest}</div>")
    tables = " · ".join(f"<span style='color:{owner_colour(rid)}'>r{rid}: {list(table)}</span>"
                        for rid, table in snapshot.block_tables.items())
    legend = (f"<span style='background:{CACHED_FREE};padding:1px 5px'>free, prefix still cached</span> "
              f"<span style='background:{FREE};padding:1px 5px'>free</span> thick border: shared")
    return (f"<div style='display:grid;grid-template-columns:repeat({columns}, 78px)'>{''.join(cells)}</div>"
            f"<div style='font:12px monospace'>block tables: {tables or '(none)'}</div><div>{legend}</div>")


def table_links(snapshot) -> list[tuple[int, int, int]]:
    """(request id, logical block, physical block) for every entry of every block table, in table order. Chapter 06.

    A physical block named by several links is shared: its ref count is the number of links to it."""
    return [(request_id, logical, physical) for request_id, table in snapshot.block_tables.items()
            for logical, physical in enumerate(table)]


def plot_block_tables(ax, snapshot, titles: dict | None = None) -> None:
    """The block tables of a snapshot's requests (top row, one group per request, each box holding a physical block
    id) joined by lines to the pool's physical blocks (bottom row). A block shared by several requests is dark,
    with a thick border and its ref count; a free block is pale (yellow while its prefix is still cached).
    titles: {request id: a caption over its group}. Chapter 06."""
    from matplotlib.patches import Rectangle

    ax.set_axis_off()
    pool_y, table_y = 0.0, 3.0
    x = 0.0
    for request_id, table in snapshot.block_tables.items():                      # the block tables, side by side
        colour = owner_colour(request_id)
        title = (titles or {}).get(request_id, f"request {request_id}")
        ax.text(x, table_y + 1.1, title, color=colour, fontsize=8, va="bottom")
        for logical, physical in enumerate(table):
            ax.add_patch(Rectangle((x + logical, table_y), 0.9, 0.9, facecolor="white", edgecolor=colour, lw=1.5,
                                   zorder=3))
            ax.text(x + logical + 0.45, table_y + 0.45, str(physical), ha="center", va="center", fontsize=8, zorder=4)
            ax.plot([x + logical + 0.45, physical + 0.45], [table_y, pool_y + 0.9], color=colour, lw=0.9, alpha=0.8,
                    zorder=1)
        x += len(table) + 1.0
    for block in snapshot.blocks:                                                 # the pool
        shared = len(block.owners) > 1
        if block.owners:
            face = "#424242" if shared else owner_colour(block.owners[0])
        else:
            face = CACHED_FREE if block.block_hash is not None else FREE
        ax.add_patch(Rectangle((block.block_id, pool_y), 0.9, 0.9, facecolor=face, zorder=3,
                               edgecolor=SHARED_BORDER if shared else "#999999", lw=2.5 if shared else 0.8))
        ax.text(block.block_id + 0.45, pool_y + 0.45, str(block.block_id), ha="center", va="center", fontsize=8,
                color="white" if block.owners else "#333333", zorder=4)
        if shared:
            ax.text(block.block_id + 0.45, pool_y - 0.15, f"ref {block.ref_count}", ha="center", va="top", fontsize=7)
    ax.text(-0.2, table_y + 0.45, "block tables", ha="right", va="center", fontsize=9)
    ax.text(-0.2, pool_y + 0.45, "physical blocks", ha="right", va="center", fontsize=9)
    ax.set_xlim(-3.5, max(x, len(snapshot.blocks)) + 0.2)
    ax.set_ylim(pool_y - 0.9, table_y + 1.6)


def build_pool_widget(snapshots: list, columns: int = 10):
    """A step slider over recorded snapshots, with the grid, the counts and the free queue. Chapter 06."""
    import ipywidgets as widgets

    if not snapshots:
        raise ValueError("no snapshots to show; record some with record_snapshots(engine, events)")
    step = widgets.IntSlider(value=0, min=0, max=len(snapshots) - 1, description="event")
    step.add_class("llminfer-pool-step")
    label = widgets.HTML()
    label.add_class("llminfer-pool-label")
    counts = widgets.HTML()
    counts.add_class("llminfer-pool-counts")
    queue = widgets.HTML()
    queue.add_class("llminfer-pool-queue")
    grid = widgets.HTML()
    grid.add_class("llminfer-pool-grid")
    box = widgets.VBox([step, label, counts, queue, grid])
    box.add_class("llminfer-pool")

    def refresh(_change=None):
        snapshot = snapshots[step.value]
        label.value = html.escape(snapshot.label)
        counts.value = counts_text(snapshot)
        queue.value = queue_text(snapshot)
        grid.value = pool_html(snapshot, columns)
        box.snapshot = snapshot

    step.observe(refresh, names="value")
    refresh()
    box.step_slider, box.label, box.counts, box.queue, box.grid = step, label, counts, queue, grid
    return box


def vllm_example_events(tokens0: list[int] | None = None) -> list[Event]:
    """The scenario of vLLM's prefix-caching design document (block size 4, 10 blocks), as events. Chapter 06."""
    tokens0 = tokens0 or list(range(100, 115))
    return [
        Event("add", tuple(tokens0), 4, "request 0 arrives: 15 prompt tokens"),
        Event("step", label="time 1: request 0's prefill takes blocks 0-3; 0, 1, 2 are full and cached"),
        Event("step", label="time 2: its first new token fills block 3, which is cached"),
        Event("step", label="time 3: the next token needs a new block: block 4"),
        Event("add", tuple(tokens0[:10]) + (200, 201, 202, 203), 2,
              "request 1 arrives: 14 tokens, the first 10 equal to request 0's"),
        Event("step", label="time 4-5: request 1 hits blocks 0 and 1 (8 tokens) and takes 5, 6; request 0 "
                            "finishes: 4, 3, 2 join the free queue, last block first"),
        Event("step", label="time 6: request 1 finishes: 6, 5, 1, 0 join the queue"),
        Event("add", tuple(tokens0[:12]) + tuple(range(300, 317)), 2,
              "request 2 arrives: 29 tokens, the first 12 equal to request 0's"),
        Event("step", label="time 7: blocks 0, 1, 2 hit; new blocks 7, 8, 9, 4 and 3 (evicted) come from the "
                            "queue's head"),
        Event("step", label="request 2 finishes"),
    ]
