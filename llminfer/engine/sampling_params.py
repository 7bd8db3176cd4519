"""How one request wants its tokens chosen and when it stops. Chapter 05."""
from __future__ import annotations

from dataclasses import dataclass

from ..checks import check_sampling, refuse_keywords

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request: greedy by default, stops at max_new_tokens or eos. Chapter 05.

    The same settings as `llminfer.generate`, checked the same way when made (`checks.check_sampling`:
    temperature and top_p must survive float32; the eos id is checked against the model's vocabulary when the
    request reaches an engine). Unlike `generate`, eos_token_id=None never stops early: pass the tokenizer's.
    With a `seed`, a request sampled at temperature > 0 draws the same tokens as `llminfer.generate(..., seed=seed)`.
    min_p and the repetition, presence and frequency penalties are chapter 13's processors (`llminfer.sampling`,
    which takes these params as a row's settings); the penalties act on greedy requests too.
    A keyword of another API (max_tokens=, do_sample=) raises TypeError naming this one's equivalent.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    eos_token_id: int | None = None
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __new__(cls, *args, **kwargs):
        refuse_keywords(cls, {name: value for name, value in kwargs.items() if name not in cls.__dataclass_fields__},
                        takes=list(cls.__dataclass_fields__))
        return super().__new__(cls)

    def __post_init__(self):
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, self.top_p, self.seed, self.eos_token_id,
                       **self.processors)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 for an engine request, got {self.max_new_tokens}; "
                             "a request exists to make at least one token")

    @property
    def processors(self) -> dict:
        """min_p and the three penalties, as keywords of `check_sampling` and `generate`."""
        return dict(min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature 0)."""
        return self.temperature == 0
