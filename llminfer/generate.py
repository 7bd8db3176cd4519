"""Prefill, decode, the one request check and the one token loop, with a timestamp for every token. Chapter 01.

With the cache: one forward over the prompt (prefill), then one single-token forward per new token
(decode). Without it: a forward over *all* tokens so far at every step, recomputing every earlier
token's K and V — the waste that chapter 03 counts and chapter 04 removes.

`token_loop` is the one loop that turns logits into tokens: it seeds the sampler, samples (through the one
logits-processor pipeline of `llminfer.sampling`, chapter 13), stops rows at EOS and times every token into a
`GenerationResult`. How a step runs is a strategy it is handed, an
object with `prepare(ids, max_new_tokens)`, `prefill(ids)` and `decode(token)`: `EagerSteps` (the model's
forward, with or without a cache) by default, or `cuda_graphs.StaticDecoder` (the same forward over a
static cache, run eagerly, compiled by torch.compile or replayed from a CUDA graph), which the caller
passes as `generate(model, ids, step=decoder)`. `check_request` is the one check of a request (ids,
lengths, EOS, sampling settings) that generate, the static decoder, speculative decoding and the engines
run before any compute.

The timing names follow vLLM's benchmark: TTFT is the time to the first token, ITL each gap between
consecutive tokens, TPOT (end-to-end − TTFT) / (tokens − 1), E2E the time to the last token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import costs
from .checks import (MIN_TEMPERATURE, SEED_RANGE, check_flag, check_int, check_sampling, check_token_ids, is_int,
                     refuse_keywords)
from .device import check_fits, dtype_bytes, synchronize
from .kv_cache import Cache
from .model import Transformer
from .sampling import History, SamplerSettings, is_penalised, probabilities, sample
from .structured.constraint import batch_mask, check_constraints, jump_tokens

__all__ = ["GenerationResult", "TokenTimer", "is_int", "check_flag", "check_int", "check_sampling", "check_capacity",
           "check_request", "as_token_batch", "prefill", "decode_step", "probabilities", "sample_next", "new_generator",
           "trim_at_eos", "EagerSteps", "token_loop", "model_eos_token_id", "generate", "MIN_TEMPERATURE",
           "SEED_RANGE"]



@dataclass
class GenerationResult:
    """New tokens and when each arrived (TTFT, ITL, TPOT, E2E, as vLLM's benchmark names them). Chapter 01."""

    token_ids: list                 # list[int] for batch 1, else one list per sequence; EOS included when reached
    ttft_s: float                   # time to first token: the prefill, plus picking the token
    itl_s: list[float]              # inter-token latencies: each gap between consecutive tokens
    e2e_s: float                    # start to last token
    num_prompt_tokens: int
    use_cache: bool = True
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # (B, vocab) per step, if asked for

    @property
    def num_output_tokens(self) -> int:
        """Tokens made (the longest row for a batch)."""
        return len(self.itl_s) + 1 if self.e2e_s > 0 or self.itl_s else 0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first: (E2E − TTFT) / (tokens − 1); nan with one token."""
        n = self.num_output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else float("nan")


class TokenTimer:
    """Timestamps tokens as they become visible on the host; builds the GenerationResult. Chapter 01."""

    def __init__(self, device):
        self.device = device
        self.start_s = 0.0
        self.stamps_s: list[float] = []

    def start(self) -> None:
        """Waits for queued work, then starts the clock (the request's arrival)."""
        synchronize(self.device)
        self.start_s = time.perf_counter()
        self.stamps_s = []

    def token(self) -> None:
        """Waits for the step that made a token, then records when it is ready."""
        synchronize(self.device)
        self.stamps_s.append(time.perf_counter())

    def result(self, token_ids: list, num_prompt_tokens: int, use_cache: bool = True,
               logits: list | None = None) -> GenerationResult:
        """The tokens with their TTFT, ITL and E2E."""
        stamps = self.stamps_s
        ttft = stamps[0] - self.start_s if stamps else 0.0
        itl = [b - a for a, b in zip(stamps, stamps[1:])]
        e2e = stamps[-1] - self.start_s if stamps else 0.0
        return GenerationResult(token_ids, ttft, itl, e2e, num_prompt_tokens, use_cache, logits or [])


# --- the one request check: every user value checked before any compute (the generic checks: checks.py) ---

def as_token_batch(input_ids) -> torch.Tensor:
    """Returns the ids as a (B, T) long tensor; refuses text, empty prompts and non-integer values. Chapter 01."""
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
        if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise ValueError(f"input_ids must hold integer token ids, got a {ids.dtype} tensor; "
                             "pass torch.long ids (from tokenizer.encode)")
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, (str, bytes)):
        rows = input_ids if input_ids and isinstance(input_ids[0], Sequence) else [input_ids]
        for row in rows:
            if isinstance(row, (str, bytes)):
                raise ValueError("input_ids must be token ids, got text; encode text first with tokenizer.encode(text)")
            for value in row:
                if not is_int(value):
                    raise ValueError(f"input_ids must hold integer token ids, got {value!r} "
                                     f"({type(value).__name__}); pass ids from tokenizer.encode(text)")
        try:
            ids = torch.tensor(input_ids, dtype=torch.long)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"input_ids rows must all have the same length ({exc})") from None
    else:
        raise ValueError(f"input_ids must be a list of token ids or a tensor, got {type(input_ids).__name__}; "
                         "encode text first with tokenizer.encode(text)")
    if ids.dim() == 1:
        ids = ids[None, :]                                              # (1, T)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError("the prompt is empty; a request needs at least one token (e.g. the BOS token)")
    return ids.long()


