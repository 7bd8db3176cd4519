"""Chapter 14's exercises: a token routed by hand, distinct experts, bytes per token against the batch, the
all-to-all time of a DeepSeek-V3 decode step."""
from __future__ import annotations

from . import as_number, as_numbers, as_whole, close, exercise, not_a

# Section 1's router matrix (one row per expert) and the fourth token of 14.1.
W_ROUTER = ((1.0, 0.0, 0.5), (0.0, 1.2, 0.2), (0.5, 0.3, -1.0), (-1.0, 0.4, 1.0))
TOKEN = (0.0, 0.0, 2.0)
TOP_K = 2
BYTES_BELOW = 1e9                                     # 14.3: one gigabyte per token
EP_SHAPE, EP_GPUS, EP_BATCH = "deepseek-v3", 64, 32  # 14.4


def _routed():
    import torch
    from ..moe import route
    logits = torch.tensor([[sum(x * w for x, w in zip(TOKEN, row)) for row in W_ROUTER]])
    weights, ids = route(logits, TOP_K, softmax_before_topk=False, normalize=False)
    return ids[0].tolist(), weights[0].tolist(), [round(v, 3) for v in logits[0].tolist()]


@exercise("14.1", "the experts and Mixtral weights of the token [0, 0, 2] under section 1's router")
def routed_by_hand(answer):
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return not_a("a pair (ids, weights)", answer)
    ids, weights = as_numbers(answer[0], TOP_K), as_numbers(answer[1], TOP_K)
    if ids is None or weights is None:
        return not_a(f"two lists of {TOP_K} numbers (ids, weights)", answer)
    want_ids, want_weights, logits = _routed()
    if sorted(ids) != sorted(want_ids):
        return False, (f"the logits are {logits}: the router's row for expert e dotted with the token; keep the "
                       f"{TOP_K} largest")
    if [int(i) for i in ids] != want_ids:
        return False, f"the ids come largest logit first: {want_ids}"
    if close(sum(weights), 1.0, rel=1e-3) and not all(close(w, v, rel=1e-3) for w, v in zip(weights, want_weights)):
        return False, "the weights are a softmax over the two kept logits, in the order of the ids"
    if not all(close(w, v, rel=1e-3) for w, v in zip(weights, want_weights)):
        return False, ("Mixtral takes the softmax over the k kept logits only, so the two weights sum to 1 "
                       "(section 1)")
    return True, f"logits {logits}: experts {want_ids} with weights {[round(w, 3) for w in want_weights]}"


@exercise("14.2", "expected distinct experts a batch of 4 tokens reads in one Mixtral-8x7B layer")
def distinct_experts(answer):
    from ..costs import expected_distinct_experts
    value = as_number(answer)
    if value is None:
        return not_a("a number of experts", answer)
    want = expected_distinct_experts(8, 2, 4)
    if close(value, 8):
        return False, "not every expert: all 4 tokens miss a given expert with probability (1 − 2/8)^4"
    if close(value, 2 * 4):
        return False, "k · B = 8 counts an expert twice when two tokens pick it; use E · (1 − (1 − k/E)^B)"
    if close(value, 8 * (1 - (1 - 1 / 8) ** 4), rel=1e-3):
        return False, "each token picks k = 2 experts, so it misses one with probability 1 − k/E = 6/8"
    if not close(value, want, rel=1e-3):
        return False, f"{value:g}: E · (1 − (1 − k/E)^B) with E = 8, k = 2, B = 4 (section 3)"
    return True, f"8 · (1 − 0.75⁴) = {want:.3f} of 8 experts"


def _qwen_bytes(batch: int) -> float:
    from .. import costs
    from ..config import PRESETS
    return costs.moe_decode_step_bytes(PRESETS["qwen3-30b-a3b"], batch_size=batch).per_token_bytes


@exercise("14.3", "the smallest power-of-two batch at which Qwen3-30B-A3B reads under 1 GB per token")
def batch_under_a_gigabyte(answer):
    batch = as_whole(answer)
    if batch is None or batch < 1 or batch & (batch - 1):
        return not_a("a power of two", answer)
    want = next(2 ** i for i in range(20) if _qwen_bytes(2 ** i) < BYTES_BELOW)
    if batch < want:
        return False, (f"at batch {batch} a step reads {_qwen_bytes(batch) / 1e9:.2f} GB per token: its tokens "
                       "touch more experts than the active size suggests (section 3's plot)")
    if batch > want:
        return False, f"batch {batch // 2} already reads {_qwen_bytes(batch // 2) / 1e9:.2f} GB per token"
    return True, (f"batch {want}: {_qwen_bytes(want) / 1e9:.2f} GB per token, against "
                  f"{_qwen_bytes(want // 2) / 1e9:.2f} GB at {want // 2}")


def _ep_ms(dispatch_bytes: int, combine_bytes: int) -> float:
    from ..config import PRESETS
    from ..parallel import expert
    from ..parallel.cost_model import LINKS
    return expert.predict_ep_step(PRESETS[EP_SHAPE], EP_BATCH, EP_GPUS, LINKS["nvlink4"], LINKS["ib-ndr"],
                                  dispatch_bytes=dispatch_bytes, combine_bytes=combine_bytes).step_seconds * 1e3


@exercise("14.4", "DeepSeek-V3 on 64 GPUs, 32 tokens each: all-to-all ms of a step, FP8 dispatch, BF16 combine")
def ep_step_ms(answer):
    value = as_number(answer)
    if value is None:
        return not_a("a number of milliseconds", answer)
    want = _ep_ms(1, 2)
    if close(value, _ep_ms(2, 2), rel=0.01):
        return False, "that is BF16 both ways: pass dispatch_bytes=1 for the FP8 dispatch"
    if close(value, _ep_ms(1, 1), rel=0.01):
        return False, "the combine stays in BF16 (combine_bytes=2); only the dispatch is FP8"
    if close(value, _ep_ms(1, 2) / 58, rel=0.01):
        return False, "that is one MoE layer; a step runs a dispatch and a combine in each of the 58"
    if not close(value, want, rel=0.01):
        return False, (f"{value:g} ms: predict_ep_step(deepseek-v3, 32, 64, NVLink 4, InfiniBand NDR, "
                       "dispatch_bytes=1, combine_bytes=2).step_seconds (section 5)")
    return True, f"{want:.2f} ms against {_ep_ms(2, 2):.2f} ms with BF16 both ways"
