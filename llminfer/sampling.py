"""From next-token logits to the next token: one ordered pipeline of logits processors and the sampler, for a batch
whose rows each carry their own settings. Chapter 13.

    logits (rows, vocab)
      1. repetition penalty            a logit of a token in the prompt or the output: / penalty if > 0, * penalty if < 0
      2. presence, frequency penalty   logit -= presence * [count > 0] + frequency * count, counting the output only
      3. allowed-token mask            a token the row's constraint forbids: -inf
      ── temperature 0: the argmax, here ──
      4. temperature                   logits / temperature (the largest subtracted first)
      5. top-k                         keep the k largest (and any tied with the k-th)
      6. top-p                         keep the smallest prefix, most likely first, whose probability reaches p
      7. min-p                         keep the tokens at least min_p times as likely as the most likely one
      8. the sampler                   a draw from softmax(what is left), with the row's own random generator

Why this order:

- The penalties (1, 2) change what the text has already said into a change of the model's raw scores, so they act on
  the raw logits, before the temperature rescales them: a penalty then means the same at every temperature, and
  a greedy row is penalised too. The repetition penalty is the multiplicative one of CTRL (Keskar et al., 2019) as
  transformers' `RepetitionPenaltyLogitsProcessor` computes it, over the prompt and the output (so 1.2 pushes
  every seen token toward less likely, whatever the sign of its logit); presence and frequency are the OpenAI
  API's additive ones, over the generated tokens only (vLLM counts them the same way).
- The mask (3) comes before the filters, so that the filters choose among the allowed tokens: a filter run first
  could keep only tokens the mask then removes (top_k=1 keeping a token the grammar forbids would leave nothing).
  Penalties never turn a finite logit into -inf, nor -inf into a finite one, so the mask may equally come first.
- Temperature 0 is the argmax of the penalised, masked logits. The filters never remove the most likely token, so
  running them first could not change it.
- The filters (5-7) come after the temperature, in transformers' order (vLLM's too, for top-k and top-p): a cut by
  probability (top-p, min-p) depends on the temperature, and top-p at 0.9 means 90 % of the distribution the row
  will actually draw from. min-p is scale-free (a ratio to the top token), but top-p's renormalised mass is not,
  so min-p after top-p differs from min-p before it; transformers' order is the one kept here.

The entry point:

    sample(logits, params, generators=None, history=None, allowed=None, names=None) -> token ids (rows,)

- `params`: one settings object per row, or one for every row. Any object with the fields of `SamplerSettings`
  (temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty) will do: the engine
  passes its requests' `SamplingParams`.
- `generators`: None (torch's default generator), one `torch.Generator` that every sampled row draws from in one
  call (`generate`'s batch), or one per row (None for a greedy row), so that each request's seeded draws do not
  depend on what else is in the batch (the engine).
- `history`: a `History` of the rows' prompt and output tokens; needed only when a row has a penalty.
- `allowed`: the hook for constrained decoding, an optional bool tensor (rows, vocab), True where the row may take
  the token. Disallowed logits become -inf after the penalties and before the temperature and filters; a row
  whose mask allows no token raises ValueError naming the row by `names[row]` (e.g. "request 7"; default
  "row 7"), since no constraint can continue from there. Checking for such a row reads one flag from the device.
- Nothing else is read back from the device: a step stays at the one read of its tokens.

`distribution(logits, params)` is the distribution a sampled row draws from (stages 4-7); `stages(logits, settings)`
the distribution after each stage, for a figure of what each one does to a model's next-token distribution.
`probabilities` and `generate.sample_next` are the pipeline with one setting for every row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .checks import check_sampling

__all__ = ["SamplerSettings", "History", "is_penalised", "penalise", "restrict", "apply_temperature", "apply_top_k",
           "apply_top_p", "apply_min_p", "distribution", "probabilities", "sample", "stages", "STAGES"]

NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplerSettings:
    """One row's settings of the pipeline, checked when made (`checks.check_sampling`). Chapter 13.

    temperature 0 is greedy; top_k, top_p and min_p None (or top_p 1, min_p 0) is no cut; repetition_penalty 1 and
    presence_penalty, frequency_penalty 0 are no penalty."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self):
        check_sampling(1, self.temperature, self.top_k, self.top_p, min_p=self.min_p,
                       repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                       frequency_penalty=self.frequency_penalty)


def is_penalised(params) -> bool:
    """True when the settings carry a repetition, presence or frequency penalty (they need a `History`)."""
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


