"""The automaton lifted to a tokenizer: for each DFA state, the tokens that keep the text inside the language.
Chapter 13.

A token is allowed in a state when walking its bytes through the DFA never reaches the dead state (`regex.DEAD`):
the text so far plus the token can still be completed to a match. The end-of-sequence token is allowed exactly in
accepting states. Special tokens (chat markers) are never allowed.

Tokens are byte strings. A byte-level BPE tokenizer (GPT-2's, SmolLM2's) spells each byte as a printable character
('Ġ' is the space 0x20); `Vocabulary.from_tokenizer` maps the spellings back to bytes, so a token holding half of a
UTF-8 character ('é' split as 0xC3 | 0xA9) is walked byte by byte like any other and lands in a mid-character
state. This is how outlines-core treats tokens too, so the two can be compared state by state.

Walking 49,152 tokens one by one from every state, a Python step per byte, costs about 300,000 steps a state. The
usual remedy is a trie of the vocabulary walked together with the DFA, cutting a branch the moment the DFA dies;
in Python even that visits ~100,000 trie nodes in a permissive state (inside a JSON string). Here the tokens walk
in lockstep instead, as numpy arrays: byte position j of every surviving token is read in one gather through the
DFA's transition table, tokens whose DFA state died drop out, and tokens that end at j with a live state are
allowed. It is the trie's pruning done column by column; a state costs a few milliseconds. Each state's set is
computed the first time it is needed and kept; `TokenIndex.compile_all` computes every state's. Indexes are cached
by pattern, vocabulary and limit (`compile_index`).
"""
from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from .regex import DEAD, MAX_STATES, DFA, compile_regex

__all__ = ["Vocabulary", "TokenIndex", "compile_index", "byte_decoder"]


def byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, reversed: character -> byte. Printable Latin-1 bytes spell
    themselves; the others (space, control bytes ...) are shifted to 256 + n in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class Vocabulary:
    """Each token id's byte string (None for special tokens, which a constraint never allows) and the
    end-of-sequence id; as arrays for the lockstep walk: `candidates` (the ids that may ever be allowed, EOS and
    specials excluded), `lengths` and `table` (candidates x longest token, bytes zero-padded)."""

    _cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, token_bytes: list[bytes | None], eos_token_id: int | None):
        self.token_bytes = token_bytes
        self.eos_token_id = eos_token_id
        self.candidates = np.array([i for i, data in enumerate(token_bytes) if data and i != eos_token_id],
                                   dtype=np.int64)
        self.lengths = np.array([len(token_bytes[i]) for i in self.candidates], dtype=np.int64)
        self.table = np.zeros((len(self.candidates), int(self.lengths.max(initial=0))), dtype=np.uint8)
        for row, token_id in enumerate(self.candidates):
            data = token_bytes[token_id]
            self.table[row, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        digest = hashlib.sha256(repr((eos_token_id, token_bytes)).encode("latin-1", "backslashreplace"))
        self.fingerprint = digest.hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.token_bytes)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "Vocabulary":
        """The vocabulary of a llminfer `Tokenizer` with a byte-level BPE model (its decoder is ByteLevel); built
        once per tokenizer object."""
        cached = cls._cache.get(tokenizer)
        if cached is not None:
            return cached
        backend = tokenizer.backend
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            raise ValueError(f"structured output reads tokens as bytes through a ByteLevel decoder; this tokenizer's "
                             f"decoder is {decoder.get('type')!r}. Build a Vocabulary(token_bytes, eos_token_id) "
                             "with each token's bytes instead")
        to_byte = byte_decoder()
        added = backend.get_added_tokens_decoder()
        token_bytes: list[bytes | None] = []
        for token_id in range(tokenizer.vocab_size):
            if token_id in added:
                token = added[token_id]
                token_bytes.append(None if token.special else token.content.encode("utf-8"))
                continue
            spelling = backend.id_to_token(token_id)
            token_bytes.append(bytes(to_byte[c] for c in spelling) if spelling is not None else None)
        vocab = cls(token_bytes, tokenizer.eos_token_id)
        cls._cache[tokenizer] = vocab
        return vocab


