"""Chapter 04 in the browser: pressing Run on the timing widget measures both strategies and draws the plot."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

NOTEBOOK = "04_kv_cache.ipynb"
NUMBER = r"(\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


def test_run_button_draws_the_latency_plot(lab):
    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=300_000)
    memory = lab.widget("llminfer-memory-result")  # the memory calculator above it: saved for the book's page
    expect(memory).to_contain_text("KV cache per token")
    lab.screenshot("ch04-memory", locator=lab.output_of(memory))
    run = lab.widget("llminfer-latency-run")
    summary = lab.widget("llminfer-latency-summary", state="attached")  # empty until Run
    plot = lab.widget("llminfer-latency-plot", state="attached")  # empty until Run
    expect(plot.locator("img")).to_have_count(0)  # nothing is drawn before Run

    run.click()
    image = plot.locator("img").first
    image.wait_for(state="visible", timeout=240_000)
    assert image.evaluate("img => img.complete && img.naturalWidth > 100 && img.naturalHeight > 100")

    text = summary.inner_text()
    for label in ("TTFT", "TPOT", "speedup"):
        assert label in text, f"summary lacks {label}: {text!r}"
    ttft_ms = float(re.search(rf"TTFT {NUMBER} ms", text).group(1))
    tpot_cached_ms, tpot_recomputed_ms = map(float, re.search(
        rf"TPOT {NUMBER} ms with cache, {NUMBER} ms without", text).groups())
    assert ttft_ms > 0 and tpot_cached_ms > 0 and tpot_recomputed_ms > 0, text
    lab.screenshot("ch04-latency", locator=lab.output_of(run))
