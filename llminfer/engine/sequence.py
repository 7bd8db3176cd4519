"""A request inside the engine: its tokens, its progress, its blocks, its timestamps. Chapter 05.

A sequence holds `token_ids` = prompt + output so far. `num_computed_tokens` of them have their K/V in
the pool; the newest token never has (its K/V are written by the step that consumes it). A step runs
`n` new tokens from position `num_computed_tokens`; when that reaches the end of `token_ids`, the step
also samples the next token. So a prefill is a step with many new tokens, a decode step one with a
single new token, and a recomputation after preemption is simply a prefill of prompt + output.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..generate import GenerationResult
from .sampling_params import SamplingParams

__all__ = ["SequenceStatus", "Sequence", "RequestOutput", "StepOutput"]


class SequenceStatus(enum.Enum):
    """Where a request is: queued, in the running batch, or done (and why). Chapter 05."""
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"        # sampled its eos token
    FINISHED_LENGTH = "length"       # made max_new_tokens
    FINISHED_ABORTED = "abort"       # aborted by the caller
    FINISHED_ERROR = "error"         # its step or its sampling raised; the other requests go on

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class StepOutput(NamedTuple):
    """One token made by `LLMEngine.step()`: which request, which token, and whether it finished it.

    token_id is None, with finished True, for a request that failed in the step (its RequestOutput has
    finish_reason "error" and the error)."""
    request_id: int
    token_id: int | None
    finished: bool


@dataclass
class RequestOutput(GenerationResult):
    """One request's tokens and timings (a GenerationResult), plus what the engine did for it. Chapter 05.

    Times run from the request's arrival: ttft_s to its first token, itl_s between tokens, e2e_s to the
    last. num_cached_tokens counts prompt positions served by the prefix cache at its first admission.
    """

    request_id: int = -1
    prompt_token_ids: list[int] = field(default_factory=list, repr=False)
    num_cached_tokens: int = 0
    preemptions: int = 0
    finish_reason: str | None = None      # "stop", "length", "abort" or "error" (None while running)
    queue_s: float = 0.0                  # arrival to first scheduled step
    error: str | None = None              # with finish_reason "error": what was raised

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    """One request's state in the engine. Chapter 05."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                 device: torch.device | str = "cpu"):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)      # prompt + output so far
        self.params = params
        self.arrival_time = arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0                 # positions whose K/V are in the pool
        self.block_table: list[int] = []             # physical block ids, in logical order
        self.block_hashes: list[int] = []            # hash chain of the full blocks of token_ids
        self.num_cached_tokens = -1                  # prefix-cache hit at first admission (-1: not admitted yet)
        self.preemptions = 0
        self.first_scheduled_time: float | None = None
        self.token_times: list[float] = []
        self.error: str | None = None                # set when its step or sampling raised (FINISHED_ERROR)
        self.generator: torch.Generator | None = None
        self.constraint = None                       # a structured.Constraint, advanced by each token (chapter 13)
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed if params.seed is not None else torch.seed())

    # --- sizes ----------------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_remaining(self) -> int:
        """Tokens still to run through the model before the next sample (1 for a decode step)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """True when only the newest (sampled) token remains to be computed."""
        return self.num_output_tokens > 0 and self.num_remaining == 1

    @property
    def max_tokens(self) -> int:
        """The most positions this request can ever hold K/V for: prompt + max_new_tokens - 1."""
        return self.num_prompt_tokens + self.params.max_new_tokens - 1

    # --- progress -------------------------------------------------------------------------------

    def append_token(self, token_id: int, now: float) -> bool:
        """Adds a sampled token; returns True (and marks the status) when it finishes the request."""
        self.token_ids.append(token_id)
        self.token_times.append(now)
        if self.constraint is not None and not self.constraint.finished:
            self.constraint.advance(token_id)
        eos = self.params.eos_token_id
        if eos is not None and token_id == eos:
            self.status = SequenceStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= self.params.max_new_tokens:
            self.status = SequenceStatus.FINISHED_LENGTH
        return self.status.finished

    def output(self) -> RequestOutput:
        """The request's tokens and timings so far (complete once it has finished)."""
        stamps = self.token_times
        ttft = stamps[0] - self.arrival_time if stamps else 0.0
        itl = [b - a for a, b in zip(stamps, stamps[1:])]
        e2e = stamps[-1] - self.arrival_time if stamps else 0.0
        queue = (self.first_scheduled_time - self.arrival_time) if self.first_scheduled_time is not None else 0.0
        return RequestOutput(
            token_ids=list(self.output_token_ids), ttft_s=ttft, itl_s=itl, e2e_s=e2e,
            num_prompt_tokens=self.num_prompt_tokens, use_cache=True, request_id=self.request_id,
            prompt_token_ids=list(self.prompt_token_ids), num_cached_tokens=max(self.num_cached_tokens, 0),
            preemptions=self.preemptions, finish_reason=self.status.value if self.status.finished else None,
            queue_s=queue, error=self.error)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={self.block_table})")