def check_capacity(prompt_len: int, max_new_tokens: int, capacity: int) -> None:
    """Raise ValueError unless a request makes at least one token and fits a fixed cache of `capacity`
    positions (its last token is sampled, never written). Chapter 04."""
    if max_new_tokens < 1:
        raise ValueError(f"a decoder with a fixed cache makes at least one token, got max_new_tokens={max_new_tokens}")
    if prompt_len + max_new_tokens - 1 > capacity:
        raise ValueError(f"{prompt_len} prompt tokens + {max_new_tokens} new need {prompt_len + max_new_tokens - 1} "
                         f"cache positions, the decoder's cache holds {capacity}; pass a larger max_seq_len or fewer "
                         "tokens (at least 1)")


def check_request(config, input_ids, max_new_tokens: int = 16, eos_token_id: int | None = None,
                  temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                  seed: int | None = None, capacity: int | None = None, single: bool = False, *,
                  min_p: float | None = None, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0) -> torch.Tensor:
    """The one request check: returns the prompt as (B, T) long ids once ids, lengths, EOS and sampling
    settings (min-p and the penalties of chapter 13 too) are valid, else raises ValueError naming the value, the
    limit and the fix. Chapter 01.

    The prompt and its max_new_tokens must fit the model's context (config.max_seq_len), or, for a decoder
    with a fixed cache, `capacity` positions (the last token is sampled, never written). single=True refuses
    a batch (an engine request is one sequence).
    """
    check_sampling(max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, config.vocab_size, min_p=min_p,
                   repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                   frequency_penalty=frequency_penalty)
    if isinstance(input_ids, torch.Tensor) and single and input_ids.dim() > 1 and input_ids.shape[0] != 1:
        raise ValueError(f"a request is one sequence, a 1-D list of token ids, got a tensor of shape "
                         f"{tuple(input_ids.shape)}; pass one prompt per request (loop over the prompts)")
    ids = as_token_batch(input_ids)
    batch, prompt_len = ids.shape
    if single and batch != 1:
        raise ValueError(f"a request is one sequence, a 1-D list of token ids, got a batch of {batch}; pass one "
                         "prompt per request (loop over the prompts)")
    if capacity is not None:
        check_capacity(prompt_len, max_new_tokens, capacity)
    else:
        limit = config.max_seq_len
        if prompt_len + max_new_tokens > limit:
            raise ValueError(f"a prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = "
                             f"{prompt_len + max_new_tokens} positions exceed the model's context (max_seq_len="
                             f"{limit}); pass max_new_tokens <= {max(limit - prompt_len, 0)} or shorten the prompt")
    check_token_ids(ids, config.vocab_size)                 # the one vocabulary check (one host read)
    return ids


