"""Chapter 04's exercises: a cache's bytes per token, the sequences that fit beside the weights, where a recomputed
step costs ten cached ones on the reader's machine, and roll-back added to the scratch cache."""
from __future__ import annotations

import numpy as np

from . import as_number, as_whole, close, exercise, not_a, run_code

BYTES_SHAPE = "qwen2.5-7b"                                    # 04.1, in bfloat16
FIT_SHAPE, FIT_MEMORY, FIT_CONTEXT = "llama-3-8b", 24 * 2**30, 4096   # 04.2: a 24 GiB device, bfloat16
TIMES = 10                                                    # 04.3: a recomputed step as long as this many cached


def _preset(name):
    from ..config import get_preset
    return get_preset(name)


@exercise("04.1", "KV-cache bytes per token of Qwen2.5-7B in bfloat16")
def bytes_per_token(answer):
    value = as_whole(answer)
    if value is None:
        return not_a("a whole number of bytes", answer)
    from ..costs import kv_cache_bytes
    cfg = _preset(BYTES_SHAPE)
    want = kv_cache_bytes(cfg, 1, 2)
    if value == want:
        return True, (f"2 × {cfg.n_layers} layers × {cfg.n_kv_heads} K/V heads × {cfg.head_dim} × 2 bytes = "
                      f"{want:,} bytes ({want // 1024} KiB) a token")
    mistakes = {want * cfg.n_heads // cfg.n_kv_heads: f"that counts all {cfg.n_heads} query heads; grouped-query "
                                                       f"attention stores only the {cfg.n_kv_heads} K/V heads",
                want // 2: "that stores K or V, not both: the factor 2 in the formula (section 7)",
                want * 2: "that is float32's 4 bytes per value; bfloat16 takes 2",
                want // cfg.n_layers: f"that is one layer's; every one of the {cfg.n_layers} layers keeps its own",
                want // 1024: "that is the answer in KiB; the exercise asks for bytes"}
    if value in mistakes:
        return False, mistakes[value]
    return False, (f"{value:,} bytes: multiply 2 (K and V) × layers × K/V heads × head_dim × bytes per value, "
                   f"from the preset's config (llminfer.get_preset({BYTES_SHAPE!r}))")


@exercise("04.2", "sequences of 4096 tokens that fit beside Llama-3-8B's weights in 24 GiB (bfloat16)")
def sequences_that_fit(answer):
    value = as_whole(answer)
    if value is None:
        return not_a("a whole number of sequences", answer)
    from ..costs import kv_cache_bytes
    cfg = _preset(FIT_SHAPE)
    weights, per_sequence = cfg.n_params() * 2, kv_cache_bytes(cfg, FIT_CONTEXT, 2)
    want = (FIT_MEMORY - weights) // per_sequence
    if value == want:
        return True, (f"(24 GiB − {weights / 2**30:.1f} GiB of weights) ÷ {per_sequence / 2**20:.0f} MiB a sequence "
                      f"= {want} sequences: the cache, not the model, caps the batch")
    if value == FIT_MEMORY // per_sequence:
        return False, "the weights take their share of the 24 GiB first; the cache gets what is left"
    if value == (FIT_MEMORY - weights) // (per_sequence * cfg.n_heads // cfg.n_kv_heads):
        return False, f"that stores all {cfg.n_heads} query heads; Llama 3 keeps {cfg.n_kv_heads} K/V heads a layer"
    if value == want + 1:
        return False, "round down: a sequence whose cache does not fit whole does not run"
    return False, (f"{value}: each sequence of {FIT_CONTEXT} tokens needs kv_cache_bytes(cfg, {FIT_CONTEXT}, 2) bytes; "
                   "divide what the weights leave of 24 GiB (2**30 bytes each) by it, and round down (section 7)")


def flop_crossing(config, times: float = TIMES) -> int:
    """The context at which a recompute's FLOPs reach `times` those of a cached step: where FLOPs alone would put it."""
    from ..costs import decode_step_flops, prefill_flops
    return next(n for n in range(2, 1 << 20)
                if prefill_flops(config, n) >= times * decode_step_flops(config, cached_len=n - 1))


@exercise("04.3", "the context at which one recomputed step takes ten cached ones, from your own sweep")
def ten_steps_crossing(answer, sweep=None, config=None):
    value = as_number(answer)
    if value is None:
        return not_a("a number of tokens", answer)
    if not sweep or config is None:
        return False, "pass your measurements: check('04.3', n, sweep=sweep, config=scfg) (section 8's sweep)"
    contexts = np.array([r["n"] for r in sweep], dtype=float)
    slope, intercept = np.polyfit(contexts, [r["recompute_s"] for r in sweep], 1)
    cached = float(np.mean([r["cached_s"] for r in sweep]))
    if slope <= 0:
        return False, ("in your sweep the recomputed step does not grow with the context (a busy machine?): "
                       "run section 8 again before answering")
    want = (TIMES * cached - intercept) / slope
    if close(value, want, rel=0.1, abs_=4):
        return True, (f"{want:.0f} tokens on your machine: the recompute grows {slope * 1e3:.2f} ms a token from "
                      f"{intercept * 1e3:.0f} ms, against a flat {cached * 1e3:.1f} ms cached step")
    flops_say = flop_crossing(config)
    if abs(value - flops_say) <= 2:
        return False, (f"{flops_say} tokens is where the FLOP ratio reaches {TIMES}×; the time ratio gets there much "
                       f"later, because the cached step still reads every weight (section 8): fit the times")
    return False, (f"{value:.0f} tokens: with your sweep's line the recompute takes {TIMES}× your mean cached step "
                   f"({cached * 1e3:.1f} ms) at about {want:.0f} tokens: solve intercept + slope · n = {TIMES} × cached")


def _tiny():
    from ..checkpoint import load_pretrained
    return load_pretrained("tiny-capitals", device="cpu")


@exercise("04.4", "truncate(length) added to the scratch cache of section 1: roll back, then decode again")
def scratch_truncate(answer):
    if not isinstance(answer, type) or not callable(getattr(answer, "truncate", None)):
        return not_a("a class: section 1's ScratchKVCache with a truncate(length) method", answer)
    import torch
    model, tokenizer = _tiny()
    cfg = model.config
    prompt = tokenizer.encode("The capital of France is")
    cache, error = run_code(answer, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 16, model.device, model.dtype)
    if error:
        return False, error
    with torch.inference_mode():
        logits = model(torch.tensor([prompt]), cache=cache, last_only=True)[:, -1]
        first = int(logits.argmax(-1))
        token = torch.tensor([[first]])
        for _ in range(3):                                         # three steps that are then taken back
            token = model(token, cache=cache)[:, -1].argmax(-1, keepdim=True)
        _, error = run_code(cache.truncate, len(prompt) + 1)
        if error:
            return False, error
        if cache.length != len(prompt) + 1:
            return False, (f"after truncate({len(prompt) + 1}) the cache holds {cache.length} positions: the length "
                           "is what says where the next token goes and which positions attention reads")
        other = tokenizer.encode(" Rome")[0]                        # a different continuation after the roll-back
        mine = model(torch.tensor([[other]]), cache=cache)[:, -1]
        fresh_cache = model.new_cache(batch_size=1, max_seq_len=16)
        fresh = model(torch.tensor([prompt + [first, other]]), cache=fresh_cache, last_only=True)[:, -1]
    gap = float((mine - fresh).abs().max())
    if cache.length != len(prompt) + 2 or gap > 1e-4:
        return False, (f"after the roll-back a new token's logits differ from a fresh prefill by {gap:.2g} (length "
                       f"{cache.length}): the next write must land at position {len(prompt) + 1}, and attention "
                       "must read positions below it only")
    return True, (f"rolled back from {len(prompt) + 4} to {len(prompt) + 1} positions; the next token's logits equal a "
                  f"fresh prefill's (within {gap:.0e}): what speculative decoding does with rejected guesses "
                  "(chapter 09)")
