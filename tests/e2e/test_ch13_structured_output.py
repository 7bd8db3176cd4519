"""Chapter 13 in the browser: the sampling widget's sliders rerun the pipeline, and the tokens it says are left are
those of a pipeline written here from the definitions (penalties, temperature, top-k, nucleus, min-p)."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NOTEBOOK = "13_structured_output.ipynb"
# The chapter's logits: SmolLM2-135M-Instruct asked for a colour, having written "Red, red, red,"; its settings.
PENALTIES = dict(repetition=1.3, presence=0.5, frequency=0.5)


def pipeline_by_definition():
    """tokens_left(temperature, top_k, top_p, min_p): how many tokens keep a probability above 0."""
    import torch

    import llminfer

    model, tokenizer = llminfer.load_pretrained("smollm2-135m-instruct")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    answer = tokenizer.encode("Red, red, red,")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer]))[0, -1].float()
    seen = torch.tensor(sorted(set(prompt + answer)))
    logits[seen] = torch.where(logits[seen] > 0, logits[seen] / PENALTIES["repetition"],
                               logits[seen] * PENALTIES["repetition"])
    for token in set(answer):                       # OpenAI's penalties count the output only
        logits[token] -= PENALTIES["presence"] + PENALTIES["frequency"] * answer.count(token)

    def tokens_left(temperature: float, top_k: int | None, top_p: float | None, min_p: float | None) -> int:
        probs = (logits / temperature).softmax(-1)
        order = probs.argsort(descending=True)
        keep = torch.zeros_like(probs, dtype=torch.bool)
        keep[order[:top_k or len(order)]] = True
        probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
        if top_p is not None:                       # the smallest most-likely set reaching top_p
            cumulative = probs[order].cumsum(0)
            needed = int((cumulative < top_p).sum()) + 1
            nucleus = torch.zeros_like(keep)
            nucleus[order[:needed]] = True
            keep &= nucleus
            probs = torch.where(keep, probs, 0.0) / probs[keep].sum()
        if min_p is not None:
            keep &= probs >= min_p * probs.max()
        return int(keep.sum())

    return tokens_left


@pytest.fixture(scope="module")
def left():
    return pipeline_by_definition()


def test_sliders_rerun_the_pipeline_and_count_what_it_leaves(lab, left):
    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=600_000)
    summary = lab.widget("llminfer-sampling-summary")
    chart = lab.widget("llminfer-sampling-chart")

    def says(n: int):
        expect(summary).to_have_text(re.compile(rf"→ {n:,} tokens? left · most likely "), timeout=60_000)

    # the widget opens on the chapter's settings: T 0.8, top-k 20, top-p 0.9, min-p 0.1
    says(left(0.8, 20, 0.9, 0.1))
    first_chart = chart.get_attribute("src")
    assert chart.evaluate("img => img.complete && img.naturalWidth > 100")
    lab.screenshot("ch13-sampling", locator=lab.output_of(summary))      # the default state, for the website

    lab.set_text(lab.widget("llminfer-sampling-top-k").locator(".widget-readout"), 0)      # top-k off
    lab.set_text(lab.widget("llminfer-sampling-min-p").locator(".widget-readout"), 0)      # min-p off
    says(left(0.8, None, 0.9, None))
    lab.set_text(lab.widget("llminfer-sampling-temperature").locator(".widget-readout"), 1.5)
    flat = left(1.5, None, 0.9, None)
    says(flat)                                      # a flatter distribution: the nucleus takes more tokens
    assert flat > left(0.8, None, 0.9, None)
    expect(chart).not_to_have_attribute("src", first_chart)

    lab.set_text(lab.widget("llminfer-sampling-min-p").locator(".widget-readout"), 0.05)
    says(left(1.5, None, 0.9, 0.05))
