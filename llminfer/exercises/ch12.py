"""Chapter 12's exercises: a prompt's K/V transfer bytes, transfer against recompute, the break-even link."""
from __future__ import annotations

import functools

from . import as_number, as_numbers, as_whole, close, exercise, not_a

REAL_MODEL, QUESTION = "smollm2-135m-instruct", "What is the capital of France?"     # 12.1, bfloat16
PROMPT = 4096                                          # 12.2 and 12.3, as section 3's model
LINK_BYTES_PER_S = 12.5e9                              # 12.2: 100 Gb Ethernet
H100_BF16_DENSE, ASSUMED_MFU = 989e12, 0.5             # section 3's prefill model
GROUP = ("llama-3-70b", 4)                             # 12.3: a TP group of 4 H100s, each sending its share


@functools.lru_cache(maxsize=1)
def chat_prompt_tokens() -> tuple[int, int]:
    """(tokens of QUESTION through SmolLM2's chat template, tokens of the question alone), from the real tokenizer."""
    from ..checkpoint import load_tokenizer
    tokenizer = load_tokenizer(REAL_MODEL)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    return len(ids), len(tokenizer.encode(QUESTION))


@exercise("12.1", "K/V bytes the prefill worker sends for one chat prompt on SmolLM2-135M-Instruct, bfloat16")
def transfer_bytes(answer):
    from .. import costs
    from .ch02 import real_config
    nbytes = as_whole(answer)
    if nbytes is None:
        return not_a("a whole number of bytes", answer)
    cfg = real_config()
    templated, bare = chat_prompt_tokens()
    want = costs.kv_cache_bytes(cfg, templated, 2)
    if nbytes == costs.kv_cache_bytes(cfg, bare, 2):
        return False, (f"the prompt the model reads is the chat template's, {templated} tokens with the system "
                       f"message and role markers, not the question's {bare} (chapter 01's chat prompt)")
    if nbytes == want * 2:
        return False, "bfloat16 is 2 bytes a value"
    if nbytes == want // 2:
        return False, "both K and V are sent"
    if nbytes != want:
        return False, (f"{nbytes:,}: 2 × layers × K/V heads × head_dim × tokens × bytes per value "
                       "(section 3's formula)")
    return True, (f"{templated} tokens × {costs.kv_bytes_per_token(cfg, 2):,} bytes = {want:,} bytes "
                  f"({want / 2**20:.2f} MiB)")


def _transfer_and_prefill(shape: str, gpus: int, bytes_per_s: float) -> tuple[float, float, int]:
    from .. import costs
    from ..config import PRESETS
    cfg = PRESETS[shape]
    nbytes = costs.kv_cache_bytes(cfg, PROMPT, 2)
    prefill_s = costs.prefill_flops(cfg, PROMPT) / (gpus * H100_BF16_DENSE * ASSUMED_MFU)
    return nbytes / gpus / bytes_per_s, prefill_s, nbytes


@exercise("12.2", "Llama 3.1 8B, 4096 tokens: K/V over 100 Gb Ethernet against the prefill, in ms")
def transfer_against_prefill(answer):
    numbers = as_numbers(answer, 2)
    if numbers is None:
        return not_a("two numbers (transfer_ms, prefill_ms)", answer)
    transfer_ms, prefill_ms = numbers
    transfer_s, prefill_s, nbytes = _transfer_and_prefill("llama-3.1-8b", 1, LINK_BYTES_PER_S)
    if close(transfer_ms, transfer_s * 1e3 / 8, rel=0.01):
        return False, "100 Gb/s is gigabits: 12.5 GB/s of bytes"
    if close(transfer_ms, transfer_s * 1e3 * 2, rel=0.01):
        return False, "the K/V is sent in bfloat16: 2 bytes a value"
    if not close(transfer_ms, transfer_s * 1e3, rel=0.01):
        return False, f"{transfer_ms:g} ms: the K/V bytes (costs.kv_cache_bytes) over 12.5 GB/s"
    if close(prefill_ms, prefill_s * 1e3 / ASSUMED_MFU, rel=0.01):
        return False, "section 3 assumes the prefill reaches 50 % of the H100's dense peak, not all of it"
    if not close(prefill_ms, prefill_s * 1e3, rel=0.01):
        return False, (f"{prefill_ms:g} ms: the prefill's FLOPs (costs.prefill_flops) over 50 % of 989 TFLOP/s "
                       "(section 3)")
    return True, (f"{nbytes / 2**30:.2f} GiB in {transfer_s * 1e3:.1f} ms against a {prefill_s * 1e3:.0f} ms "
                  f"prefill: moving it is {prefill_s / transfer_s:.1f}× cheaper than recomputing")


@exercise("12.3", "the link bandwidth at which moving Llama 3 70B's K/V costs as much as its prefill")
def break_even(answer):
    shape, gpus = GROUP
    value = as_number(answer)
    if value is None:
        return not_a("a number of GB/s", answer)
    transfer_s, prefill_s, nbytes = _transfer_and_prefill(shape, gpus, 1e9)     # transfer_s: seconds at 1 GB/s
    want = transfer_s / prefill_s                                              # GB/s per link
    if close(value, want * gpus, rel=0.01):
        return False, (f"each of the {gpus} GPUs holds a quarter of the K/V heads and sends its own share over its "
                       "own link (section 3): divide the bytes by 4")
    if close(value, want * 1e9, rel=0.01):
        return False, "give it in GB/s"
    if not close(value, want, rel=0.01):
        return False, f"{value:g} GB/s: the bandwidth at which one GPU's share of the bytes takes the prefill's time"
    return True, (f"{nbytes / gpus / 2**30:.2f} GiB per GPU in the {prefill_s * 1e3:.0f} ms prefill: {want:.2f} GB/s; "
                  "any faster link makes the transfer the cheaper way")
