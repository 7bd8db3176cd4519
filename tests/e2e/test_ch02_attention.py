"""Chapter 02 in the browser: editing the query in the attention widget changes the weights it shows."""
import math
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NOTEBOOK = "02_attention_qkv.ipynb"
KEYS = {"I": (1.0, 0.0), "love": (0.0, 1.0), "AI": (1.0, 1.0)}  # the chapter's worked example


def softmax_weights(query) -> dict[str, float]:
    """Softmax of q·k over the example's keys, written out with math.exp (scale 1)."""
    scores = {token: sum(q * k for q, k in zip(query, key)) for token, key in KEYS.items()}
    top = max(scores.values())
    exps = {token: math.exp(s - top) for token, s in scores.items()}
    total = sum(exps.values())
    return {token: e / total for token, e in exps.items()}


def shown_weights(text: str) -> dict[str, float]:
    """Parses 'I 0.212 · love 0.212 · AI 0.576' into {token: weight}."""
    pairs = re.findall(r"(\S+) (-?\d+\.\d+)", text)
    assert [token for token, _ in pairs] == list(KEYS), f"unexpected weights line: {text!r}"
    return {token: float(number) for token, number in pairs}


def expect_weights(locator, query) -> None:
    """Waits until the weights line shows softmax(K q) to the three digits it prints."""
    want = softmax_weights(query)
    expected_text = " · ".join(f"{token} {w:.3f}" for token, w in want.items())
    expect(locator).to_have_text(expected_text)
    got = shown_weights(locator.inner_text())
    assert all(abs(got[t] - want[t]) <= 5e-4 for t in KEYS), (got, want)


def test_editing_the_query_changes_the_weights(lab):
    lab.open(NOTEBOOK)
    lab.run_all()
    lab.widget("llminfer-attn")
    weights = lab.widget("llminfer-attn-weights")
    chart = lab.widget("llminfer-attn-chart")
    expect_weights(weights, (1.0, 1.0))  # the article's 0.21, 0.21, 0.58

    for name, value, query in (("llminfer-attn-q0", 3, (3.0, 1.0)), ("llminfer-attn-q1", -2, (3.0, -2.0))):
        chart_before = chart.get_attribute("src")
        lab.set_text(lab.widget(name).locator("input"), value)
        expect_weights(weights, query)
        expect(chart).not_to_have_attribute("src", chart_before)  # the bar chart is redrawn too
    lab.screenshot("ch02-attention", locator=lab.widget("llminfer-attn"))