def _to_device(values: list, dtype, device) -> torch.Tensor:
    """Host values as a tensor on device, copied without waiting for the work queued there (on a GPU, a blocking
    copy would first wait for the step's forward to finish)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _token_table(rows: list, vocab_size: int, device, dtype) -> torch.Tensor:
    """(len(rows), vocab_size) counts of each token id in each row's list of ids."""
    table = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    row_index = _to_device([i for i, ids in enumerate(rows) for _ in ids], torch.long, device)
    ids = _to_device([int(t) for ids in rows for t in ids], torch.long, device)
    table.index_put_((row_index, ids), torch.ones(len(ids), device=device), accumulate=True)
    return table.to(dtype)


class History:
    """The tokens the penalties look at, as (rows, vocab) tables on the logits' device. Chapter 13.

    seen: bool, True where the token is in the row's prompt or output (the repetition penalty's set);
    counts: float32, how often the token is in the row's output (the presence and frequency penalties' counts).

    `History.of(prompts, outputs, vocab_size, device)` builds them from id lists (or the prompts from a (rows, T)
    tensor); `append(tokens)` adds one sampled token per row, as a token loop goes.
    """

    def __init__(self, seen: torch.Tensor, counts: torch.Tensor):
        if seen.shape != counts.shape or seen.dtype != torch.bool:
            raise ValueError(f"seen must be a bool table of the shape of counts, got {seen.dtype} {tuple(seen.shape)} "
                             f"and {tuple(counts.shape)}")
        self.seen, self.counts = seen, counts

    @classmethod
    def of(cls, prompts, outputs=None, vocab_size: int | None = None, device=None) -> "History":
        """The history of rows with these prompts (id lists, or a (rows, T) long tensor) and outputs (id lists, or
        None for none yet)."""
        if vocab_size is None:
            raise ValueError("History.of needs vocab_size, the logits' last dimension")
        if isinstance(prompts, torch.Tensor):
            device = prompts.device if device is None else device
            seen = torch.zeros(prompts.shape[0], vocab_size, dtype=torch.bool, device=device)
            seen.scatter_(1, prompts.to(device), True)
        else:
            seen = _token_table(list(prompts), vocab_size, device, torch.bool)
        counts = (_token_table(list(outputs), vocab_size, device, torch.float32) if outputs is not None
                  else torch.zeros(seen.shape, dtype=torch.float32, device=seen.device))
        return cls(seen | (counts > 0), counts)

    def append(self, tokens: torch.Tensor) -> None:
        """One new output token per row (rows,)."""
        column = tokens.view(-1, 1).to(self.seen.device)
        self.seen.scatter_(1, column, True)
        self.counts.scatter_add_(1, column, torch.ones(column.shape, dtype=self.counts.dtype, device=column.device))


