"""One request's walk through a compiled pattern: the mask for the next token, and the text it is forced to write.
Chapter 13.

`Constraint` holds a `TokenIndex` (shared by every request with the same pattern) and this request's DFA state.
Before each sampling step the caller takes `allowed_mask()` and sets the logits of the other tokens to -inf; after
it, `advance(token)` moves the state. EOS is allowed exactly where the text is complete (`is_accepting`).

Jump-forward (SGLang): where the automaton allows one continuation only, e.g. after `{"name": "Paris"` in a schema
whose next key is fixed, the next bytes ", \"country\": \"" are certain, and decoding them one token per step wastes
a model call per token. `forced_tokens()` returns that text and its tokens; the caller appends them all in one
prefill step and `advance`s through them.

The tokenization boundary. A model learnt text cut by its tokenizer, and `"` followed by `name` is not how the
tokenizer cuts `"name`. SGLang re-tokenizes the last generated tokens together with the forced text and replaces
them. `jump_tokens` does that for the token just sampled, which is not in the KV cache yet, so nothing needs
rolling back there: the sampled token's text and the forced text are tokenized as one, and that cut replaces both
(the same bytes, so the same DFA path). Where the sampled token ends inside a UTF-8 character, or the new cut does
not fit the tokens left, the boundary stays conservative: the sampled token, then the forced text tokenized alone.

Finishing within the token budget. A free string can run on until `max_tokens` cuts it, and a cut document does
not parse. `finish_within(max_tokens)` prevents that: each state knows the fewest bytes that complete the text
(`TokenIndex.distances`), and near the end of the budget the mask keeps only the tokens after which that rest
still fits in the tokens left (`TokenIndex.within`): a byte-level vocabulary spells any rest of d bytes in at most
d tokens, then EOS. A token that opens a four-byte emoji moves the end further away, so it is refused once the
budget could not close it. A document that can be finished in time is; where even the shortest cannot fit, the
mask keeps the tokens that come nearer. `generate` and the engine call it with the request's max_new_tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from .index import TokenIndex, Vocabulary, compile_index
from .json_schema import schema_to_regex
from .regex import DEAD, MAX_STATES

__all__ = ["Constraint", "ForcedText", "batch_mask", "check_constraints", "jump_tokens"]


class ForcedText(tuple):
    """(text, token_ids): the only continuation the automaton allows from here, and its tokens."""

    @property
    def text(self) -> str:
        return self[0]

    @property
    def token_ids(self) -> list[int]:
        return self[1]


class Constraint:
    """A request's state in a compiled pattern. `tokenizer` (a llminfer Tokenizer) is needed for forced_tokens."""

    def __init__(self, index: TokenIndex, tokenizer=None):
        self.index = index
        self.tokenizer = tokenizer
        self.state = index.dfa.initial
        self.finished = False                  # EOS was taken
        self.max_tokens: int | None = None     # see finish_within
        self.taken = 0                         # tokens advanced through, EOS and forced tokens included
        self._previous: int | None = None      # the state before the last advance (undo_last)

    @classmethod
    def from_regex(cls, pattern: str, tokenizer, max_states: int = MAX_STATES) -> "Constraint":
        """A fresh constraint for `pattern` over `tokenizer`'s vocabulary (the index comes from the cache)."""
        return cls(compile_index(pattern, Vocabulary.from_tokenizer(tokenizer), max_states), tokenizer)

    @classmethod
    def from_schema(cls, schema, tokenizer, max_states: int = MAX_STATES) -> "Constraint":
        """A fresh constraint for the JSON documents valid against `schema` (see json_schema.schema_to_regex)."""
        return cls.from_regex(schema_to_regex(schema), tokenizer, max_states)

    @property
    def vocab_size(self) -> int:
        return len(self.index.vocab)

    @property
    def is_accepting(self) -> bool:
        """Whether the text so far is complete (EOS allowed now)."""
        return self.state != DEAD and self.index.dfa.accepting[self.state]

    def finish_within(self, max_tokens: int) -> "Constraint":
        """Complete the text within max_tokens tokens (EOS included) where it still can: see the module's notes."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r}: the budget is a count of tokens, at least 1")
        self.max_tokens = max_tokens
        return self

    @property
    def left(self) -> int | None:
        """The tokens left in the budget, the next one included (None without a budget or once EOS was taken)."""
        if self.max_tokens is None or self.finished:
            return None
        return self.max_tokens - self.taken

    def allowed_token_ids(self):
        """The ids allowed next, sorted (a numpy array); none once EOS was taken."""
        return np.flatnonzero(self.allowed_mask().numpy())

    def allowed_mask(self) -> torch.Tensor:
        """A bool tensor over the vocabulary, True where the next token may be sampled."""
        return self.index.mask(DEAD if self.finished else self.state, self.left)

    def advance(self, token_id: int) -> None:
        """Move past `token_id`; ValueError if the pattern does not allow it here."""
        token_id = int(token_id)
        if self.finished:
            raise ValueError(f"token {token_id} came after EOS; the constrained text was already complete")
        if token_id == self.index.eos_token_id:
            if not self.is_accepting:
                raise ValueError(f"EOS (token {token_id}) is not allowed: the text does not match "
                                 f"{self.index.dfa.pattern[:80]!r} yet")
            self.finished = True
            self.taken += 1
            return
        target = self.index.next_state(self.state, token_id)
        if target == DEAD:
            raise ValueError(f"token {token_id} ({self.index.vocab.token_bytes[token_id]!r}) leaves the pattern "
                             f"{self.index.dfa.pattern[:80]!r}; sample only where allowed_mask() is True")
        self._previous = self.state
        self.state = target
        self.taken += 1

    def undo_last(self) -> None:
        """Step back over the last token advanced through (not EOS): jump-forward's re-tokenization replaces it."""
        if self._previous is None:
            raise ValueError("nothing to undo: undo_last steps back over one advance(), once")
        self.state, self._previous = self._previous, None
        self.taken -= 1

    def forced_bytes(self) -> bytes:
        """The bytes that must come next: followed while the state does not accept and exactly one byte keeps it
        alive; cut back to the last whole UTF-8 character."""
        transitions, accepting = self.index.dfa.transitions, self.index.dfa.accepting
        state, out = self.state, bytearray()
        while not self.finished and state != DEAD and not accepting[state]:
            live = [b for b, t in enumerate(transitions[state]) if t != DEAD]
            if len(live) != 1:
                break
            out.append(live[0])
            state = transitions[state][live[0]]
        while out:
            try:
                out.decode("utf-8")
                break
            except UnicodeDecodeError:
                out.pop()
        return bytes(out)

    def forced_tokens(self) -> ForcedText:
        """(text, token_ids) of the forced continuation, tokenized on its own (the conservative boundary); empty
        when the next token is a free choice."""
        if self.tokenizer is None:
            raise ValueError("forced_tokens needs the tokenizer: build the Constraint with tokenizer=...")
        text = self.forced_bytes().decode("utf-8")
        return ForcedText((text, self.tokenizer.encode(text) if text else []))


