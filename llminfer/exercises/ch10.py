"""Chapter 10's exercises: a TP step's all-reduce bytes, a ring all-reduce's time, the bubble, the split MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import as_number, as_whole, close, exercise, not_a, run_code

TP_MODEL, TP_BATCH, TP_BYTES = "llama-3-70b", 8, 2          # 10.1: bfloat16
RING_BYTES, RING_RANKS, RING_LINK = 2**20, 8, "nvlink4"      # 10.2
STAGES, MICRO = 4, 8                                        # 10.3


@exercise("10.1", "bytes all-reduced by one TP decode step of Llama 3 70B, batch 8, bfloat16")
def allreduce_bytes(answer):
    from ..parallel import cost_model
    shape = cost_model.SHAPES[TP_MODEL]
    nbytes = as_whole(answer)
    if nbytes is None:
        return not_a("a whole number of bytes", answer)
    want = cost_model.tp_bytes_per_token(shape, batch_size=TP_BATCH, dtype_bytes=TP_BYTES)
    if nbytes == want // 2:
        return False, "two all-reduces per layer: one after attention's o_proj, one after the MLP's down_proj"
    if nbytes in (want // 8, want // 4, want // 2 // 8):
        return False, ("an all-reduce sums whole activation rows: each rank holds the full dim-wide partial sum, "
                       "so the bytes do not shrink with the TP degree (section 2)")
    if nbytes == want // TP_BATCH:
        return False, f"every sequence of the batch sends its own row: × {TP_BATCH}"
    if nbytes != want:
        return False, f"{nbytes:,}: 2 all-reduces × layers × dim × batch × bytes per number (section 3's table)"
    return True, (f"2 × {shape.n_layers} layers × {shape.dim} × {TP_BATCH} × {TP_BYTES} B = {want:,} bytes "
                  f"({want / 1e6:.1f} MB) a step, whatever the TP degree")


@exercise("10.2", "a ring all-reduce of 1 MiB over 8 GPUs on NVLink 4, in µs")
def ring_time(answer):
    from ..parallel import cost_model
    link = cost_model.LINKS[RING_LINK]
    micro_s = as_number(answer)
    if micro_s is None:
        return not_a("a number of microseconds", answer)
    want = cost_model.allreduce_seconds(RING_BYTES, RING_RANKS, link) * 1e6
    steps = (RING_RANKS - 1).bit_length()
    if close(micro_s / 1e6, want / 1e6, rel=0.01) and not close(micro_s, want, rel=0.01):
        return False, "give it in microseconds"
    if close(micro_s, (link.alpha_s * steps + RING_BYTES / link.bytes_per_s) * 1e6, rel=0.01):
        return False, ("each byte crosses the link 2(p − 1)/p times in a ring all-reduce (a reduce-scatter, then "
                       "an all-gather): multiply n/β by that")
    if close(micro_s, (link.alpha_s + 2 * (RING_RANKS - 1) / RING_RANKS * RING_BYTES / link.bytes_per_s) * 1e6,
             rel=0.01):
        return False, f"the latency α is paid once per step of the exchange, ⌈log₂ p⌉ = {steps} times in this model"
    if not close(micro_s, want, rel=0.01):
        return False, (f"{micro_s:g} µs: α × ⌈log₂ p⌉ + 2(p − 1)/p × n / β, with the link's α and β from section 5's "
                       "table (cost_model.allreduce_seconds)")
    return True, (f"{link.alpha_s * 1e6:g} µs × {steps} + 2·7/8 × 1 MiB / {link.bytes_per_s / 1e9:g} GB/s = "
                  f"{want:.2f} µs")


@exercise("10.3", "the bubble of a GPipe schedule with 4 stages and 8 micro-batches")
def bubble(answer):
    from ..parallel import ideal_bubble_fraction
    fraction = as_number(answer)
    if fraction is None:
        return not_a("a fraction between 0 and 1", answer)
    want = ideal_bubble_fraction(STAGES, MICRO)
    if close(fraction, (STAGES - 1) / MICRO):
        return False, ("the schedule lasts m + p − 1 slots, not m: the idle share is (p − 1) / (m + p − 1) "
                       "(section 6)")
    if close(fraction, 1 / STAGES) or close(fraction, (STAGES - 1) / STAGES):
        return False, "that is the one-micro-batch bubble's share per stage; more micro-batches shrink it"
    if close(fraction, 100 * want, rel=1e-3):
        return False, "a fraction, not a percentage"
    if not close(fraction, want):
        return False, f"{fraction:g}: each stage waits p − 1 slots out of m + p − 1 (section 6's timeline)"
    return True, f"(p − 1) / (m + p − 1) = 3/11 = {want:.3f}"


@exercise("10.4", "one rank's share of a tensor-parallel MLP, summed by the all-reduce")
def mlp_shard(answer):
    if not callable(answer):
        return not_a("a function mlp_shard(x, w_gate, w_up, w_down, rank, world_size) -> partial output", answer)
    generator = torch.Generator().manual_seed(0)
    tokens, dim, hidden = 3, 8, 12
    x = torch.randn(tokens, dim, generator=generator)
    w_gate, w_up = (torch.randn(hidden, dim, generator=generator) for _ in range(2))
    w_down = torch.randn(dim, hidden, generator=generator)
    want = (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T                    # (tokens, dim)
    for world_size in (2, 3, 4):
        parts, error = run_code(lambda: [answer(x, w_gate, w_up, w_down, rank, world_size)
                                         for rank in range(world_size)])
        if error:
            return False, error
        if not all(isinstance(p, torch.Tensor) and p.shape == want.shape for p in parts):
            return False, f"each rank returns a partial output of the full shape {tuple(want.shape)}"
        if all(torch.allclose(p, want, atol=1e-5) for p in parts):
            return False, "each rank computed the whole MLP: give it only its slice of the hidden units"
        if not torch.allclose(sum(parts), want, atol=1e-4):
            return False, (f"with {world_size} ranks the partial outputs do not sum to the MLP's output: rank r "
                           "takes hidden units of its slice in gate and up (rows) and in down (columns), and the "
                           "SiLU product stays inside the rank (section 2)")
    return True, "the partial outputs of 2, 3 and 4 ranks sum to the unsplit MLP: one all-reduce per MLP"
