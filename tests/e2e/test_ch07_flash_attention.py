"""Chapter 07 in the browser: the tile widget steps through the tiled loop and shows its own byte counts."""
import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NOTEBOOK = "07_flash_attention.ipynb"


@pytest.fixture(scope="module")
def trace():
    """The chapter's example, run through llminfer.flash.tiled_attention in this process."""
    from llminfer.widgets.flash import flash_trace

    return flash_trace(seq_len=16, head_dim=4, block=4, seed=0)   # the arguments the chapter passes


def counter_line(trace, step: int) -> str:
    """What the counter must say at a step, from the loop's own counts (not from the widget's formatter)."""
    return (f"tile {step + 1} of {len(trace.steps)} · read from HBM so far {trace.steps[step].traffic.read_bytes} B"
            f" · naive attention reads {trace.naive.read_bytes} B")


def expect_current_tile(grid, trace, step: int) -> None:
    """Exactly one tile is marked current, in the row and column of the step's query and key blocks."""
    current = grid.locator("td.flash-current")
    expect(current).to_have_count(1)
    row = grid.locator("tr").nth(trace.steps[step].q_block + 1)          # row 0 holds the column headings
    expect(row.locator("td").nth(trace.steps[step].k_block + 1)).to_have_class("flash-current")   # td 0: label


def test_slider_steps_through_the_tiles_and_the_counter_follows(lab, trace):
    n_steps = len(trace.steps)
    assert n_steps == 10 and trace.tiled.tiles_skipped == 6

    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=420_000)     # the Triton interpreter makes this chapter slow to run
    counter = lab.widget("llminfer-flash-counter")
    grid = lab.widget("llminfer-flash-grid")
    state = lab.widget("llminfer-flash-state")
    slider = lab.widget("llminfer-flash-step")
    handle = slider.locator(".noUi-handle")
    assert handle.get_attribute("aria-valuemax") in (str(n_steps - 1), f"{n_steps - 1}.0")

    expect(counter).to_have_text(counter_line(trace, 0))
    expect(grid.locator("td.flash-skipped")).to_have_count(6)
    expect_current_tile(grid, trace, 0)

    lab.set_text(slider.locator(".widget-readout"), 6)
    expect(counter).to_have_text(counter_line(trace, 6))
    expect_current_tile(grid, trace, 6)
    expect(grid.locator("td.flash-done")).to_have_count(6)
    step = trace.steps[6]
    expect(state).to_contain_text(f"query block {step.q_block} after key tile {step.k_block}")
    first_row = state.locator("tr").nth(1).locator("td")        # the block's first query row
    expect(first_row.nth(0)).to_have_text(str(step.q_block * trace.block))
    expect(first_row.nth(1)).to_have_text(f"{step.row_max[0, 0, 0].item():.3f}")
    expect(first_row.nth(2)).to_have_text(f"{step.row_sum[0, 0, 0].item():.3f}")

    handle.focus()
    handle.press("ArrowRight")   # one tile further, by keyboard
    expect(counter).to_have_text(counter_line(trace, 7))
    expect_current_tile(grid, trace, 7)
    assert trace.steps[7].traffic.read_bytes > trace.steps[6].traffic.read_bytes

    lab.set_text(slider.locator(".widget-readout"), 0)
    expect(counter).to_have_text(counter_line(trace, 0))
    lab.widget("llminfer-flash").locator(".widget-play button").first.click()   # play: the tiles advance alone
    expect(counter).not_to_have_text(counter_line(trace, 0), timeout=15_000)
    lab.screenshot("ch07-flash-tiles", locator=lab.output_of(counter))
