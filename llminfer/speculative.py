"""Speculative decoding: a cheap drafter guesses k tokens, the target checks them in one forward. Chapter 09.

One step of the loop, with the target's cache holding every context token but the last:

    drafts = drafter.propose(context, k)                        # k guesses (maybe fewer), cheap
    logits = model([last] + drafts, cache=cache)                 # ONE forward over k + 1 positions
    n, token = accept(logits, drafts)                            # how many guesses stand, and one more token
    cache.truncate(length + 1 + n)                               # forget the K/V of the rejected guesses

Every step emits the accepted guesses plus one token of the target's own (the correction at the first
rejection, or a bonus token when all k stand), so it never makes fewer tokens than a plain decode step.
With temperature 0 a guess stands when it is the target's argmax, so the output is plain greedy decoding's,
token for token. With sampling, the rule of Leviathan et al. (2023) and Chen et al. (2023) keeps the
output distribution exactly the target's: accept a guess x drawn from the draft's q with probability
min(1, p(x)/q(x)); on rejection draw from the normalised positive part of p − q; after k acceptances draw
the bonus token from p. `acceptance_step` is that rule, vectorised over rows, so the same code runs one
sequence in the loop and 100 000 draws in the exactness test.

Drafters, behind one interface (`propose(context_ids, k) -> list[int]`; model drafters also give their
probabilities through `propose_with_probs`):

- `PromptLookupDrafter`: the tokens that followed the last n-gram's latest earlier occurrence in the context;
- `DraftModelDrafter`: a small model with the target's tokenizer (the bundled `tiny-capitals-draft`);
- `EarlyExitDrafter`: the target's own first layers, then its final norm and head (self-speculation).
"""
from __future__ import annotations

import abc
import math
import time
from dataclasses import dataclass, field

import torch

from .checks import is_int
from .device import synchronize
from .generate import (GenerationResult, TokenTimer, check_request, new_generator, probabilities, sample_next,
                       trim_at_eos)
from .model import Transformer

__all__ = ["Drafter", "PromptLookupDrafter", "DraftModelDrafter", "EarlyExitDrafter", "SpeculativeResult",
           "generate", "verify", "acceptance_step", "greedy_acceptance", "first_token_draws", "tv_distance",
           "tv_bound", "proportion_bound", "expected_speedup", "expected_tokens_per_step", "step_costs",
           "TARGET", "ACCEPTED", "RESAMPLED", "BONUS", "TOKEN_KINDS"]

# Where each emitted token came from.
TARGET = "target"          # the target alone: the prefill's token, or a step with nothing drafted
ACCEPTED = "accepted"      # a drafted token the target let stand
RESAMPLED = "resampled"    # the target's own token at the first rejected position (greedy: its argmax)
BONUS = "bonus"            # the extra token from p after all k drafted tokens stood
TOKEN_KINDS = (TARGET, ACCEPTED, RESAMPLED, BONUS)

_ROWS_PER_CHUNK = 4096     # acceptance_step samples residuals this many rows at a time (bounded memory)


# --- the drafters -----------------------------------------------------------------------------------------------

