"""Chapter 09 in the browser: the speculative-decoding widget reports what a replay of plain greedy output predicts."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NOTEBOOK = "09_speculative_decoding.ipynb"
# The chapter's widget: this prompt, 24 new tokens at most, stop at <eos>, greedy until the temperature moves.
PROMPT = "What is the capital of Sri Lanka? It is Sri Jayawardenepura Kotte. What is the capital of Sri Lanka?"
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def replay():
    """Per (drafter, k): accepted and drafted guesses, target forwards and token kinds, worked out from plain
    greedy output: each step's guesses stand while they match it (no speculative loop involved)."""
    import torch

    import llminfer
    from llminfer import speculative

    torch.set_num_threads(1)
    model, tokenizer = llminfer.load_pretrained("tiny-capitals", device="cpu")
    draft, _ = llminfer.load_pretrained("tiny-capitals-draft", device="cpu")
    prompt = tokenizer.encode(PROMPT)
    plain = llminfer.generate(model, prompt, max_new_tokens=MAX_NEW_TOKENS,
                              eos_token_id=tokenizer.eos_token_id).token_ids
    assert plain[-1] == tokenizer.eos_token_id

    def run(drafter, k):
        context, produced = prompt + plain[:1], 1
        accepted = drafted = steps = 0
        kinds = ["target"]
        while produced < len(plain):
            budget = min(k, MAX_NEW_TOKENS - produced - 1)
            guesses = drafter.propose(context, budget)[:budget] if budget else []
            rest = plain[produced:]
            n = 0
            while n < len(guesses) and n < len(rest) and guesses[n] == rest[n]:
                n += 1
            emitted = rest[:n + 1]
            last = "target" if not guesses else "bonus" if n == len(guesses) else "resampled"
            kinds += (["accepted"] * n + [last])[:len(emitted)]
            accepted += min(n, len(emitted))
            drafted += min(len(guesses), len(rest)) if n + 1 >= len(rest) else len(guesses)  # none past <eos>
            steps += 1
            context += emitted
            produced += len(emitted)
        return {"accepted": accepted, "drafted": drafted, "tokens_per_step": (accepted + steps) / steps,
                "kinds": kinds}

    return {("prompt lookup", 4): run(speculative.PromptLookupDrafter(max_ngram=3), 4),
            ("prompt lookup", 2): run(speculative.PromptLookupDrafter(max_ngram=3), 2),
            ("draft model", 2): run(speculative.DraftModelDrafter(draft), 2)}


def run_line(row: dict, k: int) -> re.Pattern:
    share = f"{row['accepted'] / row['drafted']:.1%}" if row["drafted"] else "no guesses"
    return re.compile(rf"^k={k} · accepted {row['accepted']} of {row['drafted']} guesses \({re.escape(share)}\) · "
                      rf"{row['tokens_per_step']:.2f} tokens per target forward · \d+\.\d\d× plain decoding's speed$")


def test_controls_rerun_and_the_counts_match_a_replay(lab, replay, artifacts_dir):
    lab.open(NOTEBOOK)
    lab.run_all(timeout_ms=600_000)
    text = lab.widget("llminfer-spec-text")
    line = lab.widget("llminfer-spec-run")
    totals = lab.widget("llminfer-spec-totals")
    k_slider = lab.widget("llminfer-spec-k")
    drafter = lab.widget("llminfer-spec-drafter")
    temperature = lab.widget("llminfer-spec-temperature")

    # the widget opens on prompt lookup, k = 4, greedy
    first = replay["prompt lookup", 4]
    expect(line).to_have_text(run_line(first, 4))
    spans = text.locator("span[class^='spec-']")
    expect(spans).to_have_count(len(first["kinds"]))
    assert [c.removeprefix("spec-") for c in spans.evaluate_all("els => els.map(e => e.className)")] == first["kinds"]
    expect(totals).to_have_text(re.compile(r"^1 run · "))

    lab.set_text(k_slider.locator(".widget-readout"), 2)                    # fewer guesses per step
    expect(line).to_have_text(run_line(replay["prompt lookup", 2], 2), timeout=60_000)

    drafter.locator("select").select_option("draft model")                 # another drafter
    expect(line).to_have_text(run_line(replay["draft model", 2], 2), timeout=60_000)
    accepted = sum(replay[key]["accepted"] for key in replay)
    drafted = sum(replay[key]["drafted"] for key in replay)
    expect(totals).to_have_text(re.compile(rf"^3 runs · accepted {accepted} of {drafted} guesses "
                                           rf"\({re.escape(f'{accepted / drafted:.1%}')}\) · \d+\.\d\d× "))

    lab.set_text(temperature.locator(".widget-readout"), 1.0)               # sampling: a fourth real run
    expect(totals).to_have_text(re.compile(r"^4 runs · "), timeout=60_000)
    expect(line).to_have_text(re.compile(r"^k=2 · accepted \d+ of \d+ guesses"))
    lab.screenshot("ch09-speculative", locator=lab.output_of(line))