# --- the two phases -----------------------------------------------------------------------------------

@torch.inference_mode()
def prefill(model: Transformer, input_ids: torch.Tensor, cache: Cache, check_ids: bool = True) -> torch.Tensor:
    """One forward over the prompt, writing its K/V after the cache's length; returns the last logits (B, vocab). Chapter 01.

    check_ids=False skips the vocabulary check (a host sync) for ids `check_request` has already checked.
    """
    ids = as_token_batch(input_ids)
    if check_ids:
        model.check_token_ids(ids)
    return model(ids, cache=cache, last_only=True)[:, -1]


@torch.inference_mode()
def decode_step(model: Transformer, token_ids: torch.Tensor, cache: Cache, check_ids: bool = True) -> torch.Tensor:
    """One new token per sequence at position cache.length; returns its logits (B, vocab). Chapter 01.

    check_ids=False skips the vocabulary check (a host sync) for ids the loop sampled itself.
    """
    if not isinstance(token_ids, torch.Tensor):
        token_ids = as_token_batch(token_ids).view(-1)
    if token_ids.dim() == 1:
        token_ids = token_ids[:, None]                                  # (B, 1)
    if check_ids:
        model.check_token_ids(token_ids)
    return model(token_ids, cache=cache)[:, -1]


# --- the loop's pieces: sampling, seeding, EOS ------------------------------------------------------------

def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None, *, min_p: float | None = None,
                repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                history: History | None = None, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, vocab): argmax when temperature is 0, else a filtered sample, through
    chapter 13's pipeline (`llminfer.sampling.sample`) with one setting for every row. Chapter 01.

    history (a `sampling.History` of the rows' tokens) is needed with a penalty; allowed is an optional bool mask
    (B, vocab) of the tokens each row may take (constrained decoding)."""
    settings = SamplerSettings(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                               frequency_penalty)
    return sample(logits, settings, generator, history, allowed)


def new_generator(device, temperature: float, seed: int | None) -> torch.Generator | None:
    """The sampler's random generator on device, seeded with seed (or afresh); None for greedy. Chapter 01."""
    if temperature == 0:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed if seed is not None else torch.seed())
    return generator


def trim_at_eos(token_ids: list[int], eos_token_id: int | None) -> list[int]:
    """The tokens up to and including the first EOS (all of them without one). Chapter 01."""
    if eos_token_id is None or eos_token_id not in token_ids:
        return token_ids
    return token_ids[: token_ids.index(eos_token_id) + 1]


# --- the step strategies and the one loop -----------------------------------------------------------------

def _check_memory(model: Transformer, batch: int, prompt_len: int, max_new_tokens: int, use_cache: bool) -> None:
    config, element = model.config, dtype_bytes(model.dtype)
    needed = costs.generation_bytes(config, batch, prompt_len, max_new_tokens, element, use_cache)
    kv = needed - costs.activation_bytes(config, prompt_len if use_cache else prompt_len + max_new_tokens,
                                         element, batch)
    check_fits(needed, model.device,
               f"generating {max_new_tokens} tokens after a ({batch}, {prompt_len}) prompt "
               f"({kv / 2**30:.2f} GiB of KV cache + {(needed - kv) / 2**30:.2f} GiB of activations)",
               fix="use a smaller batch, a shorter prompt or fewer new tokens")


