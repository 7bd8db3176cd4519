"""Pipeline parallelism: layers split into stages, activations passed with send/recv, micro-batches. Chapter 10.

`pipeline_stage(model, stage, n_stages)` keeps one stage's layers and rewires the two ends of the model's one
forward: on every stage but the first, `embed_tokens` becomes a module that receives the previous stage's
activations (B, T, dim) instead of looking up ids; on every stage but the last, the final norm is dropped and
`lm_head` becomes a module that sends the activations on. Each stage then runs the unchanged forward, with its
own KV cache for its own layers.

`pipeline_generate` runs a greedy generation through the stages. Each step feeds the batch in micro-batches:
while stage 1 works on micro-batch 0, stage 0 already works on micro-batch 1 (GPipe's schedule). The last
stage picks the next tokens and broadcasts them to every stage. Every stage records when it started and
finished each micro-batch, so the timeline and the bubble can be drawn from what really happened.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from llminfer.device import synchronize
from llminfer.generate import GenerationResult, TokenTimer

from .plan import PipelinePlan, pipeline_plan, split_micro_batches

__all__ = ["PipelineState", "StageEvent", "PipelineResult", "RecvActivations", "SendActivations", "pipeline_stage",
           "pipeline_generate", "bubble_fraction", "ideal_bubble_fraction"]


@dataclass
class StageEvent:
    """One stage's work on one micro-batch of one step: compute from start_s to end_s (perf_counter). Chapter 10."""

    stage: int
    step: int
    micro_batch: int
    start_s: float
    end_s: float


@dataclass
class PipelineState:
    """What a pipeline stage knows: its place, its neighbours, sends in flight and its timeline. Chapter 10."""

    plan: PipelinePlan
    stage: int
    ranks: list[int]                               # global rank of each stage
    group: object = None
    record: bool = False
    events: list[StageEvent] = field(default_factory=list)
    step: int = 0
    micro_batch: int = 0
    _start_s: float | None = None
    _pending: list = field(default_factory=list)   # (work, tensor) of sends in flight
    sent_bytes: int = 0

    @property
    def n_stages(self) -> int:
        return self.plan.n_stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.plan.n_stages - 1

    def mark_start(self, device) -> None:
        if self.record:
            synchronize(device)
            self._start_s = time.perf_counter()

    def mark_end(self, device) -> None:
        if self.record and self._start_s is not None:
            synchronize(device)
            self.events.append(StageEvent(self.stage, self.step, self.micro_batch, self._start_s,
                                          time.perf_counter()))
            self._start_s = None

    def checkpoint_name(self, name: str) -> str:
        """The full model's name of a parameter of this stage ('layers.0.…' of stage 1 is 'layers.2.…')."""
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            return f"layers.{int(index) + self.plan.layer_range(self.stage)[0]}.{rest}"
        return name

    def wait_sends(self) -> None:
        for work, _tensor in self._pending:
            work.wait()
        self._pending.clear()


