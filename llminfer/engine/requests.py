"""The request table an engine keeps: the one request check, the ids it issues, its unfinished and finished
requests. Chapters 05, 11 and 12.

Both engines of the protocol (`llminfer.engine.protocol.Engine`) hold one: `LLMEngine` (chapter 05) and the
router of the disaggregated pair (`DisaggregatedEngine`, chapter 12). So a request is checked, numbered,
aborted, handed over and counted the same way, with the same messages, whichever engine runs it; each engine
adds only what it does with a request (queue it for its scheduler, or send it to a worker).

    prompt, params = table.check(prompt_ids, params)          # ValueError before anything is queued
    seq = table.track(prompt, params, arrival_time)           # the next id, an engine Sequence
    ...                                                       # the engine runs it
    table.finish(seq)                                         # or table.abort(request_id) / table.fail(seq, why)
    table.pop_output(request_id)                              # its RequestOutput, handed over once

A prompt's ids are checked once on their way in. `PromptIds(config, ids)` checks them (integers, not empty,
inside the vocabulary and the context) and keeps them as a tuple that says so; an engine takes a `PromptIds`
made for its model as checked. The server of chapter 11 makes them while it parses a request, so the engine
does not check them again; a library caller that passes a list gets the full check in `add_request`.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable
from typing import Sequence as SequenceType

import torch

from ..checks import check_sampling, is_int
from ..generate import check_request
from .sampling_params import SamplingParams
from .sequence import RequestOutput, Sequence, SequenceStatus

__all__ = ["PromptIds", "RequestTable", "check_pool_fits"]


class PromptIds(tuple):
    """A prompt's token ids, checked for one model: integers in 0..vocab_size - 1, 1..max_seq_len of them. Chapter 11.

    `PromptIds(config, prompt_ids)` runs the one request check (`llminfer.generate.check_request`) on a list or
    tensor of ids, or returns prompt_ids itself when it is already a PromptIds checked for this config. Only
    checking makes one, so an engine takes it as checked. A check does not cross a process: pickled, it becomes
    a plain list, which the other process checks again.
    """

    vocab_size: int
    max_seq_len: int

    def __new__(cls, config, prompt_ids) -> "PromptIds":
        if isinstance(prompt_ids, PromptIds) and prompt_ids.checked_for(config):
            return prompt_ids
        return cls._from_checked(config, check_request(config, prompt_ids, 0, single=True))

    @classmethod
    def _from_checked(cls, config, ids: torch.Tensor) -> "PromptIds":
        """Wraps ids (1, T) that check_request has just returned for config."""
        prompt = tuple.__new__(cls, ids[0].tolist())
        prompt.vocab_size, prompt.max_seq_len = config.vocab_size, config.max_seq_len
        return prompt

    def checked_for(self, config) -> bool:
        """True when these ids were checked against config's vocabulary and a context no longer than its own."""
        return self.vocab_size == config.vocab_size and len(self) <= config.max_seq_len

    def __reduce__(self):
        return list, (list(self),)


Limits = Callable[[PromptIds, SamplingParams], None]     # an engine's own check of a request: ValueError if not