class EagerSteps:
    """The loop's default step: the model's forward over a fresh KV cache, or without one over every token
    so far (the recomputation of chapter 03). Chapter 01."""

    def __init__(self, model: Transformer, use_cache: bool = True):
        self.model = model
        self.use_cache = use_cache
        self.cache = None
        self.context = None

    def prepare(self, ids: torch.Tensor, max_new_tokens: int) -> None:
        """Checks the memory the request needs, then allocates its cache (before the clock starts)."""
        batch, prompt_len = ids.shape
        _check_memory(self.model, batch, prompt_len, max_new_tokens, self.use_cache)
        self.cache = (self.model.new_cache(batch, max_seq_len=max(prompt_len + max_new_tokens - 1, prompt_len))
                      if self.use_cache else None)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, vocab) after the prompt (B, T)."""
        if self.use_cache:                  # (the ids were checked by check_request, before the clock started)
            return prefill(self.model, ids, self.cache, check_ids=False)
        self.context = ids                                                  # (B, T) grows by a token a step
        return self.model(ids, last_only=True)[:, -1]

    def decode(self, token: torch.Tensor) -> torch.Tensor:
        """Logits (B, vocab) after one more token (B,)."""
        if self.use_cache:
            return decode_step(self.model, token, self.cache, check_ids=False)
        self.context = torch.cat([self.context, token[:, None]], dim=1)
        return self.model(self.context, last_only=True)[:, -1]             # recompute everything

    def extend(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, vocab) after several more tokens (B, k) in one forward: jump-forward's step (chapter 13)."""
        if self.use_cache:
            return self.model(ids, cache=self.cache)[:, -1]
        self.context = torch.cat([self.context, ids], dim=1)
        return self.model(self.context, last_only=True)[:, -1]


@torch.inference_mode()
def token_loop(steps, ids: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, return_logits: bool = False, constraints: list | None = None,
               jump_forward: bool = False, **processors) -> GenerationResult:
    """The one token loop: up to max_new_tokens after the checked prompt ids (B, T), each step run by
    `steps` (prepare, prefill, decode); returns the tokens and their timings. Chapter 01.

    Rows stop at their first EOS (a finished row keeps emitting EOS until every row is done). processors: min_p,
    repetition_penalty, presence_penalty, frequency_penalty (chapter 13), checked already, as the rest.
    constraints (chapter 13): one `structured.Constraint` or None per row; a row samples only where its mask allows
    and its constraint advances by each token. jump_forward (batch 1): the text the constraint forces next is
    appended in one `steps.extend` forward instead of one decode step a token.
    """
    steps.prepare(ids, max_new_tokens)
    device = steps.model.device
    ids = ids.to(device)
    batch, prompt_len = ids.shape
    generator = new_generator(device, temperature, seed)
    penalised = is_penalised(SamplerSettings(**processors))
    history = History.of(ids, vocab_size=steps.model.config.vocab_size) if penalised else None   # what penalties see
    new_tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)  # (B, N)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    all_logits: list[torch.Tensor] = []
    timer = TokenTimer(device)
    n_made, forced = 0, []
    timer.start()
    while n_made < max_new_tokens:
        if n_made == 0:
            logits = steps.prefill(ids)                                                           # (B, vocab)
        elif forced:                        # the token just sampled and the forced text, in one forward
            logits = steps.extend(torch.tensor([[int(new_tokens[0, n_made - len(forced) - 1]), *forced]],
                                               device=device))
        else:
            logits = steps.decode(new_tokens[:, n_made - 1])
        allowed = None if constraints is None else batch_mask(constraints, logits.shape[-1], device)
        token = sample_next(logits, temperature, top_k, top_p, generator, history=history, allowed=allowed,
                            **processors)                                                         # (B,)
        if history is not None:
            history.append(token)
        if eos_token_id is not None:
            token = torch.where(finished, torch.full_like(token, eos_token_id), token)
            finished |= token == eos_token_id
        new_tokens[:, n_made] = token
        if return_logits:
            all_logits.append(logits.detach().to("cpu", torch.float32, copy=True))  # a copy: a graph reuses its output
        n_made += 1
        done = eos_token_id is not None and bool(finished.all())   # reading the flag waits for the GPU
        timer.token()
        forced = []
        if constraints is not None:
            for constraint, row_token in zip(constraints, token.tolist()):
                if constraint is not None and not constraint.finished:
                    constraint.advance(row_token)
            if jump_forward and not done and constraints[0] is not None:
                # the sampled token and the forced text, re-tokenized as one where the penalties keep no history
                run = jump_tokens(constraints[0], int(token[0]), max_new_tokens - n_made, retokenize=history is None)
                new_tokens[0, n_made - 1:n_made - 1 + len(run)] = torch.tensor(run, device=device)
                forced = run[1:]
                if history is not None and forced:
                    for forced_token in forced:
                        history.append(torch.tensor([forced_token], device=device))
                for _ in forced:
                    n_made += 1
                    timer.token()
        if done:
            break
    rows = [trim_at_eos(row, eos_token_id) for row in new_tokens[:, :n_made].tolist()]
    return timer.result(rows[0] if batch == 1 else rows, prompt_len, getattr(steps, "use_cache", True), all_logits)


