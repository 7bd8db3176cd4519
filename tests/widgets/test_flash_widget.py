"""Chapter 07's tile widget: everything it shows comes from the real tiled loop."""
from __future__ import annotations

import pytest
import torch

from llminfer.flash import naive_attention, tiled_attention
from llminfer.widgets.flash import (COUNTER_FORMAT, CURRENT, DONE, PENDING, SKIPPED, build_flash_widget,
                                    flash_trace, format_counter, grid_html, state_rows, tile_states)


@pytest.fixture(scope="module")
def trace():
    return flash_trace(seq_len=16, head_dim=4, block=4, seed=0)


def test_trace_records_one_step_per_computed_tile_in_loop_order(trace):
    # 4 × 4 tiles, causal: query block i computes key blocks 0..i
    assert [(s.q_block, s.k_block) for s in trace.steps] == [(i, j) for i in range(4) for j in range(i + 1)]
    assert trace.tiled.tiles_computed == 10 and trace.tiled.tiles_skipped == 6
    torch.testing.assert_close(trace.output, torch.nn.functional.scaled_dot_product_attention(
        trace.q, trace.k, trace.v, is_causal=True))


def test_counter_reads_the_loops_own_counts(trace):
    # tile 1: Q block (4 × 4 float32 = 64 B) plus one K and one V tile (64 B each)
    assert format_counter(trace, 0) == "tile 1 of 10 · read from HBM so far 192 B · naive attention reads 2816 B"
    _, naive = naive_attention(trace.q, trace.k, trace.v, causal=True)
    # naive reads Q, K, V (256 B each) and the 16 × 16 score and probability matrices (1024 B each)
    assert naive.read_bytes == 3 * 256 + 2 * 1024 == 2816
    last = len(trace.steps) - 1
    assert format_counter(trace, last) == COUNTER_FORMAT.format(
        n=10, total=10, read=tiled_attention(trace.q, trace.k, trace.v, block_m=4, block_n=4).traffic.read_bytes,
        naive=2816)
    reads = [s.traffic.read_bytes for s in trace.steps]
    assert reads == sorted(reads) and len(set(reads)) == len(reads)   # every tile reads more


def test_tile_states_follow_the_step(trace):
    assert tile_states(trace, 0)[0] == [CURRENT, SKIPPED, SKIPPED, SKIPPED]
    assert tile_states(trace, 0)[3] == [PENDING, PENDING, PENDING, PENDING]
    states = tile_states(trace, 4)              # query block 2, key block 1
    assert states[2] == [DONE, CURRENT, PENDING, SKIPPED]
    assert states[1] == [DONE, DONE, SKIPPED, SKIPPED]
    assert sum(row.count(SKIPPED) for row in states) == 6
    html = grid_html(trace, 4)
    assert html.count("class='flash-current'") == 1 and html.count("class='flash-skipped'") == 6


def test_state_rows_are_the_running_max_sum_and_output(trace):
    step = 3                                                     # query block 2 after key block 0
    rows = state_rows(trace, step)
    assert [pos for pos, *_ in rows] == [8, 9, 10, 11]
    s = (trace.q[0, 0, 8:12] @ trace.k[0, 0, 0:4].T) / 2        # scale 1/√4; keys 0..3 all visible
    assert [m for _, m, _, _ in rows] == pytest.approx(s.amax(-1).tolist(), abs=1e-6)
    assert [l for _, _, l, _ in rows] == pytest.approx(torch.exp(s - s.amax(-1, keepdim=True)).sum(-1).tolist(),
                                                       abs=1e-6)
    want = torch.softmax(s, -1) @ trace.v[0, 0, 0:4]
    torch.testing.assert_close(torch.tensor([out for *_, out in rows]), want, atol=1e-6, rtol=0)


def test_bad_steps_and_sizes_are_refused(trace):
    with pytest.raises(ValueError, match="step=10 is outside 0..9"):
        format_counter(trace, 10)
    with pytest.raises(ValueError, match="seq_len=100 is more than the widget can draw"):
        flash_trace(seq_len=100)
    with pytest.raises(ValueError, match="block=32 is larger than seq_len=16"):
        flash_trace(seq_len=16, block=32)


def test_widget_refreshes_from_the_slider(trace):
    box = build_flash_widget(trace)
    counter = next(w for w in box.children if "llminfer-flash-counter" in w._dom_classes)
    assert counter.value == format_counter(trace, 0)
    box.slider.value = 6
    assert counter.value == format_counter(trace, 6)
    grid = next(w for w in box.children if "llminfer-flash-grid" in w._dom_classes)
    assert grid.value == grid_html(trace, 6)
