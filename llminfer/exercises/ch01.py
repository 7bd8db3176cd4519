"""Chapter 01's exercises: the latency names, the loop's forward passes, the loop written, E2E predicted."""
from __future__ import annotations

import functools

import torch

from . import as_number, as_numbers, as_wholes, close, exercise, not_a, run_code

# 01.1: a request of 32 tokens, its first after 120 ms, its 31 gaps 15 ms on average
TOKENS, TTFT_MS, MEAN_GAP_MS = 32, 120.0, 15.0
JAPAN = "The capital of Japan is"          # 01.2's prompt
LOOP_PROMPTS = ("The capital of France", "The capital of Peru is")   # 01.3 runs the reader's loop on these
PREDICT_TOKENS = 48                        # 01.4: the answer's length


@functools.lru_cache(maxsize=1)
def bundled():
    """The bundled model and tokenizer, loaded once for the checkers."""
    from .. import load_pretrained
    return load_pretrained("tiny-capitals", device="cpu")


@exercise("01.1", "TPOT and E2E from a request's TTFT and gaps")
def tpot_and_e2e(answer):
    numbers = as_numbers(answer, 2)
    if numbers is None:
        return not_a("two numbers (tpot_ms, e2e_ms)", answer)
    tpot, e2e = numbers
    want_tpot, want_e2e = MEAN_GAP_MS, TTFT_MS + (TOKENS - 1) * MEAN_GAP_MS
    if not close(tpot, want_tpot):
        if close(tpot, (TTFT_MS + (TOKENS - 1) * MEAN_GAP_MS) / TOKENS):
            return False, ("TPOT leaves the first token out: it is (E2E − TTFT) / (tokens − 1), the mean gap, not "
                           "E2E / tokens (the table at the top of the chapter)")
        return False, f"TPOT {tpot:g} ms: TPOT is a request's mean inter-token gap (section 'TTFT, ITL, TPOT and E2E')"
    if close(e2e, TTFT_MS + TOKENS * MEAN_GAP_MS):
        return False, (f"E2E {e2e:g} ms counts one gap too many: {TOKENS} tokens have {TOKENS - 1} gaps between "
                       "them, E2E = TTFT + (N − 1) × TPOT")
    if close(e2e, TOKENS * MEAN_GAP_MS) or close(e2e, (TOKENS - 1) * MEAN_GAP_MS):
        return False, f"E2E {e2e:g} ms leaves out the wait for the first token: E2E = TTFT + (N − 1) × TPOT"
    if not close(e2e, want_e2e):
        return False, f"E2E {e2e:g} ms: E2E = TTFT + (N − 1) × TPOT (the assert cell after the 20 requests)"
    return True, f"TPOT {want_tpot:g} ms, E2E = {TTFT_MS:g} + {TOKENS - 1} × {MEAN_GAP_MS:g} = {want_e2e:g} ms"


@exercise("01.2", "forward passes and positions read by the loop without a cache")
def passes_and_positions(answer):
    numbers = as_wholes(answer, 2)
    if numbers is None:
        return not_a("two whole numbers (forward_passes, positions_read)", answer)
    passes, positions = numbers
    from .. import generate
    model, tokenizer = bundled()
    prompt = tokenizer.encode(JAPAN)
    made = generate(model, prompt, max_new_tokens=32, eos_token_id=tokenizer.eos_token_id).token_ids
    want_passes = len(made)                                           # one forward per token, the EOS included
    want_positions = sum(len(prompt) + step for step in range(want_passes))
    if passes != want_passes:
        if passes == want_passes - 1:
            return False, ("the token that stops the loop, end-of-sequence, is also predicted by a forward pass: "
                           "count it (the step table in 'The loop, one step at a time')")
        if passes == len(prompt) + want_passes:
            return False, "the prompt is read in one forward pass, the prefill, not one pass per prompt token"
        return False, (f"{passes} forward passes: run the loop of 'The loop, one step at a time' on {JAPAN!r} and "
                       "count its steps")
    if positions == want_passes * len(prompt):
        return False, "each step reads the prompt and every token generated before it, so later steps read more"
    if positions != want_positions:
        return False, (f"{positions} positions: step s reads the {len(prompt)}-token prompt plus the s tokens "
                       "generated before it (the column 'tokens read')")
    return True, (f"{want_passes} passes (prefill + {want_passes - 1} decode steps) reading "
                  f"{' + '.join(str(len(prompt) + s) for s in range(want_passes))} = {want_positions} positions")


@exercise("01.3", "the greedy loop written as a function")
def greedy_loop(answer):
    if not callable(answer):
        return not_a("a function greedy(model, prompt_ids, max_new_tokens, eos_token_id) -> new token ids", answer)
    from .. import generate
    model, tokenizer = bundled()
    for text in LOOP_PROMPTS:
        prompt = tokenizer.encode(text)
        want = generate(model, prompt, max_new_tokens=12, eos_token_id=tokenizer.eos_token_id).token_ids
        with torch.no_grad():
            got, error = run_code(answer, model, list(prompt), 12, tokenizer.eos_token_id)
        if error:
            return False, error
        got = got.tolist() if hasattr(got, "tolist") else got
        if not isinstance(got, (list, tuple)) or not all(isinstance(t, int) for t in got):
            return not_a("a list of int token ids", got)
        got = list(got)
        if got[:len(prompt)] == prompt and got[len(prompt):] == want:
            return False, "return only the new tokens, not the prompt in front of them"
        if got[:len(want)] == want and len(got) > len(want):
            return False, (f"on {text!r} the loop ran past end-of-sequence (id {tokenizer.eos_token_id}): stop "
                           "after appending it")
        if got != want:
            return False, (f"on {text!r} your loop made {tokenizer.tokens(got)}, generate made "
                           f"{tokenizer.tokens(want)}: take logits at the last position, argmax, append, repeat")
    return True, f"the same tokens as llminfer.generate on {len(LOOP_PROMPTS)} prompts"


@exercise("01.4", "E2E of a 48-token answer predicted from your TTFT and TPOT")
def predicted_e2e(answer, ttft_ms=None, tpot_ms=None):
    measured = [as_number(ttft_ms), as_number(tpot_ms)]
    if None in measured or min(measured) <= 0:
        return False, ("pass your own medians, in ms: check('01.4', e2e_ms, ttft_ms=ttft[50], tpot_ms=tpot[50]) "
                       "from 'TTFT, ITL, TPOT and E2E, measured'")
    ttft, tpot = measured
    e2e = as_number(answer)
    if e2e is None:
        return not_a("a number of milliseconds", answer)
    want = ttft + (PREDICT_TOKENS - 1) * tpot
    if close(e2e * 1e3, want, rel=0.01):
        return False, f"{e2e:g} looks like seconds: give the prediction in ms"
    if close(e2e, ttft + PREDICT_TOKENS * tpot, rel=0.005):
        return False, f"one gap too many: {PREDICT_TOKENS} tokens have {PREDICT_TOKENS - 1} gaps after the first"
    if close(e2e, PREDICT_TOKENS * tpot, rel=0.01):
        return False, "the first token waits for the prefill: add the TTFT"
    if not close(e2e, want, rel=0.01):
        return False, (f"{e2e:.2f} ms is not TTFT + {PREDICT_TOKENS - 1} × TPOT with your machine's medians "
                       f"({ttft:.2f} ms and {tpot:.3f} ms)")
    return True, (f"{ttft:.2f} + {PREDICT_TOKENS - 1} × {tpot:.3f} = {want:.1f} ms on your machine; the decode "
                  f"steps are {(want - ttft) / want:.0%} of it")