class TokenIndex:
    """A DFA and a vocabulary: per state, the allowed token ids, as a sorted array and as a bool mask."""

    def __init__(self, dfa: DFA, vocab: Vocabulary):
        self.dfa, self.vocab = dfa, vocab
        self._allowed: dict[int, np.ndarray] = {}
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}
        self._closing: dict[int, np.ndarray] = {}
        self._within: dict[tuple[int, int], np.ndarray] = {}
        self._distances: np.ndarray | None = None
        n = dfa.num_states                      # the transition table with DEAD as one more row, n, that stays n
        self._table = np.array(dfa.transitions + [[DEAD] * 256], dtype=np.int64).reshape(n + 1, 256)
        self._table[self._table == DEAD] = n

    @property
    def eos_token_id(self) -> int | None:
        return self.vocab.eos_token_id

    def allowed_tokens(self, state: int) -> np.ndarray:
        """The sorted ids allowed in `state` (EOS included when the state accepts)."""
        allowed = self._allowed.get(state)
        if allowed is None:
            allowed = self._allowed[state] = self._walk(state)
        return allowed

    def _walk(self, state: int, closing: bool = False) -> np.ndarray:
        """Every candidate token's bytes through the DFA from `state`, one byte position at a time. closing: only
        the tokens that end nearer an accepting state (`distances`), and EOS where `state` accepts."""
        if state == DEAD:
            return np.zeros(0, dtype=np.int64)
        ids, ends = self._ends(state)
        if closing:
            ids = ids[self.distances[ends] < self.distances[state]]
        if self.dfa.accepting[state] and self.eos_token_id is not None:
            ids = np.append(ids, self.eos_token_id)
        return np.sort(ids).astype(np.int64)

    def _ends(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """The tokens allowed in `state` (EOS aside) and the state each ends in."""
        dead, vocab = self.dfa.num_states, self.vocab
        rows = np.arange(len(vocab.candidates))                       # the surviving tokens (rows of vocab.table)
        states = np.full(len(rows), state, dtype=np.int64)
        found, reached = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for j in range(vocab.table.shape[1]):
            states = self._table[states, vocab.table[rows, j]]        # one byte further, all at once
            alive = states != dead
            rows, states = rows[alive], states[alive]
            ends = vocab.lengths[rows] == j + 1                       # tokens complete here, still alive: allowed
            found.append(vocab.candidates[rows[ends]])
            reached.append(states[ends])
            rows, states = rows[~ends], states[~ends]
            if not len(rows):
                break
        return np.concatenate(found), np.concatenate(reached)

    def within(self, state: int, left: int) -> np.ndarray | None:
        """The sorted ids allowed in `state` after which the text can still be completed, EOS included, within
        `left` tokens counting this one: a token is kept if the state it ends in is at most left - 2 bytes from a
        match (a byte-level vocabulary spells any such rest in as many tokens, then EOS). None when no allowed
        token can break that (left is far from the end), so the plain mask applies."""
        if left - 2 >= self.distances[state] + self.vocab.table.shape[1]:
            return None                         # no token moves the end further than its own length
        key = (state, left)
        kept = self._within.get(key)
        if kept is None:
            ids, ends = self._ends(state)
            kept = ids[self.distances[ends] <= left - 2]
            if self.dfa.accepting[state] and self.eos_token_id is not None:
                kept = np.append(kept, self.eos_token_id)
            kept = self._within[key] = np.sort(kept).astype(np.int64)
        return kept

    @property
    def distances(self) -> np.ndarray:
        """Per state, the fewest bytes that complete the text (0 in an accepting state): a breadth-first search
        from the accepting states along the transitions read backwards. Computed once per index."""
        if self._distances is None:
            n = self.dfa.num_states
            sources = np.repeat(np.arange(n), 256)
            targets = self._table[:n].reshape(-1)
            live = targets != n
            sources, targets = sources[live], targets[live]
            order = np.argsort(targets, kind="stable")
            sources, starts = sources[order], np.searchsorted(targets[order], np.arange(n + 1))
            distances = np.full(n + 1, np.iinfo(np.int64).max, dtype=np.int64)   # row n: the dead state
            frontier = np.flatnonzero(np.array(self.dfa.accepting, dtype=bool))
            distances[frontier] = 0
            level = 0
            while len(frontier):
                level += 1
                before = np.unique(np.concatenate([sources[starts[t]:starts[t + 1]] for t in frontier]))
                frontier = before[distances[before] > level]
                distances[frontier] = level
            self._distances = distances
        return self._distances

    def closing_tokens(self, state: int) -> np.ndarray:
        """The sorted ids allowed in `state` that shorten the way to an accepting state by at least one byte (EOS
        where `state` accepts): following only these, the text is complete within `distances[state]` tokens."""
        closing = self._closing.get(state)
        if closing is None:
            closing = self._closing[state] = self._walk(state, closing=True)
        return closing

    def mask(self, state: int, left: int | None = None) -> torch.Tensor:
        """A bool tensor over the vocabulary, True where the token is allowed in `state`; with `left` (the tokens
        left, this one included) only where the text can still be completed in time (`within`), or, where
        nothing can, where it comes nearer to completion (`closing_tokens`)."""
        ids = None if left is None else self.within(state, left)
        if ids is not None and not len(ids):                     # too late to finish: come as near as possible
            ids, left = self.closing_tokens(state), -1
            if not len(ids):                                     # (a vocabulary without a token for each byte)
                ids, left = None, None
        key = (state, None if ids is None else left)
        mask = self._masks.get(key)
        if mask is None:
            mask = torch.zeros(len(self.vocab), dtype=torch.bool)
            mask[torch.from_numpy(self.allowed_tokens(state) if ids is None else ids)] = True
            self._masks[key] = mask
        return mask

    def next_state(self, state: int, token_id: int) -> int:
        """The state after `token_id` (DEAD if it leaves the language; EOS and special tokens lead nowhere)."""
        data = self.vocab.token_bytes[token_id] if 0 <= token_id < len(self.vocab) else None
        if not data or token_id == self.eos_token_id:
            return DEAD
        return self.dfa.walk(data, state)

    def compile_all(self) -> "TokenIndex":
        """Compute every state's allowed set now (otherwise each is computed when first visited)."""
        for state in range(self.dfa.num_states):
            self.allowed_tokens(state)
        return self


_INDEXES: "OrderedDict[tuple, TokenIndex]" = OrderedDict()
_INDEXES_LOCK = threading.Lock()
CACHE_SIZE = 64


def compile_index(pattern: str, vocab: Vocabulary, max_states: int = MAX_STATES) -> TokenIndex:
    """The TokenIndex of `pattern` over `vocab`, from a cache keyed by pattern, vocabulary and limit (the last
    CACHE_SIZE used are kept)."""
    key = (pattern, vocab.fingerprint, max_states)
    with _INDEXES_LOCK:
        index = _INDEXES.get(key)
    if index is None:                                       # compiled outside the lock: others' lookups go on
        index = TokenIndex(compile_regex(pattern, max_states), vocab)
    with _INDEXES_LOCK:                                     # the server compiles on worker threads
        index = _INDEXES.setdefault(key, index)             # a twin compiled meanwhile wins: one index per key
        _INDEXES.move_to_end(key)
        if len(_INDEXES) > CACHE_SIZE:
            _INDEXES.popitem(last=False)
    return index
