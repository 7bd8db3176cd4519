"""Chapter 08 in the browser: Run quantizes the bundled model and shows the error histogram, accuracy, bytes
and speed; choosing per-channel scales at 4 bits gives a larger error than groups of 32."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]

NOTEBOOK = "08_quantization.ipynb"


def shown(result) -> dict:
    """The numbers of the result table: capitals right, relative error, MiB per token, tokens/s."""
    text = result.inner_text()
    capitals = re.search(r"capitals right\s+(\d+) / (\d+)", text)
    error = re.search(r"relative error of the matrix\s+([\d.e+-]+)", text)
    speed = re.search(r"decode speed\s+(\d+) tokens/s", text)
    assert capitals and error and speed, f"unexpected result table: {text!r}"
    return {"correct": int(capitals.group(1)), "total": int(capitals.group(2)), "error": float(error.group(1)),
            "tokens_per_s": int(speed.group(1))}


def test_run_quantizes_and_draws_the_error_histogram(lab):
    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=360_000)
    run = lab.widget("llminfer-quant-run")
    result = lab.widget("llminfer-quant-result", state="attached")
    plot = lab.widget("llminfer-quant-plot", state="attached")
    expect(plot.locator("img")).to_have_count(0)                  # nothing is drawn before Run

    run.click()
    expect(result).to_contain_text("capitals right", timeout=120_000)
    image = plot.locator("img").first
    image.wait_for(state="visible", timeout=60_000)
    assert image.evaluate("img => img.complete && img.naturalWidth > 100 && img.naturalHeight > 100")
    grouped = shown(result)
    assert grouped["total"] == 40 and grouped["correct"] >= 36 and grouped["tokens_per_s"] > 0

    lab.widget("llminfer-quant-group").locator("select").select_option("per channel")
    run.click()
    expect(result).not_to_contain_text(f"{grouped['error']:.3g}", timeout=120_000)
    expect(result).to_contain_text("capitals right", timeout=120_000)
    per_channel = shown(result)
    assert per_channel["error"] > grouped["error"], (per_channel, grouped)
    plot.locator("img").first.wait_for(state="visible", timeout=60_000)     # the new histogram
    lab.screenshot("ch08-quantization", locator=lab.output_of(run))
