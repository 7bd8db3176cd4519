"""Prefill, decode and the generation loop, with a timestamp for every token. Chapter 01.

With the cache: one forward over the prompt (prefill), then one single-token forward per new token
(decode). Without it: a forward over *all* tokens so far at every step, recomputing every earlier
token's K and V — the waste that chapter 03 counts and chapter 04 removes.

Every loop in the package that makes tokens (this one, the CUDA-graph decoder, the benchmark's
contenders, the latency widget) returns a `GenerationResult` timed by a `TokenTimer`, so their
numbers mean the same thing. The names follow vLLM's benchmark: TTFT is the time to the first
token, ITL each gap between consecutive tokens, TPOT (end-to-end − TTFT) / (tokens − 1), E2E the
time to the last token.
"""
from __future__ import annotations

import math
import numbers
import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import costs
from .device import check_fits, dtype_bytes, synchronize
from .kv_cache import Cache
from .model import Transformer

__all__ = ["GenerationResult", "TokenTimer", "prefill", "decode_step", "generate", "sample_next",
           "check_sampling", "as_token_batch", "synchronize"]


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

    @property
    def prompt_len(self) -> int:
        return self.num_prompt_tokens

    @property
    def token_latencies_s(self) -> list[float]:
        warnings.warn("GenerationResult.token_latencies_s is deprecated; use itl_s", DeprecationWarning, stacklevel=2)
        return self.itl_s

    @property
    def total_s(self) -> float:
        warnings.warn("GenerationResult.total_s is deprecated; use e2e_s", DeprecationWarning, stacklevel=2)
        return self.e2e_s


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


# --- validation: every user value checked before any compute -------------------------------------------

def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sampling(max_new_tokens: int = 1, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None) -> None:
    """Raise ValueError naming the first sampling setting that cannot work. Chapter 01."""
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def _check_eos(eos_token_id, vocab_size: int) -> None:
    if eos_token_id is None:
        return
    if not _is_int(eos_token_id):
        raise ValueError(f"eos_token_id must be an integer token id or None, got {eos_token_id!r}")
    if not 0 <= eos_token_id < vocab_size:
        raise ValueError(f"eos_token_id={eos_token_id} is outside the vocabulary of {vocab_size} ids "
                         f"(0..{vocab_size - 1}), so generation would never stop on it; pass the tokenizer's "
                         "eos_token_id")


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
                if not _is_int(value):
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
        raise ValueError("the prompt must hold at least one token, got an empty prompt")
    return ids.long()


# --- the two phases -----------------------------------------------------------------------------------

@torch.inference_mode()
def prefill(model: Transformer, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
    """One forward over the prompt, writing its K/V after the cache's length; returns the last logits (B, vocab). Chapter 01."""
    ids = as_token_batch(input_ids)
    model.check_token_ids(ids)
    return model(ids, cache=cache, last_only=True)[:, -1]


@torch.inference_mode()
def decode_step(model: Transformer, token_ids: torch.Tensor, cache: Cache, start_pos: int | None = None,
                check_ids: bool = True) -> torch.Tensor:
    """One new token per sequence at position cache.length; returns its logits (B, vocab). Chapter 01.

    check_ids=False skips the vocabulary check (a host sync) for ids the loop sampled itself.
    """
    if not isinstance(token_ids, torch.Tensor):
        token_ids = as_token_batch(token_ids).view(-1)
    if token_ids.dim() == 1:
        token_ids = token_ids[:, None]                                  # (B, 1)
    if start_pos is not None:
        warnings.warn("decode_step(start_pos=...) is deprecated: the cache owns its length", DeprecationWarning,
                      stacklevel=3)
        if start_pos != cache.length:
            raise ValueError(f"start_pos={start_pos} but the cache holds {cache.length} positions, so the token goes "
                             f"at position {cache.length}; drop start_pos, or call cache.truncate({start_pos}) first")
    if check_ids:
        model.check_token_ids(token_ids)
    return model(token_ids, cache=cache)[:, -1]


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, vocab): argmax when temperature is 0, else a filtered sample. Chapter 01."""
    check_sampling(1, temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs          # probability mass ranked above each token
        drop_sorted = before >= top_p                  # keep the smallest prefix that reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _check_memory(model: Transformer, batch: int, prompt_len: int, max_new_tokens: int, use_cache: bool) -> None:
    config, element = model.config, dtype_bytes(model.dtype)
    needed = costs.generation_bytes(config, batch, prompt_len, max_new_tokens, element, use_cache)
    kv = needed - costs.activation_bytes(config, prompt_len if use_cache else prompt_len + max_new_tokens,
                                         element, batch)
    check_fits(needed, model.device,
               f"generating {max_new_tokens} tokens after a ({batch}, {prompt_len}) prompt "
               f"({kv / 2**30:.2f} GiB of KV cache + {(needed - kv) / 2**30:.2f} GiB of activations)",
               fix="use a smaller batch, a shorter prompt or fewer new tokens")


@torch.inference_mode()
def generate(model: Transformer, input_ids, max_new_tokens: int = 16, use_cache: bool = True,
             eos_token_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, return_logits: bool = False) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt; returns the tokens and their timings. Chapter 01."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    _check_eos(eos_token_id, model.config.vocab_size)
    if seed is not None and not _is_int(seed):
        raise ValueError(f"seed must be an integer or None, got {seed!r}")
    ids = as_token_batch(input_ids)
    batch, prompt_len = ids.shape
    limit = model.config.max_seq_len
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {prompt_len + max_new_tokens} "
            f"positions exceed the model's max_seq_len={limit}; pass max_new_tokens <= {max(limit - prompt_len, 0)} "
            "or shorten the prompt"
        )
    model.check_token_ids(ids)                              # the one vocabulary check, before the cache is made
    _check_memory(model, batch, prompt_len, max_new_tokens, use_cache)
    decoder = getattr(model, "compiled_decoder", None)      # llminfer.fast.compile_decode: the compiled step
    if decoder is not None and use_cache and not return_logits and decoder.fits(batch, prompt_len, max_new_tokens):
        return decoder.generate(ids, max_new_tokens, eos_token_id, temperature, top_k, top_p, seed)
    device = model.device
    ids = ids.to(device)
    cache = model.new_cache(batch, max_seq_len=max(prompt_len + max_new_tokens - 1, prompt_len)) if use_cache else None
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else torch.seed())

    new_tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)  # (B, N)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    all_logits: list[torch.Tensor] = []
    timer = TokenTimer(device)
    n_made = 0
    timer.start()
    context = ids                                           # (B, T) grows without a cache
    for step in range(max_new_tokens):
        if use_cache:
            logits = (prefill(model, ids, cache) if step == 0
                      else decode_step(model, new_tokens[:, step - 1], cache, check_ids=False))
        else:
            logits = model(context, last_only=True)[:, -1]  # recompute everything
        token = sample_next(logits, temperature, top_k, top_p, generator)                  # (B,)
        if eos_token_id is not None:
            token = torch.where(finished, torch.full_like(token, eos_token_id), token)
            finished |= token == eos_token_id
        new_tokens[:, step] = token
        if not use_cache:
            context = torch.cat([context, token[:, None]], dim=1)
        if return_logits:
            all_logits.append(logits.float().cpu())
        n_made = step + 1
        done = eos_token_id is not None and bool(finished.all())   # reading the flag waits for the GPU
        timer.token()
        if done:
            break

    rows = new_tokens[:, :n_made].tolist()
    if eos_token_id is not None:
        rows = [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in rows]
    return timer.result(rows[0] if batch == 1 else rows, prompt_len, use_cache, all_logits)
