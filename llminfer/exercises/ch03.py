"""Chapter 03's exercises: recomputed positions counted, the ratio of work, the FLOPs of one position."""
from __future__ import annotations

import functools

from . import as_number, as_whole, close, exercise, not_a

PROMPT, NEW_TOKENS = "The capital of France is", 20       # 03.1
RATIO_PROMPT, RATIO_NEW = 100, 100                         # 03.2
REAL_MODEL = "smollm2-135m-instruct"                       # 03.3


@functools.lru_cache(maxsize=1)
def instrumented_counts() -> tuple[int, int, int]:
    """(prompt length, K/V positions computed without a cache, with one) for 03.1, counted by the hooks."""
    from .. import generate, instrument
    from .ch01 import bundled
    model, tokenizer = bundled()
    prompt = tokenizer.encode(PROMPT)
    totals = []
    for use_cache in (False, True):
        with instrument.count_kv(model) as counts:
            generate(model, prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, use_cache=use_cache)
        totals.append(counts.total)
    return len(prompt), totals[0], totals[1]


@exercise("03.1", "positions recomputed by 20 tokens without a cache, by formula, against the hooks' count")
def recomputed_positions(answer):
    recomputed = as_whole(answer)
    if recomputed is None:
        return not_a("a whole number of positions", answer)
    prompt_len, without, with_cache = instrumented_counts()
    n = NEW_TOKENS
    want = without - with_cache                          # every position computed again after its first time
    if recomputed == without:
        return False, (f"{without} is every position computed; {with_cache} of those are first calculations "
                       "(what a cache computes): subtract them (section 1's 'recomputed')")
    if recomputed == n * (n - 1) // 2 or recomputed == n * (n - 1) // 2 - (n - 1):
        return False, ("each uncached step runs the whole prompt again too: the N·P term of N·P + N(N−1)/2 "
                       "(section 3)")
    if recomputed != want:
        return False, (f"{recomputed}: without a cache, N·P + N(N−1)/2 positions are computed (P = {prompt_len} "
                       f"prompt tokens here), with one P + N − 1; the difference is recomputed")
    return True, (f"{n}·{prompt_len} + {n}·{n - 1}/2 − ({prompt_len} + {n} − 1) = {want}, as instrument.count_kv "
                  f"counts on the bundled model ({without} − {with_cache})")


@exercise("03.2", "ratio of positions computed without and with a cache, P = 100, N = 100")
def positions_ratio(answer):
    from ..widgets.recompute import closed_form_totals
    ratio = as_number(answer)
    if ratio is None:
        return not_a("a number (positions without a cache / with one)", answer)
    without, with_cache = closed_form_totals(RATIO_PROMPT, RATIO_NEW)
    want = without / with_cache
    if close(ratio, RATIO_NEW / 2, rel=0.02):
        return False, ("N/2 would hold for a one-token prompt; here every uncached step re-runs the 100-token "
                       "prompt as well, which pushes the ratio above N/2 (section 3's table)")
    if close(ratio, 1 / want, rel=0.01):
        return False, "that is with / without; the exercise asks without / with, which is above 1"
    if not close(ratio, want, rel=0.005):
        return False, f"{ratio:g}: without a cache N·P + N(N−1)/2 positions, with one P + N − 1 (section 3)"
    return True, f"{without:,} / {with_cache} = {want:.1f}, above N/2 = {RATIO_NEW // 2} because of the N·P term"


@exercise("03.3", "matmul FLOPs of one position through SmolLM2-135M-Instruct's layer stack")
def flops_per_position(answer):
    from .. import costs
    from .ch02 import real_config
    cfg = real_config()
    flops = as_whole(answer)
    if flops is None:
        return not_a("a whole number of FLOPs", answer)
    want = 2 * cfg.n_layers * costs.layer_matmul_params(cfg)
    head = 2 * cfg.dim * cfg.vocab_size
    if flops == want // 2:
        return False, "each weight costs a multiply and an add: 2 FLOPs per weight (section 2)"
    if flops == want + head:
        return False, ("the output head runs once per forward call, on the last position only, not on every "
                       "position: leave it out (section 2's `head`)")
    if flops == want // cfg.n_layers:
        return False, f"that is one layer; the stack has {cfg.n_layers}"
    if flops != want:
        return False, (f"{flops:,}: 2 × layers × the weights one layer multiplies a token by (q, k, v, o, gate, up, "
                       "down), from the model's config (section 2)")
    return True, (f"2 × {cfg.n_layers} × {costs.layer_matmul_params(cfg):,} = {want:,} FLOPs, about twice the "
                  "non-embedding parameters")
