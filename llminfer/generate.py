"""Prefill, decode and the generation loop, with a timestamp for every token. Chapter 01.

With the cache: one forward over the prompt (prefill), then one single-token forward per new token
(decode). Without it: a forward over *all* tokens so far at every step, recomputing every earlier
token's K and V — the waste that chapter 03 counts and chapter 04 removes.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .kv_cache import KVCache
from .model import Transformer
from .timing import synchronize

__all__ = ["GenerationResult", "prefill", "decode_step", "generate", "sample_next", "synchronize"]


@dataclass
class GenerationResult:
    """New tokens and when each arrived. Chapter 01."""

    token_ids: list                 # list[int] for batch 1, else one list per sequence; EOS included when reached
    ttft_s: float                   # time to first token: the prefill, plus picking the token
    token_latencies_s: list[float]  # one per decoded token after the first (TPOT / inter-token latency)
    prompt_len: int
    use_cache: bool
    logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # (B, vocab) per step, if asked for

    @property
    def tpot_s(self) -> float:
        """Median time per output token after the first (nan if only one token was made)."""
        return statistics.median(self.token_latencies_s) if self.token_latencies_s else float("nan")

    @property
    def total_s(self) -> float:
        return self.ttft_s + sum(self.token_latencies_s)


def prefill(model: Transformer, input_ids: torch.Tensor, cache: KVCache, start_pos: int = 0) -> torch.Tensor:
    """One forward over the whole prompt, filling the cache; returns the last position's logits (B, vocab). Chapter 01."""
    return model(input_ids, cache=cache, start_pos=start_pos, last_only=True)[:, -1]


def decode_step(model: Transformer, token_ids: torch.Tensor, cache: KVCache, start_pos: int) -> torch.Tensor:
    """One new token per sequence against the cache; returns its logits (B, vocab). Chapter 01."""
    if token_ids.dim() == 1:
        token_ids = token_ids[:, None]                                  # (B, 1)
    return model(token_ids, cache=cache, start_pos=start_pos)[:, -1]


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")


def _as_batch(input_ids) -> torch.Tensor:
    if isinstance(input_ids, torch.Tensor):
        ids = input_ids
    elif isinstance(input_ids, Sequence) and not isinstance(input_ids, str):
        ids = torch.tensor(input_ids, dtype=torch.long)
    else:
        raise ValueError(f"input_ids must be a list of token ids or a tensor, got {type(input_ids).__name__}; "
                         "encode text first with tokenizer.encode(text)")
    if ids.dim() == 1:
        ids = ids[None, :]                                              # (1, T)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError("the prompt must hold at least one token, got an empty prompt")
    return ids.long()


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, vocab): argmax when temperature is 0, else a filtered sample. Chapter 01."""
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


@torch.no_grad()
def generate(model: Transformer, input_ids, max_new_tokens: int = 16, use_cache: bool = True,
             eos_token_id: int | None = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, return_logits: bool = False) -> GenerationResult:
    """Generate up to max_new_tokens after the prompt; returns the tokens and their timings. Chapter 01."""
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    ids = _as_batch(input_ids)
    batch, prompt_len = ids.shape
    limit = model.config.max_seq_len
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt of {prompt_len} tokens + max_new_tokens={max_new_tokens} = {prompt_len + max_new_tokens} "
            f"positions exceed the model's max_seq_len={limit}; pass max_new_tokens <= {max(limit - prompt_len, 0)} "
            "or shorten the prompt"
        )
    cache = model.new_cache(batch, max_seq_len=max(prompt_len + max_new_tokens - 1, prompt_len)) if use_cache else None
    model.check_input(ids, cache, 0)                        # ids in the vocabulary, cache big enough: before compute
    device = model.device
    ids = ids.to(device)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed if seed is not None else torch.seed())

    new_tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)  # (B, N)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    all_logits: list[torch.Tensor] = []
    latencies: list[float] = []
    ttft = 0.0
    n_made = 0
    synchronize(device)
    clock = time.perf_counter()
    context = ids                                           # (B, T) grows without a cache
    for step in range(max_new_tokens):
        if use_cache:
            if step == 0:
                logits = model.forward_unchecked(ids, cache, 0, last_only=True)[:, -1]     # prefill
            else:
                logits = model.forward_unchecked(new_tokens[:, step - 1:step], cache, prompt_len + step - 1)[:, -1]
        else:
            logits = model.forward_unchecked(context, None, 0, last_only=True)[:, -1]     # recompute everything
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
        synchronize(device)
        now = time.perf_counter()
        if step == 0:
            ttft = now - clock
        else:
            latencies.append(now - clock)
        clock = now
        if done:
            break

    rows = new_tokens[:, :n_made].tolist()
    if eos_token_id is not None:
        rows = [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in rows]
    return GenerationResult(
        token_ids=rows[0] if batch == 1 else rows,
        ttft_s=ttft,
        token_latencies_s=latencies,
        prompt_len=prompt_len,
        use_cache=use_cache,
        logits=all_logits,
    )
