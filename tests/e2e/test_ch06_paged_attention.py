"""Chapter 06 in the browser: the block-pool slider steps through vLLM's worked example on the real engine."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NOTEBOOK = "06_paged_attention.ipynb"


@pytest.fixture(scope="module")
def snapshots():
    """The widget's scenario run here on the same engine: what each slider position must show."""
    import llminfer
    from llminfer.engine import LLMEngine
    from llminfer.widgets import block_pool

    model, _ = llminfer.load_pretrained("tiny-capitals", device="cpu")
    engine = LLMEngine(model, block_size=4, num_blocks=10, max_model_len=40, max_num_seqs=4)
    return block_pool.record_snapshots(engine, block_pool.vllm_example_events())


def test_slider_steps_through_the_block_pool(lab, snapshots):
    from llminfer.widgets import block_pool

    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=240_000)
    queue = lab.widget("llminfer-pool-queue")
    counts = lab.widget("llminfer-pool-counts")
    grid = lab.widget("llminfer-pool-grid")
    slider = lab.widget("llminfer-pool-step")
    expect(queue).to_have_text(block_pool.queue_text(snapshots[0]))
    expect(grid.locator(".pool-block")).to_have_count(10)

    # the design document's times 5 and 6: request 0, then request 1 finish
    for index, document_queue in ((6, "7 8 9 4 3 2"), (7, "7 8 9 4 3 2 6 5 1 0")):
        lab.set_text(slider.locator(".widget-readout"), index)
        expect(queue).to_have_text(block_pool.queue_text(snapshots[index]))
        assert queue.inner_text().endswith(document_queue)
        expect(counts).to_have_text(block_pool.counts_text(snapshots[index]))
    # after time 6 both requests are done: block 0 is free again (ref count 0), its prefix still cached
    expect(grid.locator(".pool-block[data-block='0']")).to_have_attribute("data-ref", "0")
    lab.set_text(slider.locator(".widget-readout"), 9)           # time 7: request 2 takes 0 1 2 7 8 9 4 3
    expect(queue).to_have_text(re.compile(r": 6 5$"))
    expect(grid).to_contain_text("r2: [0, 1, 2, 7, 8, 9, 4, 3]")
    for block in (0, 1, 2, 7, 8, 9, 4, 3):
        expect(grid.locator(f".pool-block[data-block='{block}']")).to_have_attribute("data-ref", "1")
    lab.screenshot("ch06-block-pool", locator=lab.output_of(grid))