class Drafter(abc.ABC):
    """Proposes up to k next tokens for a context; the base of the three drafters. Chapter 09."""

    name = "drafter"

    @abc.abstractmethod
    def propose(self, context_ids: list[int], k: int) -> list[int]:
        """Up to k guessed next tokens after context_ids (fewer, even none, when it has no guess)."""

    def propose_with_probs(self, context_ids: list[int], k: int, temperature: float = 0.0,
                           generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        """The guesses and the distributions q (n, vocab) they were drawn from; None means each was certain."""
        return self.propose(context_ids, k), None

    def check_compatible(self, model: Transformer, tokenizer=None, context_len: int | None = None) -> None:
        """Raise ValueError, before any compute, if this drafter cannot serve `model`."""

    def start(self, capacity: int) -> None:
        """Prepare for a new sequence of at most `capacity` positions."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class PromptLookupDrafter(Drafter):
    """Guesses that the text goes on as it did after the last n-gram's latest earlier occurrence. Chapter 09.

    No weights: for n = max_ngram down to min_ngram, find the most recent earlier place where the context's
    last n tokens occurred, and propose the (up to k) tokens that followed them there. Editors and code
    assistants use this because their outputs copy long stretches of the input.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        for label, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{label} must be a positive integer, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram={min_ngram} is larger than max_ngram={max_ngram}; pass min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"prompt lookup (n-grams {min_ngram}..{max_ngram})"

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix n-gram."""
        length = len(context_ids)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = context_ids[length - n:]
            for start in range(length - n - 1, -1, -1):             # latest earlier occurrence first
                if context_ids[start:start + n] == suffix:
                    return list(context_ids[start + n:start + n + k])
        return []


class DraftModelDrafter(Drafter):
    """A small model with the target's tokenizer drafts k tokens, one cached step each. Chapter 09.

    It keeps its own KV cache between calls: each call reuses the cached prefix that still agrees with the
    context, rolls back the rest with `truncate`, feeds the new tokens in one forward, then drafts.
    """

    def __init__(self, draft_model: Transformer, tokenizer=None, name: str | None = None):
        if not isinstance(draft_model, Transformer):
            raise ValueError(f"draft_model must be an llminfer Transformer, got {type(draft_model).__name__}; "
                             "load one with llminfer.load_pretrained('tiny-capitals-draft')")
        self.model = draft_model
        self.tokenizer = tokenizer
        self.name = name or f"draft model ({draft_model.config.n_layers} layers)"
        self.cache = None
        self.cached_ids: list[int] = []

    def check_compatible(self, model: Transformer, tokenizer=None, context_len: int | None = None) -> None:
        """Same vocabulary (and tokenizer, where both are known), same device, room for the context."""
        draft_cfg, target_cfg = self.model.config, model.config
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"the drafter has a vocabulary of {draft_cfg.vocab_size} ids but the target has "
                             f"{target_cfg.vocab_size}; a draft model must use the target's tokenizer (e.g. "
                             "tiny-capitals-draft for tiny-capitals)")
        for label in ("bos_token_id", "eos_token_id"):
            mine, theirs = getattr(draft_cfg, label), getattr(target_cfg, label)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"the drafter's {label}={mine} but the target's is {theirs}; the two models were "
                                 "trained with different tokenizers, pick a draft made for this target")
        if self.tokenizer is not None and tokenizer is not None:
            ours, theirs = self.tokenizer.backend.get_vocab(), tokenizer.backend.get_vocab()
            if ours != theirs:
                differing = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
                raise ValueError(f"the drafter's tokenizer differs from the target's (e.g. {differing}); the same "
                                 "id would mean different text, so the guesses would be wrong; use a draft model "
                                 "trained with the target's tokenizer")
        if self.model.device != model.device:
            raise ValueError(f"the draft model is on {self.model.device} but the target on {model.device}; move it "
                             f"with draft_model.to({str(model.device)!r})")
        if context_len is not None and context_len > draft_cfg.max_seq_len:
            raise ValueError(f"the run needs {context_len} positions but the draft model's max_seq_len is "
                             f"{draft_cfg.max_seq_len}; shorten the prompt or max_new_tokens")

    def start(self, capacity: int) -> None:
        """A fresh draft cache for a new sequence (reused when it is large enough)."""
        capacity = min(capacity, self.model.config.max_seq_len)
        if self.cache is None or self.cache.capacity < capacity or self.cache.k[0].device != self.model.device:
            self.cache = self.model.new_cache(1, max_seq_len=capacity)
        self.cache.reset()
        self.cached_ids = []

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        """k greedy guesses."""
        return self.propose_with_probs(context_ids, k, 0.0)[0]

    @torch.inference_mode()
    def propose_with_probs(self, context_ids: list[int], k: int, temperature: float = 0.0,
                           generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        """k guesses, argmax (temperature 0) or sampled from q = softmax(logits / temperature); q is (k, vocab)."""
        if k < 1:
            return [], None
        if self.cache is None or self.cache.capacity < len(context_ids) + k - 1:
            self.start(len(context_ids) + k)
        common = 0                                              # cached positions that still match the context
        limit = min(len(self.cached_ids), len(context_ids) - 1)  # the last context token is always fed
        while common < limit and self.cached_ids[common] == context_ids[common]:
            common += 1
        self.cache.truncate(common)
        device = self.model.device
        feed = torch.tensor([context_ids[common:]], device=device)  # (1, T) the part the draft has not seen
        guesses, probs = [], []
        for i in range(k):
            logits = self.model(feed, cache=self.cache, last_only=True)[0, -1]      # (vocab,)
            if temperature == 0:
                token = logits.argmax().view(1)                                      # (1,) left on the device
            else:
                q = probabilities(logits, temperature)                               # (vocab,)
                token = torch.multinomial(q, 1, generator=generator)                 # (1,)
                probs.append(q)
            guesses.append(token)
            if i + 1 < k:
                feed = token.view(1, 1)                                              # (1, 1) the next input
        # one host read for the k guesses: reading each as it is made would wait for the device k times
        drafts = torch.cat(guesses).tolist()
        self.cached_ids = list(context_ids) + drafts[:-1]                            # what the cache now holds
        return drafts, (torch.stack(probs) if probs else None)                       # (k, vocab)


def _shallow_copy(model: Transformer, n_layers: int) -> Transformer:
    """A Transformer made of `model`'s embedding, first n_layers layers, final norm and head (shared, not copied)."""
    with torch.device("meta"):                                  # nothing allocated: every module is replaced
        shallow = Transformer(model.config.replace(n_layers=n_layers), attn_backend=model.attn_backend)
    shallow.embed_tokens = model.embed_tokens
    shallow.layers = model.layers[:n_layers]                    # the same stack class, its first layers
    shallow.norm = model.norm
    shallow.lm_head = model.lm_head
    return shallow.eval()


class EarlyExitDrafter(DraftModelDrafter):
    """Self-speculation: the target's first n_layers, then its own final norm and head, draft. Chapter 09.

    No second model to train or load; the weights are the target's, shared. The head was trained to read the
    last layer's output, not the n-th's, so the guesses are only as good as that shortcut happens to be.
    """

    def __init__(self, model: Transformer, n_layers: int):
        if not isinstance(model, Transformer):
            raise ValueError(f"model must be an llminfer Transformer, got {type(model).__name__}")
        total = model.config.n_layers
        if not is_int(n_layers) or not 1 <= n_layers < total:
            raise ValueError(f"n_layers must be an integer in 1..{total - 1} (the target has {total} layers; all "
                             f"of them would be the target itself), got {n_layers!r}")
        super().__init__(_shallow_copy(model, n_layers), name=f"early exit ({n_layers} of {total} layers)")
        self.n_layers = n_layers


# --- the acceptance rule ------------------------------------------------------------------------------------------

def greedy_acceptance(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: (n_accepted (N,), next_token (N,)); guesses stand while they are the argmax. Chapter 09.

    target_logits (N, k+1, vocab): row i predicts the token after drafted position i (row 0 after the last
    context token); draft_tokens (N, k).
    """
    k = draft_tokens.shape[-1]
    best = target_logits.argmax(dim=-1)                                         # (N, k+1)
    agree = (best[:, :k] == draft_tokens).int()                                  # (N, k)
    n_accepted = agree.cumprod(dim=-1).sum(dim=-1)                               # (N,) the matching prefix
    next_token = best.gather(1, n_accepted[:, None])[:, 0]                        # (N,) argmax after it
    return n_accepted, next_token


def _sample_rows(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw from each row of non-negative weights (R, vocab), by inverse CDF; rows need not sum to 1."""
    cdf = probs.double().cumsum(dim=-1)                                          # (R, vocab)
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]             # first cdf > u · total
    return idx.clamp_max(probs.shape[-1] - 1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p − q, 0) per row, or p itself where that is all zero (p == q: a rejection there was rounding)."""
    residual = (p - q).clamp_min(0)
    empty = residual.sum(-1, keepdim=True) <= 0
    return torch.where(empty, p, residual)


def _sample_shared(probs: torch.Tensor, n_draws: int, generator: torch.Generator | None) -> torch.Tensor:
    """n draws (n,) from one row of non-negative weights (vocab,), by inverse CDF."""
    cdf = probs.double().cumsum(dim=-1)                                          # (vocab,)
    u = torch.rand(n_draws, generator=generator, device=probs.device, dtype=torch.float64)
    return torch.searchsorted(cdf, u * cdf[-1], right=True).clamp_max(probs.shape[-1] - 1)


def _next_from_shared(p: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                      n_accepted: torch.Tensor, next_token: torch.Tensor, generator) -> None:
    """acceptance_step's new tokens when every row shares p (k+1, vocab) and q: one CDF per group of rows."""
    k = draft_tokens.shape[1]
    for at in range(k + 1):
        rows = (n_accepted == at).nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        weights = p[at].float()
        if at == k:                                                              # all stood: the bonus, from p
            next_token[rows] = _sample_shared(weights, rows.numel(), generator)
        elif draft_probs is not None:
            next_token[rows] = _sample_shared(_residual(weights, draft_probs[0, at].float()), rows.numel(), generator)
        else:                                                                    # q a point mass on the guess
            guesses = draft_tokens[rows, at]
            for guess in guesses.unique().tolist():
                group = rows[guesses == guess]
                minus = torch.zeros_like(weights)
                minus[guess] = 1.0
                next_token[group] = _sample_shared(_residual(weights, minus), group.numel(), generator)


def acceptance_step(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None = None,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Leviathan/Chen rule, vectorised over N rows: (n_accepted (N,), next_token (N,)). Chapter 09.

    target_probs (N or 1, k+1, vocab): p at each drafted position and at the bonus position.
    draft_tokens (N, k): the guesses. draft_probs (N or 1, k, vocab): the q each guess was drawn from, or None
    for a drafter that was certain (q is then a point mass on the guess, as for prompt lookup).
    Guess i stands with probability min(1, p(x)/q(x)); the first that falls is replaced by a draw from
    max(p − q, 0) normalised; if all k stand, next_token is the bonus, drawn from p at position k.
    """
    n_rows, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if target_probs.dim() != 3 or target_probs.shape[1] != k + 1 or target_probs.shape[0] not in (1, n_rows):
        raise ValueError(f"target_probs must be ({n_rows} or 1, {k + 1}, vocab) for {k} drafted tokens, got "
                         f"{tuple(target_probs.shape)}")
    if draft_probs is not None and (draft_probs.dim() != 3 or tuple(draft_probs.shape[1:]) != (k, vocab)
                                    or draft_probs.shape[0] not in (1, n_rows)):
        raise ValueError(f"draft_probs must be ({n_rows} or 1, {k}, {vocab}), got {tuple(draft_probs.shape)}")
    p = target_probs.expand(n_rows, k + 1, vocab)                                # views, nothing copied
    p_guess = p[:, :k].gather(-1, draft_tokens[..., None])[..., 0]               # (N, k) p(x_i)
    if draft_probs is None:
        q_guess = torch.ones_like(p_guess)                                       # point mass: q(x_i) = 1
    else:
        q = draft_probs.expand(n_rows, k, vocab)
        q_guess = q.gather(-1, draft_tokens[..., None])[..., 0]                  # (N, k) q(x_i)
    u = torch.rand(n_rows, k, generator=generator, device=p.device, dtype=p_guess.dtype)
    stands = (u * q_guess < p_guess).int()                                       # u < p/q without dividing
    n_accepted = stands.cumprod(dim=-1).sum(dim=-1)                              # (N,) guesses before the first fall
    next_token = torch.empty(n_rows, dtype=torch.long, device=p.device)
    if target_probs.shape[0] == 1 and (draft_probs is None or draft_probs.shape[0] == 1):
        _next_from_shared(target_probs[0], draft_tokens, draft_probs, n_accepted, next_token, generator)
        return n_accepted, next_token
    for lo in range(0, n_rows, _ROWS_PER_CHUNK):                                 # bounded memory for large N
        rows = torch.arange(lo, min(lo + _ROWS_PER_CHUNK, n_rows), device=p.device)
        at = n_accepted[rows]                                                    # (R,) position of the new token
        weights = p[rows, at].float()                                            # (R, vocab) p there
        fell = at < k                                                            # rows that rejected a guess
        if bool(fell.any()):
            guess_rows = rows[fell]
            guess_at = at[fell]
            if draft_probs is None:
                minus = torch.zeros_like(weights[fell])
                minus.scatter_(1, draft_tokens[guess_rows, guess_at][:, None], 1.0)
            else:
                minus = q[guess_rows, guess_at].float()
            weights[fell] = _residual(weights[fell], minus)
        next_token[rows] = _sample_rows(weights, generator)
    return n_accepted, next_token


def first_token_draws(target_probs: torch.Tensor, draft_probs: torch.Tensor, n_draws: int,
                      generator: torch.Generator | None = None, accept_all: bool = False):
    """(first emitted tokens (n,), accepted (n,) bool) of n independent speculative steps with one guess. Chapter 09.

    target_probs and draft_probs are (vocab,) for one fixed context: guesses are drawn from q, then
    `acceptance_step` runs on all n at once. accept_all=True is a deliberately wrong rule (every guess
    stands) whose output follows q instead of p: the negative control of the exactness test.
    """
    if not is_int(n_draws) or n_draws < 1:
        raise ValueError(f"n_draws must be a positive integer, got {n_draws!r}")
    guesses = _sample_shared(draft_probs, n_draws, generator)[:, None]          # (n, 1) x ~ q
    if accept_all:
        return guesses[:, 0], torch.ones(n_draws, dtype=torch.bool, device=guesses.device)
    p = torch.stack([target_probs, target_probs])[None]                         # (1, 2, vocab): bonus row unused
    n_accepted, next_token = acceptance_step(p, guesses, draft_probs[None, None], generator)
    accepted = n_accepted > 0
    return torch.where(accepted, guesses[:, 0], next_token), accepted


# --- statistics for the exactness test, and the speedup model --------------------------------------------------

def tv_distance(p: torch.Tensor, q: torch.Tensor) -> float:
    """Total-variation distance ½ Σ |p − q| between two distributions over the same ids. Chapter 09."""
    return 0.5 * float((p.double() - q.double()).abs().sum())


def tv_bound(p: torch.Tensor, n_draws: int, delta: float = 1e-6) -> float:
    """A bound the TV distance of n draws' histogram from p exceeds with probability below delta. Chapter 09.

    E[TV] ≤ ½ Σ_i sqrt(p_i (1 − p_i) / n) (each count is binomial; Jensen), and TV moves by at most 1/n when
    one draw changes, so McDiarmid's inequality adds sqrt(ln(1/delta) / (2n)).
    """
    p = p.double()
    mean = 0.5 * float(torch.sqrt(p * (1 - p) / n_draws).sum())
    return mean + math.sqrt(math.log(1 / delta) / (2 * n_draws))


def proportion_bound(n_draws: int, delta: float = 1e-6) -> float:
    """Hoeffding: a frequency of n draws lies within this of its probability, except with probability delta."""
    return math.sqrt(math.log(2 / delta) / (2 * n_draws))


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Mean tokens one step emits when each guess stands with probability alpha: (1 − α^(k+1)) / (1 − α)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """(1 − α^(k+1)) / ((1 − α)(c·k + v)): tokens per step over the step's cost in target steps. Chapter 09.

    c is the cost of one draft step as a fraction of one target step, and v (verify_cost) the cost of the
    verification forward over k + 1 positions in target steps. v = 1 is Leviathan et al. (2023)'s form (a purely
    memory-bound step); chapter 09 measures v on the machine, and the path, that runs the target.
    """
    if not verify_cost > 0:
        raise ValueError(f"verify_cost is the verification's cost in target steps and must be > 0, got {verify_cost!r}")
    return expected_tokens_per_step(alpha, k) / (cost_ratio * k + verify_cost)


def step_costs(model: Transformer, drafter: Drafter, context_ids: list[int], repeats: int = 50,
               warmup: int = 5) -> tuple[float, float]:
    """(median s of one draft step, median s of one target decode step) after context_ids, interleaved. Chapter 09.

    Their ratio is the c of `expected_speedup`. A draft step is `drafter.propose(context, 1)` with the context
    already seen (one single-token forward for a model drafter, one search for prompt lookup); a target step
    is one single-token forward at the end of the context, rolled back after each call. On a GPU the clock is
    the wall clock after a synchronisation; on a CPU it is this process's CPU time, which other jobs on a
    shared machine cannot inflate (they can only take turns with it).
    """
    import statistics

    if not is_int(repeats) or repeats < 1 or not is_int(warmup) or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats!r}, warmup={warmup!r}")
    if len(context_ids) < 2 or len(context_ids) >= model.config.max_seq_len:
        raise ValueError(f"context_ids must hold 2..{model.config.max_seq_len - 1} tokens, got {len(context_ids)}")
    device = model.device
    cache = model.new_cache(1, max_seq_len=len(context_ids))
    with torch.inference_mode():
        model(torch.tensor([context_ids[:-1]], device=device), cache=cache)
    length, last = cache.length, torch.tensor([context_ids[-1:]], device=device)
    if hasattr(drafter, "start"):
        drafter.start(len(context_ids) + 1)

    def target_step():
        cache.truncate(length)
        with torch.inference_mode():
            model(last, cache=cache)

    def draft_step():
        drafter.propose(context_ids, 1)

    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(warmup + repeats):
        for fn, record in ((draft_step, times[0]), (target_step, times[1])):
            synchronize(device)
            start = clock()
            fn()
            synchronize(device)
            if i >= warmup:
                record.append(clock() - start)
    return statistics.median(times[0]), statistics.median(times[1])


# --- the loop ------------------------------------------------------------------------------------------------------

@dataclass
class SpeculativeResult(GenerationResult):
    """A GenerationResult plus what the drafter did: drafted and accepted per step, each token's origin. Chapter 09."""

    drafter: str = ""
    num_speculative_tokens: int = 0
    drafted_per_step: list[int] = field(default_factory=list)     # guesses judged at each step (0..k; none past EOS)
    accepted_per_step: list[int] = field(default_factory=list)    # of those, how many stood
    token_kinds: list[str] = field(default_factory=list)          # TARGET, ACCEPTED, RESAMPLED or BONUS per token
    draft_s: float = 0.0                                          # time spent in the drafter
    verify_s: float = 0.0                                         # time spent in the target's verification forwards

    @property
    def num_drafted(self) -> int:
        return sum(self.drafted_per_step)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_step)

    @property
    def acceptance_rate(self) -> float:
        """Accepted guesses over drafted guesses (guesses after a rejection count as drafted); nan if none."""
        return self.num_accepted / self.num_drafted if self.num_drafted else float("nan")

    @property
    def alpha(self) -> float:
        """Per-guess acceptance probability: accepted over guesses actually judged (the formula's α); nan if none."""
        judged = self.num_accepted + sum(a < d for a, d in zip(self.accepted_per_step, self.drafted_per_step))
        return self.num_accepted / judged if judged else float("nan")

    @property
    def num_steps(self) -> int:
        """Verification forwards after the prefill."""
        return len(self.accepted_per_step)

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens emitted per verification forward (accepted guesses + 1); nan before any step."""
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else float("nan")


def verify(model: Transformer, cache, last_token: int, drafts: list[int], temperature: float = 0.0,
           draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> tuple[int, int]:
    """Checks the guesses in ONE forward and rolls the cache back: (n_accepted, next_token). Chapter 09.

    The cache holds every context token but `last_token`. The forward runs [last_token] + drafts at
    positions cache.length .. cache.length + n (row i of its logits predicts the token after input i), the
    acceptance rule picks how many guesses stand, and `cache.truncate` forgets the K/V of the rest, so the
    cache ends holding the context, `last_token` and the accepted guesses: exactly what plain decoding
    would have written. draft_probs (n, vocab) are the q the guesses were drawn from (None: certain).
    """
    device = model.device
    length = cache.length
    inputs = torch.tensor([[last_token] + list(drafts)], device=device)           # (1, n + 1)
    logits = model(inputs, cache=cache)                                           # (1, n + 1, vocab) one forward
    guesses = torch.tensor([list(drafts)], dtype=torch.long, device=device)       # (1, n)
    if temperature == 0:
        n_accepted, next_token = greedy_acceptance(logits, guesses)
    else:
        p = probabilities(logits, temperature)                                    # (1, n + 1, vocab)
        q = None if draft_probs is None else draft_probs[None]                    # (1, n, vocab)
        n_accepted, next_token = acceptance_step(p, guesses, q, generator)
    n, token = int(n_accepted[0]), int(next_token[0])                            # the step's one host read
    cache.truncate(length + 1 + n)                                                # drop the rejected guesses
    return n, token


def _check_k(num_speculative_tokens, max_seq_len: int) -> None:
    if not is_int(num_speculative_tokens) or num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be an integer >= 1 (the guesses per step), got "
                         f"{num_speculative_tokens!r}; for plain decoding use llminfer.generate")
    if num_speculative_tokens >= max_seq_len:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens} guesses need a verification forward of "
                         f"{num_speculative_tokens + 1} positions, beyond the model's context of max_seq_len="
                         f"{max_seq_len}; pass num_speculative_tokens <= {max_seq_len - 1} (a handful is typical)")


@torch.inference_mode()
def _checked_drafts(drafter, drafts, vocab_size: int) -> list[int]:
    """The drafter's guesses as ints, or ValueError naming the first that is not a token id of the target."""
    out = []
    for position, token in enumerate(drafts):
        if isinstance(token, torch.Tensor) and token.numel() == 1 and not token.is_floating_point():
            token = token.item()
        if not is_int(token) or not 0 <= token < vocab_size:
            raise ValueError(f"the drafter {getattr(drafter, 'name', type(drafter).__name__)!r} proposed {token!r} "
                             f"as guess {position}, not a token id of the target (0..{vocab_size - 1}); a drafter "
                             "must propose ids of the target's vocabulary")
        out.append(int(token))
    return out


