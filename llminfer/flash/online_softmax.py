"""The online softmax: one pass over the scores keeps a running (max, sum) and rescales. Chapter 07.

    online_softmax(x, block_size=1)        softmax along the last dimension, normaliser found in one pass
    online_softmax_steps(x)                the running (max, sum) after each element of a vector
    softmax_state(x)                       the (max, sum) state of a block of scores
    merge_states(m_a, l_a, m_b, l_b)       the state of two blocks from the states of each

The ordinary safe softmax reads the scores three times: once for the max, once for
the sum of exp(x - max), once to divide. Milakov and Gimelshein noticed that the max
and the sum can be found together: when a new score raises the max from m to m',
every term already in the sum was computed against m, and multiplying the sum by
exp(m - m') moves all of them to m' at once. FlashAttention applies the same rescaling
to the output rows, which is what lets it walk K and V in tiles.

A state is (m, l): m the largest score seen, l = sum of exp(x - m) over the scores
seen. Scores of -inf (masked) contribute nothing; a state that has seen only -inf is
(m=-inf, l=0), and merging it changes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["online_softmax", "online_softmax_steps", "softmax_state", "merge_states", "OnlineSoftmaxStep"]


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    """m with -inf replaced by 0: the reference point of a state that has seen only masked scores."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def softmax_state(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (m, l) of a block of scores along the last dimension: max, and sum of exp(x - max). Chapter 07."""
    m = scores.amax(dim=-1)                                          # (...,)
    l = torch.exp(scores - _safe_max(m)[..., None]).sum(dim=-1)     # (...,) exp(-inf) = 0 for masked scores
    return m, l


def merge_states(m_a: torch.Tensor, l_a: torch.Tensor, m_b: torch.Tensor,
                 l_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the (m, l) of two blocks together: both sums rescaled to the larger max. Chapter 07."""
    m = torch.maximum(m_a, m_b)
    m_ref = _safe_max(m)
    l = l_a * torch.exp(m_a - m_ref) + l_b * torch.exp(m_b - m_ref)  # exp(-inf - m) = 0: an empty state adds 0
    return m, l


def online_softmax(x: torch.Tensor, block_size: int = 1) -> torch.Tensor:
    """Softmax along the last dimension; (max, sum) found in one pass over blocks of block_size. Chapter 07.

    block_size=1 is the element-at-a-time algorithm of Milakov and Gimelshein (2018);
    larger blocks are what a tiled kernel does. A row of only -inf has no softmax: its
    output is NaN, as torch.softmax gives.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"online_softmax needs a tensor with at least one element in its last dimension; "
                         f"got {type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}")
    if not x.is_floating_point():
        raise ValueError(f"online_softmax needs floating-point scores, got {x.dtype}; convert with x.float()")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive integer (1 = one score at a time)")
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], float("-inf"), dtype=x.dtype, device=x.device)  # (...,) running max
    l = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)                # (...,) running sum
    for start in range(0, n, block_size):                 # the one pass that finds the normaliser
        m_block, l_block = softmax_state(x[..., start:start + block_size])
        m, l = merge_states(m, l, m_block, l_block)
    return torch.exp(x - m[..., None]) / l[..., None]    # (..., n); -inf - -inf = NaN for an all-masked row


@dataclass(frozen=True)
class OnlineSoftmaxStep:
    """The state after reading one more score: what chapter 07's table prints."""

    index: int           # which score was read
    score: float
    max: float           # running max m after this score
    sum: float           # running sum l = sum of exp(x_j - m) over the scores read so far
    rescale: float       # exp(m_before - m_after): what the old sum was multiplied by (1.0 if the max held)


def online_softmax_steps(x) -> list[OnlineSoftmaxStep]:
    """Returns the running (max, sum) after each score of a vector, read one at a time. Chapter 07."""
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.dim() != 1 or x.numel() == 0:
        raise ValueError(f"online_softmax_steps reads one vector of scores; got shape {tuple(x.shape)}")
    m, l = torch.tensor(float("-inf"), dtype=x.dtype), torch.tensor(0.0, dtype=x.dtype)
    steps = []
    for index, score in enumerate(x):
        m_new, l_new = merge_states(m, l, score, torch.ones_like(score))  # one score is the state (x, 1)
        rescale = torch.exp(m - _safe_max(m_new)).item()                 # 0.0 at the first score: l was 0
        steps.append(OnlineSoftmaxStep(index, score.item(), m_new.item(), l_new.item(), rescale))
        m, l = m_new, l_new
    return steps
