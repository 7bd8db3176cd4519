"""Chapter 10 in the browser: the layout projection follows its controls, and Run starts the real 2-process
TP and PP of the bundled model and shows measured times beside predicted ones."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NOTEBOOK = "10_parallelism.ipynb"
NUMBER = r"(\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


def predicted_ms(text: str) -> float:
    return float(re.search(rf"predicted decode step\s*{NUMBER} ms", text).group(1))


def test_projection_follows_the_controls_and_run_measures_here(lab):
    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=400_000)
    projection = lab.widget("llminfer-parallel-projection")
    expect(projection).to_contain_text("predicted decode step")
    expect(projection).to_contain_text("not a measurement")
    tp8 = predicted_ms(projection.inner_text())

    lab.widget("llminfer-parallel-tp").locator("select").select_option(label="2")
    expect(projection).to_contain_text("TP 2 × PP 1")
    tp2 = predicted_ms(projection.inner_text())
    assert tp2 > tp8, (tp2, tp8)                       # fewer devices: each reads more weights per token

    lab.widget("llminfer-parallel-tp").locator("select").select_option(label="1")
    expect(projection).to_contain_text("does NOT fit")   # Llama 3 70B in bf16 on one GPU

    result = lab.widget("llminfer-parallel-result", state="attached")
    expect(result).to_have_text("")                    # nothing measured before Run
    run = lab.widget("llminfer-parallel-run")
    run.click()
    expect(result).to_contain_text("predicted", timeout=240_000)
    text = result.inner_text()
    measured, predicted = map(float, re.search(rf"measured {NUMBER} ms.*predicted {NUMBER} ms", text).groups())
    assert measured > 0 and predicted > 0, text

    lab.widget("llminfer-parallel-mode").get_by_text("PP = 2").click()
    run.click()
    expect(result).to_contain_text("bubble measured", timeout=240_000)
    assert "ideal 0.50" in result.inner_text() and "ideal 0.20" in result.inner_text()
    lab.screenshot("ch10-parallel", locator=lab.output_of(run))
