"""How one request wants its tokens chosen and when it stops. Chapter 05."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..generate import check_sampling

__all__ = ["SamplingParams"]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request: greedy by default, stops at max_new_tokens or eos. Chapter 05.

    The same settings as `llminfer.generate`, checked the same way when made (the eos id is checked
    against the model's vocabulary when the request reaches an engine). With a `seed`, a request
    sampled at temperature > 0 draws the same tokens as `llminfer.generate(..., seed=seed)`.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | None = None
    seed: int | None = None

    def __post_init__(self):
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 for an engine request, got {self.max_new_tokens}; "
                             "a request exists to make at least one token")
        if self.eos_token_id is not None and (not _is_int(self.eos_token_id) or self.eos_token_id < 0):
            raise ValueError(f"eos_token_id must be a token id >= 0 or None, got {self.eos_token_id!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0