def check_pool_fits(prompt: PromptIds, params: SamplingParams, num_blocks: int, block_size: int) -> None:
    """ValueError unless the request's positions fit a KV pool of num_blocks blocks of block_size positions even
    alone (its last token is sampled, never run through the model). Chapter 06."""
    positions = len(prompt) + params.max_new_tokens - 1
    needed = -(-positions // block_size)
    if needed > num_blocks:
        raise ValueError(f"the request could never fit in the KV pool, even alone: {positions} positions need "
                         f"{needed} blocks of {block_size} but the pool has {num_blocks}; make the engine with "
                         f"num_blocks >= {needed}, or shorten the request")


def _check_seconds(name: str, value) -> None:
    """ValueError unless value is None or a finite number of seconds (a time on the engine's clock)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                              or not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number of seconds on the engine's clock, got {value!r}")


class RequestTable:
    """One engine's requests: the check, ids issued in order, the unfinished ones, the finished ones until their
    output is popped, and the counts its stats report. Chapter 05.

    clock: the engine's clock, which stamps an arrival that is not given; device: where a sampled request's
    generator lives."""

    def __init__(self, config, max_model_len: int, clock: Callable[[], float], device: torch.device | str = "cpu"):
        self.config = config
        self.max_model_len = max_model_len
        self.clock = clock
        self.device = device
        self.unfinished: dict[int, Sequence] = {}     # waiting or running, by id
        self.finished: dict[int, Sequence] = {}       # finished, until popped
        self.next_id = 0
        self.num_finished = 0

    # --- coming in -------------------------------------------------------------------------------

    def check(self, prompt_ids, params: SamplingParams | None = None, arrival_time: float | None = None,
              limits: Limits | None = None) -> tuple[PromptIds, SamplingParams]:
        """The request's prompt as PromptIds and its params, once both fit this engine; ValueError naming the value,
        the limit and the fix otherwise. Ids already checked for this model (a PromptIds) are not checked again.

        limits(prompt, params), if given, is the engine's own check beside max_model_len (its KV pool, its step
        budget): it raises ValueError, and runs before the max_model_len check."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        _check_seconds("arrival_time", arrival_time)
        cfg = self.config
        if isinstance(prompt_ids, PromptIds) and prompt_ids.checked_for(cfg):
            prompt = prompt_ids
            check_sampling(params.max_new_tokens, params.temperature, params.top_k, params.top_p, params.seed,
                           params.eos_token_id, cfg.vocab_size, **params.processors)
        else:                                          # the one request check: ids, sampling, the model's context
            prompt = PromptIds._from_checked(cfg, check_request(
                cfg, prompt_ids, params.max_new_tokens, params.eos_token_id, params.temperature, params.top_k,
                params.top_p, params.seed, single=True, **params.processors))
        if limits is not None:
            limits(prompt, params)
        total = len(prompt) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} = {total} "
                             f"exceeds the engine's max_model_len={self.max_model_len}; shorten the request")
        return prompt, params

    def check_prefilled(self, prompt: PromptIds, params: SamplingParams, first_token: int,
                        kv: list[tuple[torch.Tensor, torch.Tensor]], first_token_time: float | None = None) -> None:
        """ValueError unless first_token, first_token_time and kv (per layer (k, v), each (1, n_kv_heads, P,
        head_dim)) can continue the checked request (prompt, params) as a decoding one. Chapter 12."""
        _check_seconds("first_token_time", first_token_time)
        cfg = self.config
        if not is_int(first_token) or not 0 <= first_token < cfg.vocab_size:
            raise ValueError(f"first_token={first_token!r} is not a token id of this model (0..{cfg.vocab_size - 1})")
        if (params.eos_token_id is not None and first_token == params.eos_token_id) or params.max_new_tokens == 1:
            raise ValueError("the request finished at its first token (eos, or max_new_tokens=1), so it has nothing "
                             "to decode; take its output where it was prefilled")
        if not isinstance(kv, (list, tuple)) or len(kv) != cfg.n_layers:
            got = f"{len(kv)} pairs" if isinstance(kv, (list, tuple)) else type(kv).__name__
            raise ValueError(f"kv must hold {cfg.n_layers} pairs, one (k, v) pair per layer of this model; got {got}")
        expected = (1, cfg.n_kv_heads, len(prompt), cfg.head_dim)
        for layer, pair in enumerate(kv):
            if len(pair) != 2 or any(tuple(t.shape) != expected for t in pair):
                raise ValueError(f"layer {layer}: K/V of shape {[tuple(t.shape) for t in pair]}; expected {expected} "
                                 f"(1, n_kv_heads, positions, head_dim) for a {len(prompt)}-token prompt")

    def check_all(self, prompts, params, limits: Limits | None = None) -> list[tuple[PromptIds, SamplingParams]]:
        """Every (prompt, params) of a batch, checked (as `check` does) before any is queued: prompts a list of id
        lists (or a 2-D tensor), params one SamplingParams, one per prompt, or None. Chapter 05."""
        if isinstance(prompts, torch.Tensor):
            prompts = [row for row in prompts] if prompts.dim() == 2 else [prompts]
        if not isinstance(prompts, SequenceType) or isinstance(prompts, (str, bytes)) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts, each a list of token ids")
        if is_int(prompts[0]):
            raise ValueError("prompts must be a list of prompts (lists of token ids); wrap a single prompt as "
                             "[prompt_ids]")
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts; pass one, or one each")
        return [self.check(prompt, p, limits=limits) for prompt, p in zip(prompts, params_list)]

    def track(self, prompt: PromptIds, params: SamplingParams, arrival_time: float | None = None) -> Sequence:
        """A checked request as an engine Sequence with the next id, arrived at arrival_time (now if None)."""
        request_id = self.next_id
        self.next_id += 1
        arrival = self.clock() if arrival_time is None else float(arrival_time)
        seq = Sequence(request_id, prompt, params, arrival, device=self.device)
        self.unfinished[request_id] = seq
        return seq

    def start_decoding(self, seq: Sequence, first_token: int, first_token_time: float | None = None) -> None:
        """A request prefilled elsewhere: its first token, sampled there at first_token_time (now if None). Chapter 12."""
        first_time = self.clock() if first_token_time is None else float(first_token_time)
        seq.first_scheduled_time = first_time
        seq.append_token(int(first_token), first_time)

    # --- going out -------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.unfinished)

    def finish(self, seq: Sequence) -> None:
        """seq has finished (its status says why): its output waits to be popped."""
        self.unfinished.pop(seq.request_id, None)
        self.finished[seq.request_id] = seq
        self.num_finished += 1

    def fail(self, seq: Sequence, error: str) -> None:
        """Finishes seq with finish_reason "error" and the error; the other requests go on."""
        seq.status = SequenceStatus.FINISHED_ERROR
        seq.error = error
        self.finish(seq)

    def abort(self, request_id: int) -> Sequence | None:
        """Finishes an unfinished request as aborted and returns it, for the engine to free what it holds; None
        if it had already finished. ValueError for an id this engine never issued."""
        if not is_int(request_id) or not 0 <= request_id < self.next_id:
            raise ValueError(f"unknown request id {request_id!r}: this engine has issued ids 0..{self.next_id - 1}"
                             if self.next_id else f"unknown request id {request_id!r}: no request has been added")
        seq = self.unfinished.pop(request_id, None)
        if seq is None:
            return None
        seq.status = SequenceStatus.FINISHED_ABORTED
        self.finish(seq)
        return seq

    def pop_output(self, request_id: int) -> RequestOutput:
        """The finished request's RequestOutput, handed over once (the table then forgets it)."""
        seq = self.finished.pop(request_id, None)
        if seq is None:
            state = "still running" if request_id in self.unfinished else "unknown or already popped"
            raise ValueError(f"request {request_id!r} has no finished output: it is {state}")
        return seq.output()

    def output(self, request_id: int) -> RequestOutput:
        """A snapshot of a request's RequestOutput, running or finished (not yet popped)."""
        seq = self.unfinished.get(request_id) or self.finished.get(request_id)
        if seq is None:
            raise ValueError(f"request {request_id!r} is unknown or its output was already popped")
        return seq.output()

    def counts(self) -> dict[str, int]:
        """num_waiting (not yet running: queued, preempted, or on its way to a worker), num_running, num_finished."""
        waiting = sum(1 for seq in self.unfinished.values() if seq.status is SequenceStatus.WAITING)
        return {"num_waiting": waiting, "num_running": len(self.unfinished) - waiting,
                "num_finished": self.num_finished}

    # --- offline use -----------------------------------------------------------------------------

    def run(self, prompts, params, add: Callable[[PromptIds, SamplingParams], int], step: Callable[[], object],
            limits: Limits | None = None) -> list[RequestOutput]:
        """Checks every prompt before any is queued, queues each with add(prompt, params), calls step() until
        none is unfinished; returns one RequestOutput per prompt, in order. Chapter 05."""
        ids = [add(prompt, p) for prompt, p in self.check_all(prompts, params, limits)]
        while self.has_unfinished():
            step()
        return [self.pop_output(request_id) for request_id in ids]