class RecvActivations(nn.Module):
    """Stands where embed_tokens was: returns the previous stage's activations (B, T, dim). Chapter 10."""

    def __init__(self, dim: int, state: PipelineState, owner: nn.Module):
        super().__init__()
        self.dim = dim
        object.__setattr__(self, "state", state)
        object.__setattr__(self, "_owner", owner)          # the stage's layers: their device and dtype are ours

    @property
    def weight(self) -> torch.Tensor:
        """A parameter of this stage, so that model.device and model.dtype keep working."""
        return next(self._owner.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        like = self.weight
        x = torch.empty(*input_ids.shape, self.dim, dtype=like.dtype, device=like.device)   # (B, T, dim)
        dist.recv(x, src=self.state.ranks[self.state.stage - 1], group=self.state.group)
        self.state.mark_start(x.device)                    # compute starts once the input is here
        return x


class SendActivations(nn.Module):
    """Stands where lm_head was: sends the activations (B, T, dim) to the next stage and returns them. Chapter 10."""

    def __init__(self, state: PipelineState):
        super().__init__()
        object.__setattr__(self, "state", state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        self.state.mark_end(x.device)                      # compute ends before the hand-over
        work = dist.isend(x, dst=self.state.ranks[self.state.stage + 1], group=self.state.group)
        self.state._pending.append((work, x))              # x must stay alive until the send completes
        self.state.sent_bytes += x.numel() * x.element_size()
        return x


@torch.no_grad()
def pipeline_stage(model, stage: int, n_stages: int, group=None, ranks: list[int] | None = None):
    """Keeps stage `stage` of an n_stages pipeline of model, in place; returns it. Chapter 10.

    ranks[s] is the global rank running stage s (default: rank s). Layers are renumbered from 0 inside the stage,
    so the stage's KV cache holds its own layers only.
    """
    if getattr(model, "parallel", None) is not None:
        raise ValueError("this model is already split (model.parallel is set); load a fresh model to split it again")
    plan = pipeline_plan(model.config, n_stages)
    if not isinstance(stage, int) or not 0 <= stage < n_stages:
        raise ValueError(f"stage must be an integer in 0..{n_stages - 1}, got {stage!r}")
    ranks = list(range(n_stages)) if ranks is None else list(ranks)
    if len(ranks) != n_stages:
        raise ValueError(f"ranks lists {len(ranks)} ranks for {n_stages} stages; give one rank per stage")
    state = PipelineState(plan, stage, ranks, group)
    start, stop = plan.layer_range(stage)
    model.layers = model.layers[start:stop]                       # the same stack class, this stage's layers
    for local_idx, layer in enumerate(model.layers):
        layer.self_attn.layer_idx = local_idx                     # the stage's cache has its layers only
    if not state.is_first:
        model.embed_tokens = RecvActivations(model.config.dim, state, model.layers)
    if not state.is_last:
        model.norm = nn.Identity()
        model.lm_head = SendActivations(state)
    model.parallel = state               # model.new_cache() sizes its cache from the stage's layers
    return model


@dataclass
class PipelineResult(GenerationResult):
    """A GenerationResult of one pipeline stage, plus the StageEvents it recorded. Chapter 10."""

    events: list[StageEvent] = field(default_factory=list)


@torch.inference_mode()
def pipeline_generate(model, input_ids: torch.Tensor, max_new_tokens: int, n_micro_batches: int = 1,
                      record: bool = False, return_logits: bool = False) -> PipelineResult:
    """Greedy generation through the pipeline, micro-batch by micro-batch; call it on every stage. Chapter 10.

    Returns the tokens (every stage has them), their timings, the logits per step (B, vocab) in float32 (on
    the last stage, with return_logits) and the StageEvents recorded on this stage (with record).
    """
    state: PipelineState = model.parallel
    if not isinstance(state, PipelineState):
        raise ValueError("pipeline_generate needs a pipeline stage; split the model with pipeline_stage() first")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (batch, seq_len) tensor, got shape {tuple(input_ids.shape)}")
    batch, prompt_len = input_ids.shape
    if prompt_len + max_new_tokens - 1 > model.config.max_seq_len:
        raise ValueError(f"a prompt of {prompt_len} tokens and {max_new_tokens} new tokens need "
                         f"{prompt_len + max_new_tokens - 1} positions, more than max_seq_len="
                         f"{model.config.max_seq_len}; shorten the prompt or generate fewer tokens")
    sizes = split_micro_batches(batch, n_micro_batches)
    device = model.device
    if state.is_first:
        model.check_token_ids(input_ids)
    state.record, state.events = record, []
    caches = [model.new_cache(size, max_seq_len=prompt_len + max_new_tokens - 1) for size in sizes]
    chunks = list(input_ids.to(device).split(sizes))           # (b_m, T) each
    token_rows, all_logits = [], []
    timer = TokenTimer(device)
    timer.start()
    for step in range(max_new_tokens):
        state.step = step
        outputs = []
        for micro_batch, (chunk, cache) in enumerate(zip(chunks, caches)):
            state.micro_batch = micro_batch
            if state.is_first:
                state.mark_start(device)
            ids = chunk if state.is_first else torch.zeros_like(chunk)   # later stages only need the shape
            out = model(ids, cache=cache, last_only=state.is_last)       # (b_m, T, dim) or (b_m, 1, vocab)
            if state.is_last:
                state.mark_end(device)
                outputs.append(out[:, -1])                               # (b_m, vocab)
        state.wait_sends()
        if state.is_last:
            logits = torch.cat(outputs)                                  # (B, vocab)
            next_ids = logits.argmax(dim=-1)                             # (B,)
            if return_logits:
                all_logits.append(logits.float().cpu())
        else:
            next_ids = torch.empty(batch, dtype=torch.long, device=device)
        dist.broadcast(next_ids, src=state.ranks[-1], group=state.group)
        timer.token()
        token_rows.append(next_ids.cpu())
        chunks = [part[:, None] for part in next_ids.split(sizes)]      # (b_m, 1) each
    rows = torch.stack(token_rows, dim=1).tolist()                       # (B, N)
    base = timer.result(rows[0] if batch == 1 else rows, prompt_len, logits=all_logits)
    return PipelineResult(base.token_ids, base.ttft_s, base.itl_s, base.e2e_s, prompt_len, logits=base.logits,
                          events=list(state.events))


def bubble_fraction(events: list[StageEvent], n_stages: int, step: int | None = None) -> float:
    """1 − (busy time of all stages) / (stages × span from the first start to the last end). Chapter 10."""
    chosen = [e for e in events if step is None or e.step == step]
    if not chosen:
        raise ValueError(f"no events recorded for step {step}; run pipeline_generate(..., record=True)")
    span = max(e.end_s for e in chosen) - min(e.start_s for e in chosen)
    busy = sum(e.end_s - e.start_s for e in chosen)
    return 1.0 - busy / (n_stages * span)


def ideal_bubble_fraction(n_stages: int, n_micro_batches: int) -> float:
    """(p − 1) / (m + p − 1): the idle share of a GPipe schedule with equal stages and free sends. Chapter 10."""
    if n_stages < 1 or n_micro_batches < 1:
        raise ValueError(f"n_stages={n_stages} and n_micro_batches={n_micro_batches} must both be at least 1")
    return (n_stages - 1) / (n_micro_batches + n_stages - 1)
