"""The engine protocol: what a server, a load replay or a router needs from an engine. Chapters 05, 11 and 12.

Two classes speak it: `LLMEngine` (one process, chapter 05) and `DisaggregatedEngine` (a prefill worker and a
decode worker, chapter 12). `EngineLoop` and the OpenAI server of chapter 11 accept either:

    request_id = engine.add_request(prompt_ids, params, arrival_time=engine.clock())
    request_id = engine.add_prefilled(prompt_ids, params, first_token, kv)     # K/V computed elsewhere
    while engine.has_unfinished():
        for request_id, token_id, finished in engine.step():                    # StepOutput
            ...
    engine.pop_output(request_id)                                                # RequestOutput
    engine.abort(request_id)                                                     # True if it was unfinished
    engine.stats                                                                 # EngineStats

The members, and what every implementation promises:

- `add_request(prompt_ids, params=None, arrival_time=None) -> int`: checks the request (ValueError naming the
  value and the limit, before any compute), queues it, returns its id.
- `add_prefilled(prompt_ids, params, first_token, kv, arrival_time=None, first_token_time=None,
  generator_state=None) -> int | None`: a request whose prompt K/V were computed elsewhere (`kv`: per layer
  `(k, v)`, each `(1, n_kv_heads, len(prompt_ids), head_dim)`, keys after RoPE) and whose first token was sampled
  there. It joins as a decoding request: its next step is a decode. Returns None, changing nothing, when the
  engine has no room for it now (offer it again after a step).
- `step() -> list[StepOutput]`: runs (or, across processes, collects) one step's tokens.
- `abort(request_id) -> bool`, `has_unfinished() -> bool`, `pop_output(request_id) -> RequestOutput`.
- `stats`: an `EngineStats` snapshot (the KV pool, the queues, the counters).
- `clock`: the function that timestamps everything (arrivals, tokens): `time.perf_counter` unless given.
- `config` (the `ModelConfig`) and `max_model_len` (the longest prompt + completion accepted).

Both keep their requests in one `RequestTable` (`llminfer.engine.requests`): the request check, the ids, abort,
pop_output, generate and the queue counts of `stats` are written once there, with the same messages, so the two
answer the same calls alike; each adds only where a request runs. `prompt_ids` may be a `PromptIds`, ids already
checked for the model (the server makes them): an engine takes those as checked.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

if TYPE_CHECKING:                    # annotations only: the engine modules import nothing from here
    import torch

    from ..config import ModelConfig
    from .llm_engine import EngineStats
    from .sampling_params import SamplingParams
    from .sequence import RequestOutput, StepOutput

__all__ = ["Engine", "ENGINE_MEMBERS", "protocol_gaps"]


@runtime_checkable
class Engine(Protocol):
    """Requests in, tokens out, one step at a time; implemented by LLMEngine and DisaggregatedEngine. Chapter 11."""

    config: ModelConfig
    max_model_len: int
    clock: Callable[[], float]

    def add_request(self, prompt_ids, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queues one checked request; returns its id."""
        ...

    def add_prefilled(self, prompt_ids, params: SamplingParams | None, first_token: int,
                      kv: list[tuple[torch.Tensor, torch.Tensor]], arrival_time: float | None = None,
                      first_token_time: float | None = None,
                      generator_state: torch.Tensor | None = None) -> int | None:
        """Installs a request prefilled elsewhere, already decoding; returns its id (None: no room now)."""
        ...

    def step(self) -> list[StepOutput]:
        """The tokens of one step, as (request_id, token_id, finished)."""
        ...

    def abort(self, request_id: int) -> bool:
        """Stops a request and frees what it holds; True if it was unfinished."""
        ...

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        ...

    def pop_output(self, request_id: int) -> RequestOutput:
        """The finished request's RequestOutput, handed over once."""
        ...

    @property
    def stats(self) -> EngineStats:
        """The engine's counters now."""
        ...


ENGINE_MEMBERS = ("add_request", "add_prefilled", "step", "abort", "has_unfinished", "pop_output", "stats",
                  "clock", "config", "max_model_len")


def protocol_gaps(engine) -> list[str]:
    """What an engine lacks of the protocol: missing members, methods missing a parameter ([] if none). Chapter 11.

    A method may take more parameters than the protocol's (with defaults), never fewer. Pass an instance: the
    data members (clock, config, max_model_len) are set in __init__. No member is called or read through a
    property, so an engine whose workers have not started can be checked.
    """
    gaps = []
    for name in ENGINE_MEMBERS:
        wanted = inspect.getattr_static(Engine, name, None)
        found = inspect.getattr_static(engine, name, None)
        if found is None:
            gaps.append(f"{name}: missing")
            continue
        if not callable(wanted):                       # a data member or the stats property: present is enough
            continue
        if not callable(found):
            gaps.append(f"{name}(): not a method")
            continue
        have = inspect.signature(getattr(engine, name)).parameters
        for parameter in list(inspect.signature(wanted).parameters)[1:]:      # after self
            if parameter not in have:
                gaps.append(f"{name}(): no parameter {parameter!r}")
    return gaps