def _column(values: list, logits: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Per-row values as a (rows, 1) tensor on the logits' device: a fill where every row has the same value, else
    a copy that waits for nothing. A row's value is the same float32 number either way, so a row computes the same
    alone as in any batch."""
    if all(v == values[0] for v in values):
        return torch.full((len(values), 1), values[0], dtype=dtype, device=logits.device)
    return _to_device(values, dtype, logits.device)[:, None]


# --- the stages ---------------------------------------------------------------------------------------------

def penalise(logits: torch.Tensor, params: list, history: History | None) -> torch.Tensor:
    """Stages 1 and 2: the logits after each row's repetition, presence and frequency penalties (float32), or the
    logits themselves when no row has a penalty. Chapter 13."""
    if not any(is_penalised(p) for p in params):
        return logits
    if history is None or history.seen.shape != logits.shape:
        got = "none" if history is None else f"one of shape {tuple(history.seen.shape)}"
        raise ValueError(f"penalties need the History of the batch's tokens, (rows, vocab) = {tuple(logits.shape)}; "
                         f"got {got}; pass history=History.of(prompts, outputs, vocab_size)")
    logits = logits.float()
    if any(p.repetition_penalty != 1 for p in params):
        penalty = _column([float(p.repetition_penalty) for p in params], logits)
        logits = torch.where(history.seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params):
        presence = _column([float(p.presence_penalty) for p in params], logits)
        frequency = _column([float(p.frequency_penalty) for p in params], logits)
        logits = logits - (presence * (history.counts > 0) + frequency * history.counts)
    return logits


def restrict(logits: torch.Tensor, allowed: torch.Tensor | None, names: list[str]) -> torch.Tensor:
    """Stage 3: -inf where a row's allowed-token mask (rows, vocab) is False; ValueError naming a row whose mask
    allows no token (one flag read from the device). Chapter 13."""
    if allowed is None:
        return logits
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool or allowed.shape != logits.shape:
        got = f"a {allowed.dtype} tensor of shape {tuple(allowed.shape)}" if isinstance(allowed, torch.Tensor) \
            else type(allowed).__name__
        raise ValueError(f"allowed must be a bool tensor of the logits' shape {tuple(logits.shape)} (True: the row "
                         f"may take the token), got {got}")
    allowed = allowed.to(logits.device)
    empty = ~allowed.any(dim=-1)
    if empty.any():
        row = int(empty.nonzero()[0, 0])
        raise ValueError(f"the allowed-token mask of {names[row]} allows no token at this step, so its constraint "
                         "cannot continue; the constraint's automaton reached a state with no way out")
    return logits.masked_fill(~allowed, NEG_INF)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Stage 4: (logits - their largest) / temperature (rows, 1), in float32. Chapter 01.

    The largest logit is subtracted before dividing, so any temperature down to MIN_TEMPERATURE gives finite numbers
    (the others become -inf, probability 0) instead of inf / inf = nan."""
    logits = logits.float()
    return (logits - logits.amax(dim=-1, keepdim=True)) / temperature


def apply_top_k(logits: torch.Tensor, top_k: list) -> torch.Tensor:
    """Stage 5: -inf below each row's k-th largest logit (ties with it kept, as transformers' TopKLogitsWarper);
    top_k holds one k or None per row."""
    vocab = logits.shape[-1]
    ks = [k if k is not None and k < vocab else 0 for k in top_k]        # 0: no cut
    if not any(ks):
        return logits
    values = torch.topk(logits, max(ks), dim=-1).values                   # (rows, largest k)
    k = _column(ks, logits, torch.long)
    kth = values.gather(-1, (k - 1).clamp(min=0)).masked_fill(k == 0, NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: list) -> torch.Tensor:
    """Stage 6: keep the smallest prefix of each row's tokens, most likely first, whose probability reaches its p
    (None or 1: no cut). Chapter 01."""
    if all(p is None or p >= 1 for p in top_p):
        return logits
    p = _column([float(p) if p is not None and p < 1 else float("inf") for p in top_p], logits)
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs          # probability mass ranked above each token
    drop_sorted = before >= p                      # keep the smallest prefix that reaches top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: list) -> torch.Tensor:
    """Stage 7: -inf where a token's probability is below min_p times the row's largest (None or 0: no cut), as
    transformers' MinPLogitsWarper."""
    if all(m is None or m == 0 for m in min_p):
        return logits
    m = _column([float(m or 0.0) for m in min_p], logits)
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < m * probs.amax(dim=-1, keepdim=True), NEG_INF)


def distribution(logits: torch.Tensor, params: list) -> torch.Tensor:
    """Stages 4-7 and the softmax: the float32 distribution (rows, vocab) each sampled row draws from (every row's
    temperature > 0). Chapter 13."""
    logits = apply_temperature(logits, _column([float(p.temperature) for p in params], logits))
    logits = apply_top_k(logits, [p.top_k for p in params])
    logits = apply_top_p(logits, [p.top_p for p in params])
    logits = apply_min_p(logits, [p.min_p for p in params])
    return logits.softmax(dim=-1)


def probabilities(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None,
                  min_p: float | None = None) -> torch.Tensor:
    """softmax(logits / temperature) over the last dimension, in float32, after the top-k, top-p and min-p cuts;
    same shape as logits (..., vocab). Chapter 01."""
    settings = SamplerSettings(temperature, top_k, top_p, min_p)
    if temperature == 0:
        raise ValueError("probabilities need a temperature > 0; at temperature 0 the next token is the argmax")
    flat = logits.reshape(-1, logits.shape[-1])
    return distribution(flat, [settings] * flat.shape[0]).view(logits.shape)


def _rows(params, rows: int) -> list:
    """params as one settings object per row."""
    if isinstance(params, Sequence):
        if len(params) != rows:
            raise ValueError(f"{len(params)} settings for {rows} rows of logits; pass one per row, or one for all")
        return list(params)
    return [params] * rows


