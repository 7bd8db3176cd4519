"""The speculative-decoding widget: its pure functions, and the widget driven as a reader would drive it."""
from __future__ import annotations

import re

import pytest
import torch

import llminfer
from llminfer import speculative as sp
from llminfer.widgets import speculative as spw

torch.set_num_threads(1)
PROMPT = "What is the capital of Iceland? It is Reykjavík. What is the capital of Iceland?"


@pytest.fixture(scope="module")
def models():
    target, tokenizer = llminfer.load_pretrained("tiny-capitals", device="cpu")
    draft, _ = llminfer.load_pretrained("tiny-capitals-draft", device="cpu")
    return target, tokenizer, {"prompt lookup": sp.PromptLookupDrafter(), "draft model": sp.DraftModelDrafter(draft),
                               "early exit": sp.EarlyExitDrafter(target, 2)}


def test_token_html_colours_each_token_by_its_origin():
    out = spw.token_html([" It", " is", "<eos>", "&"], [sp.TARGET, sp.ACCEPTED, sp.BONUS, sp.RESAMPLED])
    assert re.findall(r"class='spec-(\w+)'", out) == ["target", "accepted", "bonus", "resampled"]
    assert "&amp;" in out and "&lt;eos&gt;" in out                         # text is escaped
    with pytest.raises(ValueError, match="one kind per token"):
        spw.token_html(["a"], [])
    with pytest.raises(ValueError, match="unknown token kind 'guessed'"):
        spw.token_html(["a"], ["guessed"])


def test_format_run_and_totals():
    result = sp.SpeculativeResult([5, 6, 7, 8, 9], 0.1, [0.0] * 4, 0.2, 3, num_speculative_tokens=4,
                                  drafted_per_step=[4, 4], accepted_per_step=[3, 0])
    summary = spw.run_summary(result, plain_s_per_token=0.004, spec_s_per_token=0.002)
    assert spw.format_run(summary) == ("k=4 · accepted 3 of 8 guesses (37.5%) · 2.50 tokens per target forward · "
                                       "2.00× plain decoding's speed")
    totals = spw.Totals().add(summary).add(dict(summary, drafted=2, accepted=2, spec_s_per_token=0.004))
    assert spw.format_totals(totals) == ("2 runs · accepted 5 of 10 guesses (50.0%) · 1.33× plain decoding's "
                                         "speed overall")                # (0.02 + 0.02) / (0.01 + 0.02)
    empty = spw.run_summary(sp.SpeculativeResult([5], 0.1, [], 0.1, 3, num_speculative_tokens=2), 0.1, 0.1)
    assert spw.format_run(empty) == "k=2 · accepted 0 of 0 guesses (no guesses) · – tokens per target forward · " \
                                    "1.00× plain decoding's speed"


def test_widget_runs_for_real_and_follows_its_controls(models):
    target, tokenizer, drafters = models
    box = spw.build_speculative_widget(target, tokenizer, drafters, PROMPT, k=4, repeats=1)
    ids = tokenizer.encode(PROMPT)
    plain = llminfer.generate(target, ids, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id).token_ids
    state = box.state
    assert state.result.token_ids == plain and state.result.num_speculative_tokens == 4
    assert state.result.drafter.startswith("prompt lookup")
    assert box.text_view.value.count("class='spec-") == len(plain)
    assert box.run_view.value == state.run_text
    assert box.totals_view.value.startswith("1 run · ")

    box.k_slider.value = 2                                                    # the reader moves k
    assert box.state.result.num_speculative_tokens == 2 and box.state.result.token_ids == plain
    assert max(box.state.result.drafted_per_step) <= 2
    box.drafter_choice.value = "draft model"
    assert box.state.result.drafter.startswith("draft model") and box.state.result.token_ids == plain
    assert box.totals.runs == 3
    assert box.totals.accepted == sum(s["accepted"] for s in box.totals.history)
    assert box.totals_view.value.startswith("3 runs · accepted ")

    box.temperature_slider.value = 1.0                                       # sampling: a real draw, same machinery
    assert box.totals.runs == 4 and box.state.result.token_ids
    assert len(box.state.result.token_kinds) == len(box.state.result.token_ids)

    box.prompt_box.value = "I love " * 80                                    # longer than the model's context
    assert "max_seq_len" in box.run_view.value and box.totals.runs == 4