def jump_tokens(constraint: Constraint, sampled: int, budget: int, retokenize: bool = True) -> list[int]:
    """Jump-forward right after `sampled` (the token just sampled, which `constraint` has advanced through): the
    tokens to run next, the first in the sampled token's place, with the constraint advanced through all of them.

    Without forced text that is [sampled]. With it: the sampled token's text and the forced text tokenized as one
    (SGLang's boundary) where retokenize, the token decodes on its own and the cut fits; else [sampled, *the forced
    text's own tokens]. Never more than `budget` tokens after the first."""
    forced = constraint.forced_tokens()
    if not forced.text:
        return [sampled]
    tokens = [sampled, *forced.token_ids]
    if retokenize:
        try:
            text = constraint.index.vocab.token_bytes[sampled].decode("utf-8") + forced.text
        except UnicodeDecodeError:                         # the sampled token ends inside a character
            text = None
        canonical = None if text is None else constraint.tokenizer.encode(text)
        if canonical and canonical != tokens and len(canonical) - 1 <= budget:
            constraint.undo_last()                         # back to before the sampled token: same bytes follow
            for token in canonical:
                constraint.advance(token)
            return canonical
    tokens = tokens[:budget + 1]
    for token in tokens[1:]:
        constraint.advance(token)
    return tokens


def check_constraints(constraint, batch: int, vocab_size: int, eos_token_id: int | None) -> list:
    """One Constraint or None per row, from `constraint` (one Constraint for a batch of 1, or a list per row);
    ValueError before any compute when the count, the vocabulary or the end-of-sequence token does not fit."""
    rows = constraint if isinstance(constraint, (list, tuple)) else [constraint] * (batch if constraint is None else 1)
    if len(rows) != batch:
        raise ValueError(f"constraint= gives {len(rows)} constraints for a batch of {batch} rows; pass one per row "
                         "(None for a free row)")
    for row, item in enumerate(rows):
        if item is None:
            continue
        if not isinstance(item, Constraint):
            raise ValueError(f"constraint for row {row} is a {type(item).__name__}; build one with "
                             "Constraint.from_regex(pattern, tokenizer) or Constraint.from_schema(schema, tokenizer)")
        if item.vocab_size > vocab_size:
            raise ValueError(f"the constraint of row {row} covers {item.vocab_size} tokens, more than the model's "
                             f"{vocab_size}; build it with this model's tokenizer")
        if item.index.eos_token_id != eos_token_id:
            raise ValueError(f"the constraint of row {row} ends with token {item.index.eos_token_id} (its tokenizer's "
                             f"EOS) but generation stops at {eos_token_id!r}; pass eos_token_id="
                             f"{item.index.eos_token_id} (and not ignore_eos=True)")
    return rows


def batch_mask(rows: list, vocab_size: int, device) -> torch.Tensor | None:
    """The allowed-token mask (rows, vocab_size) for the sampler: each constrained row's mask (padded with False
    past its vocabulary), all True for a free row or one whose constraint already took EOS; None without any."""
    if all(c is None for c in rows):
        return None
    if len(rows) == 1 and rows[0].vocab_size == vocab_size and not rows[0].finished:
        return rows[0].allowed_mask().view(1, -1).to(device)     # the cached mask itself, no copy
    mask = torch.ones(len(rows), vocab_size, dtype=torch.bool)
    for row, constraint in enumerate(rows):
        if constraint is not None and not constraint.finished:
            mask[row] = False
            mask[row, :constraint.vocab_size] = constraint.allowed_mask()
    return mask.to(device)