def sample(logits: torch.Tensor, params, generators=None, history: History | None = None,
           allowed: torch.Tensor | None = None, names: list[str] | None = None) -> torch.Tensor:
    """The next token id of each row (rows,) from its logits (rows, vocab), through the whole pipeline with the
    row's own settings: the argmax where its temperature is 0, else a draw. Chapter 13.

    params: one settings object per row, or one for all; generators: None, one torch.Generator for every sampled
    row (one draw over them all), or one per row; history: the rows' tokens, needed when a row has a penalty;
    allowed: an optional bool mask (rows, vocab) of the tokens each row may take; names: how an error names a row.
    """
    rows = logits.shape[0]
    params = _rows(params, rows)
    names = names if names is not None else [f"row {i}" for i in range(rows)]
    logits = restrict(penalise(logits, params, history), allowed, names)
    greedy = logits
    if greedy.device.type == "cpu" and greedy.dtype in (torch.bfloat16, torch.float16):
        # float32 holds every bfloat16 and float16 value exactly, so the argmax (the first index of the largest,
        # a NaN before all) is the same; torch's CPU argmax over a 49,152-entry vocabulary takes 176 µs in
        # bfloat16 against 65 with the widening (about 1.5 % of a bfloat16 SmolLM2 decode step)
        greedy = greedy.float()
    chosen = greedy.argmax(dim=-1)                                       # (rows,)
    sampled = [i for i, p in enumerate(params) if p.temperature != 0]
    if not sampled:
        return chosen
    every = len(sampled) == rows
    index = None if every else _to_device(sampled, torch.long, logits.device)
    probs = distribution(logits if every else logits.index_select(0, index), [params[i] for i in sampled])
    if generators is None or isinstance(generators, torch.Generator):
        drawn = torch.multinomial(probs, 1, generator=generators)[:, 0]
    else:                                 # each row from its own generator: its draws do not depend on the batch
        if len(generators) != rows:
            raise ValueError(f"{len(generators)} generators for {rows} rows; pass one per row (None for greedy rows)")
        drawn = torch.cat([torch.multinomial(probs[j:j + 1], 1, generator=generators[i])[:, 0]
                           for j, i in enumerate(sampled)])
    return drawn if every else chosen.index_copy_(0, index, drawn)


# --- what each stage does, for a figure ------------------------------------------------------------------------

STAGES = ("model", "repetition penalty", "presence and frequency penalties", "allowed tokens", "temperature",
          "top-k", "top-p", "min-p")


def stages(logits: torch.Tensor, settings: SamplerSettings, history: History | None = None,
           allowed: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The next-token distribution (vocab,) after each stage of the pipeline, by the names in STAGES, for one row's
    logits (vocab,): "model" is softmax(logits), each later entry the distribution once that stage has acted (the
    same as the one before where the stage is off). At temperature 0 the distribution from "temperature" on is all
    on the argmax. Chapter 13.

    history: a one-row History (penalties need it); allowed: a (vocab,) bool mask."""
    if not isinstance(settings, SamplerSettings):
        raise ValueError(f"settings must be a SamplerSettings, got {type(settings).__name__}")
    if logits.dim() != 1:
        raise ValueError(f"stages takes one row's logits (vocab,), got shape {tuple(logits.shape)}")
    row = logits[None].float()
    out = {"model": row.softmax(-1)}
    neutral = SamplerSettings(repetition_penalty=settings.repetition_penalty)
    row = penalise(row, [neutral], history)
    out["repetition penalty"] = row.softmax(-1)
    row = penalise(row, [SamplerSettings(presence_penalty=settings.presence_penalty,
                                         frequency_penalty=settings.frequency_penalty)], history)
    out["presence and frequency penalties"] = row.softmax(-1)
    row = restrict(row, None if allowed is None else allowed[None], ["the row"])
    out["allowed tokens"] = row.softmax(-1)
    if settings.temperature == 0:
        one_hot = torch.zeros_like(row).scatter(-1, row.argmax(-1, keepdim=True), 1.0)
        out.update({name: one_hot for name in STAGES[4:]})
    else:
        row = apply_temperature(row, _column([float(settings.temperature)], row))
        out["temperature"] = row.softmax(-1)
        for name, stage, value in (("top-k", apply_top_k, settings.top_k), ("top-p", apply_top_p, settings.top_p),
                                   ("min-p", apply_min_p, settings.min_p)):
            row = stage(row, [value])
            out[name] = row.softmax(-1)
    return {name: probs[0] for name, probs in out.items()}
