"""Chapter 09's exercises: expected tokens per step, the speed-up with a measured verification cost, greedy acceptance."""
from __future__ import annotations

import torch

from . import as_number, close, exercise, not_a, run_code

ALPHA, K, DRAFT_COST = 0.8, 4, 0.1                              # 09.1 and 09.2


@exercise("09.1", "expected tokens per step at α = 0.8 with k = 4 guesses")
def tokens_per_step(answer):
    from ..speculative import expected_tokens_per_step
    value = as_number(answer)
    if value is None:
        return not_a("a number of tokens", answer)
    want = expected_tokens_per_step(ALPHA, K)
    if close(value, (1 - ALPHA ** K) / (1 - ALPHA)):
        return False, "the target's own token is missing: every step adds one more, α^0 + α + … + α^k (section 2)"
    if close(value, ALPHA * K + 1) or close(value, ALPHA * K):
        return False, ("guess i stands only if every guess before it did: α^i, not α; the accepted prefix ends at "
                       "the first rejection (section 2)")
    if not close(value, want):
        return False, f"{value:g}: sum α^i for i = 0..k, or (1 − α^(k+1)) / (1 − α)"
    return True, f"(1 − 0.8⁵) / (1 − 0.8) = {want:.4f} tokens per step, as speculative.expected_tokens_per_step"


@exercise("09.2", "the speed-up at α = 0.8, k = 4, c = 0.1 with your machine's verification cost v")
def speedup_with_v(answer, v=None):
    from ..speculative import expected_speedup, expected_tokens_per_step
    value = as_number(answer)
    if value is None:
        return not_a("a number (times faster than plain decoding)", answer)
    v = as_number(v)
    if v is None or v <= 0:
        return False, ("expected your measured verification cost as v=..., a positive number of target steps: "
                       "check('09.2', speedup, v=VERIFY_COST) (section 1)")
    want = expected_tokens_per_step(ALPHA, K) / (DRAFT_COST * K + v)
    if not close(v, 1.0) and close(value, expected_speedup(ALPHA, K, DRAFT_COST)):
        return False, (f"that assumes v = 1; your machine verifies 5 positions in v = {v:.2f} steps: divide by "
                       "c·k + v (section 2)")
    if close(value, expected_tokens_per_step(ALPHA, K) / (DRAFT_COST * K * v + 1)) and not close(v, 1.0):
        return False, "v is the verification's cost, added once per step: c·k + v, not c·k·v + 1"
    if not close(value, want):
        return False, f"{value:g}: expected tokens per step over the step's cost, c·k draft steps plus v"
    return True, f"{expected_tokens_per_step(ALPHA, K):.3f} / (0.1·4 + {v:.2f}) = {want:.2f}× on this machine"


def _cases():
    generator = torch.Generator().manual_seed(0)
    vocab, k = 50, 4
    for accepted in (0, 2, 4, 1, 3):
        logits = torch.randn(k + 1, vocab, generator=generator)
        best = logits.argmax(-1)
        drafts = best[:k].clone()
        if accepted < k:
            drafts[accepted] = (best[accepted] + 1) % vocab                 # the first wrong guess
            if accepted + 1 < k:
                drafts[accepted + 1:] = best[accepted + 1:k]             # later guesses agree again
        yield logits, drafts.tolist()


@exercise("09.3", "the greedy acceptance rule: the longest agreeing prefix, then the target's own token")
def greedy_rule(answer):
    from ..speculative import greedy_acceptance
    if not callable(answer):
        return not_a("a function accept(target_logits, drafts) -> (n_accepted, next_token)", answer)
    for logits, drafts in _cases():
        result, error = run_code(answer, logits.clone(), list(drafts))
        if error:
            return False, error
        if not (isinstance(result, tuple) and len(result) == 2 and all(as_number(x) is not None for x in result)):
            return not_a("a pair of whole numbers (n_accepted, next_token)", result)
        n_accepted, next_token = (int(as_number(x)) for x in result)
        want_n, want_next = (int(t[0]) for t in greedy_acceptance(logits[None], torch.tensor([drafts])))
        if (n_accepted, next_token) == (want_n, want_next):
            continue
        agree = (logits.argmax(-1)[:len(drafts)] == torch.tensor(drafts)).sum().item()
        if n_accepted == agree != want_n:
            return False, ("you counted every agreeing guess; the guesses after the first disagreement were drafted "
                           "from a wrong context and are all dropped (section 2)")
        if n_accepted == want_n:
            return False, (f"{n_accepted} accepted is right, but the target's own token is the argmax of row "
                           f"{want_n}, the row after the last accepted guess (row 0 follows the context)")
        return False, (f"drafts {drafts}: you returned ({n_accepted}, {next_token}), the rule gives ({want_n}, "
                       f"{want_next}): accept guesses while each equals the target's argmax, then take the argmax "
                       "of the next row")
    return True, "5 cases (none, some, all accepted; agreement after a miss) match speculative.greedy_acceptance"