def model_eos_token_id(model: Transformer) -> int | None:
    """The id generation stops at by default: the model's end-of-sequence token (config.json's eos_token_id, or
    the GGUF header's; the first of a list), None for a model without one. Chapter 01."""
    return model.config.eos_token_id


def generate(model: Transformer, input_ids, max_new_tokens: int = 16, use_cache: bool = True,
             eos_token_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, return_logits: bool = False,
             step=None, ignore_eos: bool = False, min_p: float | None = None, repetition_penalty: float = 1.0,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0, constraint=None, jump_forward: bool = False,
             **unsupported) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt, stopping at the end-of-sequence token; returns the tokens
    (the EOS included) and their timings. Chapter 01.

    eos_token_id: the token to stop at; None (the default) is the model's own, model.config.eos_token_id (from
    config.json or the GGUF header; for the bundled models the id their generation_config.json names and their
    tokenizer carries as tokenizer.eos_token_id). A model without one runs to max_new_tokens.
    ignore_eos=True runs on past any EOS to exactly max_new_tokens tokens (a timing loop, or a comparison with a
    loop that does not stop).
    step: how each step runs; None is the model's eager forward (`EagerSteps`), or pass a decoder made for
    this model, e.g. `llminfer.fast.compile_decode(model)`'s compiled step.
    min_p, repetition_penalty, presence_penalty, frequency_penalty: chapter 13's processors (`llminfer.sampling`):
    a min-p cut, the multiplicative repetition penalty over the prompt and the output, and the OpenAI API's
    presence and frequency penalties over the output; they act on greedy rows too.
    constraint: a `llminfer.structured.Constraint` (or one per row, None for a free row) limits the output to its
    regex or JSON Schema (chapter 13); it is advanced in place. jump_forward=True (batch 1, eager steps) appends
    the text the constraint forces in one forward.
    A keyword this function does not take (do_sample=, max_tokens=, ...) raises TypeError naming its equivalent.
    """
    refuse_keywords(generate, unsupported)
    check_flag("jump_forward", jump_forward)
    check_flag("ignore_eos", ignore_eos)
    if ignore_eos and eos_token_id is not None:
        raise ValueError(f"ignore_eos=True runs past every end-of-sequence token, so eos_token_id={eos_token_id!r} "
                         "would never be used; pass one of them")
    eos = None if ignore_eos else eos_token_id if eos_token_id is not None else model_eos_token_id(model)
    processors = dict(min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty)
    ids = check_request(model.config, input_ids, max_new_tokens, eos, temperature, top_k, top_p, seed, **processors)
    if step is None:
        step = EagerSteps(model, use_cache)
    elif getattr(step, "model", None) is not model:
        raise ValueError(f"step= runs the steps of {type(getattr(step, 'model', None)).__name__} object "
                         f"{id(getattr(step, 'model', None)):#x}, not of this model; make the decoder for this "
                         "model (e.g. compile_decode(model)) or drop step=")
    elif not use_cache:
        raise ValueError("a step strategy decodes over its own cache, so use_cache=False cannot apply; drop step= "
                         "to recompute without a cache")
    constraints = None
    if constraint is not None:
        constraints = check_constraints(constraint, ids.shape[0], model.config.vocab_size, eos)
        for row in constraints:
            if row is not None:
                row.finish_within(max_new_tokens)    # a document that can still be completed in time is
        if jump_forward and (ids.shape[0] != 1 or not hasattr(step, "extend") or return_logits):
            raise ValueError("jump_forward=True needs a batch of 1, the eager steps (no step=) and no return_logits "
                             "(forced tokens have no logits of their own)")
    elif jump_forward:
        raise ValueError("jump_forward=True needs a constraint=; without one no text is forced")
    return token_loop(step, ids, max_new_tokens, eos, temperature, top_k, top_p, seed, return_logits,
                      constraints, jump_forward, **processors)