def generate(model: Transformer, input_ids, drafter: Drafter, num_speculative_tokens: int = 4,
             max_new_tokens: int = 16, temperature: float = 0.0, eos_token_id: int | None = None,
             seed: int | None = None, tokenizer=None) -> SpeculativeResult:
    """Speculative decoding of one sequence; the output is the target's (greedy: token for token). Chapter 09.

    Each step the drafter guesses up to num_speculative_tokens tokens, the target checks them in one forward
    over the cache, the rejected positions are rolled back, and one token of the target's own is added.
    Pass `tokenizer` (the target's) to have a draft model's tokenizer compared with it.
    """
    ids = check_request(model.config, input_ids, max_new_tokens, eos_token_id, temperature, seed=seed, single=True)
    _check_k(num_speculative_tokens, model.config.max_seq_len)
    if not callable(getattr(drafter, "propose", None)):
        raise ValueError(f"drafter must have a propose(context_ids, k) method, got {type(drafter).__name__}; use "
                         "PromptLookupDrafter(), DraftModelDrafter(draft_model) or EarlyExitDrafter(model, n)")
    prompt_len = ids.shape[1]
    check = getattr(drafter, "check_compatible", None)
    if check is not None:
        check(model, tokenizer, prompt_len + max_new_tokens)
    device = model.device
    generator = new_generator(device, temperature, seed)
    cache = model.new_cache(1, max_seq_len=max(prompt_len + max_new_tokens - 1, prompt_len))
    if hasattr(drafter, "start"):
        drafter.start(prompt_len + max_new_tokens)
    context: list[int] = ids[0].tolist()
    ids = ids.to(device)
    propose = getattr(drafter, "propose_with_probs", None)
    tokens: list[int] = []
    kinds: list[str] = []
    drafted_per_step: list[int] = []
    accepted_per_step: list[int] = []
    draft_s = verify_s = 0.0
    timer = TokenTimer(device)
    timer.start()
    if max_new_tokens == 0:
        return SpeculativeResult([], 0.0, [], 0.0, prompt_len, drafter=getattr(drafter, "name", ""),
                                 num_speculative_tokens=num_speculative_tokens)
    logits = model(ids, cache=cache, last_only=True)[:, -1]                          # (1, vocab) the prefill
    first = int(sample_next(logits, temperature, generator=generator)[0])
    tokens.append(first)
    kinds.append(TARGET)
    context.append(first)
    timer.token()
    while len(tokens) < max_new_tokens and not (eos_token_id is not None and tokens[-1] == eos_token_id):
        k = min(num_speculative_tokens, max_new_tokens - len(tokens) - 1)            # never past the budget
        t0 = time.perf_counter()
        if k == 0:
            drafts, q = [], None
        elif propose is not None:
            drafts, q = propose(context, k, temperature, generator)
        else:
            drafts, q = drafter.propose(context, k), None
        drafts = _checked_drafts(drafter, drafts[:k], model.config.vocab_size)
        if q is not None:
            q = q[:len(drafts)]
        synchronize(device)
        t1 = time.perf_counter()
        n, token = verify(model, cache, context[-1], drafts, temperature, q, generator)
        verify_s += time.perf_counter() - t1
        draft_s += t1 - t0
        new = drafts[:n] + [token]
        new_kinds = [ACCEPTED] * n + [TARGET if not drafts else BONUS if n == len(drafts) else RESAMPLED]
        judged = len(drafts)
        if eos_token_id is not None and eos_token_id in new:                         # stop at the first EOS
            new = trim_at_eos(new, eos_token_id)
            new_kinds = new_kinds[:len(new)]
            judged = min(judged, len(new))                                           # guesses past it do not count
        drafted_per_step.append(judged)
        accepted_per_step.append(new_kinds.count(ACCEPTED))
        for token_id, kind in zip(new, new_kinds):
            tokens.append(token_id)
            kinds.append(kind)
            context.append(token_id)
            timer.token()
    base = timer.result(tokens, prompt_len)
    return SpeculativeResult(base.token_ids, base.ttft_s, base.itl_s, base.e2e_s, prompt_len,
                             drafter=getattr(drafter, "name", type(drafter).__name__),
                             num_speculative_tokens=num_speculative_tokens, drafted_per_step=drafted_per_step,
                             accepted_per_step=accepted_per_step, token_kinds=kinds, draft_s=draft_s,
                             verify_s=verify_s)
