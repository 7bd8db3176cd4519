"""Chapter 03 in the browser: the recomputation widget shows the K/V counts the model's instrumentation gives."""
import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NOTEBOOK = "03_recomputation.ipynb"
PROMPT = "The capital of France is"  # the chapter's widget: this prompt, 8 new tokens at most, stop at EOS
MAX_NEW_TOKENS = 8
README_SHOT = Path(__file__).resolve().parents[2] / "docs" / "e2e-ch03.png"


@pytest.fixture(scope="module")
def kv_counts():
    """K/V positions computed per forward call, counted by llminfer.instrument, without and with the cache."""
    import torch

    import llminfer
    from llminfer import instrument

    torch.set_num_threads(1)
    model, tokenizer = llminfer.load_pretrained("tiny-capitals", device="cpu")
    prompt_ids = tokenizer.encode(PROMPT)
    per_forward = {}
    for use_cache in (False, True):
        with instrument.count_kv(model) as counts:
            llminfer.generate(model, prompt_ids, max_new_tokens=MAX_NEW_TOKENS, use_cache=use_cache,
                              eos_token_id=tokenizer.eos_token_id)
        per_forward[use_cache] = counts.per_forward
    return len(prompt_ids), per_forward


def counts_line(prompt_len: int, per_forward: list[int], step: int) -> str:
    """The counts the page should show after forward calls 0..step, derived from the instrument's numbers.

    Call i sees prompt_len + i positions and computes K/V for per_forward[i] of them; the first
    prompt_len + step positions are each computed once for the first time, any further computation
    is recomputation, and the positions a call did not compute were read from the cache.
    """
    computed = sum(per_forward[: step + 1])
    first_time = prompt_len + step
    from_cache = sum(prompt_len + i - n for i, n in enumerate(per_forward[: step + 1]))
    return f"computed {first_time} · recomputed {computed - first_time} · read from cache {from_cache}"


def test_slider_and_cache_toggle_show_the_instrument_counts(lab, kv_counts, artifacts_dir):
    prompt_len, per_forward = kv_counts
    n_calls = len(per_forward[True])
    assert len(per_forward[False]) == n_calls >= 3, per_forward
    assert per_forward[False][0] == per_forward[True][0] == prompt_len  # the prefill computes the whole prompt

    lab.open(NOTEBOOK)
    lab.run_all()
    lab.widget("llminfer-recompute-grid")
    counts = lab.widget("llminfer-recompute-counts")
    slider = lab.widget("llminfer-recompute-step")
    toggle = lab.widget("llminfer-recompute-cache")
    handle = slider.locator(".noUi-handle")
    assert handle.get_attribute("aria-valuemax") in (str(n_calls - 1), f"{n_calls - 1}.0")

    # the widget opens on the last forward call, cache off
    last = n_calls - 1
    expect(counts).to_have_text(counts_line(prompt_len, per_forward[False], last))

    lab.set_text(slider.locator(".widget-readout"), 1)  # back to the first decode step
    expect(counts).to_have_text(counts_line(prompt_len, per_forward[False], 1))

    toggle.click()  # cache on
    expect(toggle).to_have_class(re.compile(r"\bmod-active\b"))
    expect(counts).to_have_text(counts_line(prompt_len, per_forward[True], 1))

    handle.focus()
    handle.press("ArrowRight")  # one decode step further, by keyboard on the slider
    expect(counts).to_have_text(counts_line(prompt_len, per_forward[True], 2))

    toggle.click()  # cache off again at the same step: recomputation reappears
    expect(toggle).not_to_have_class(re.compile(r"\bmod-active\b"))
    expect(counts).to_have_text(counts_line(prompt_len, per_forward[False], 2))
    assert counts_line(prompt_len, per_forward[False], 2) != counts_line(prompt_len, per_forward[True], 2)

    # the README shows this widget: every passing run refreshes its picture, so it cannot fall behind the widget
    shot = lab.screenshot("ch03-recomputation", locator=lab.output_of(counts))
    README_SHOT.parent.mkdir(exist_ok=True)
    shutil.copyfile(shot, README_SHOT)
    assert README_SHOT.read_bytes() == shot.read_bytes() and README_SHOT.stat().st_size > 10_000
