"""The automaton lifted to a tokenizer: for each DFA state, the tokens that keep the text inside the language.
Chapter 13.

A token is allowed in a state when walking its bytes through the DFA never reaches the dead state (`regex.DEAD`):
the text so far plus the token can still be completed to a match. The end-of-sequence token is allowed exactly in
accepting states. Special tokens (chat markers) are never allowed.

Tokens are byte strings. A byte-level BPE tokenizer (GPT-2's, SmolLM2's) spells each byte as a printable character
('Ġ' is the space 0x20); `Vocabulary.from_tokenizer` maps the spellings back to bytes, so a token holding half of a
UTF-8 character ('é' split as 0xC3 | 0xA9) is walked byte by byte like any other and lands in a mid-character
state. This is how outlines-core treats tokens too, so the two can be compared state by state.

Walking 49,152 tokens one by one from every state would redo the same prefixes again and again (thousands of tokens
start with ' the'). The vocabulary is kept as a trie of its byte strings instead, and the trie is walked together
with the DFA: a branch is cut the moment the DFA dies, so a state that allows a few tokens costs a few steps, and a
permissive state (inside a JSON string) one pass over the trie. Each state's set is computed the first time it is
needed and kept; `TokenIndex.compile_all` computes every state's. Indexes are cached by pattern, vocabulary and
limit (`compile_index`).
"""
from __future__ import annotations

import hashlib
import json
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
    """Each token id's byte string (None for special tokens, which a constraint never allows), the end-of-sequence
    id, and a trie over the byte strings: `children[node]` maps a byte to a child node, `ends[node]` lists the
    token ids whose bytes end there. Node 0 is the root."""

    _cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, token_bytes: list[bytes | None], eos_token_id: int | None):
        self.token_bytes = token_bytes
        self.eos_token_id = eos_token_id
        self.children: list[dict[int, int]] = [{}]
        self.ends: list[list[int]] = [[]]
        for token_id, data in enumerate(token_bytes):
            if not data or token_id == eos_token_id:
                continue
            node = 0
            for byte in data:
                child = self.children[node].get(byte)
                if child is None:
                    child = self.children[node][byte] = len(self.children)
                    self.children.append({})
                    self.ends.append([])
                node = child
            self.ends[node].append(token_id)
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
        self._masks: dict[int, torch.Tensor] = {}

    @property
    def eos_token_id(self) -> int | None:
        return self.vocab.eos_token_id

    def allowed_tokens(self, state: int) -> np.ndarray:
        """The sorted ids allowed in `state` (EOS included when the state accepts)."""
        allowed = self._allowed.get(state)
        if allowed is None:
            allowed = self._allowed[state] = self._walk_trie(state)
        return allowed

    def _walk_trie(self, state: int) -> np.ndarray:
        if state == DEAD:
            return np.zeros(0, dtype=np.int64)
        transitions, children, ends = self.dfa.transitions, self.vocab.children, self.vocab.ends
        found: list[int] = []
        stack = [(0, state)]                    # (trie node, DFA state after that node's bytes)
        while stack:
            node, current = stack.pop()
            row = transitions[current]
            for byte, child in children[node].items():
                target = row[byte]
                if target != DEAD:
                    found.extend(ends[child])
                    stack.append((child, target))
        if self.dfa.accepting[state] and self.eos_token_id is not None:
            found.append(self.eos_token_id)
        return np.array(sorted(found), dtype=np.int64)

    def mask(self, state: int) -> torch.Tensor:
        """A bool tensor over the vocabulary, True where the token is allowed in `state`."""
        mask = self._masks.get(state)
        if mask is None:
            mask = torch.zeros(len(self.vocab), dtype=torch.bool)
            mask[torch.from_numpy(self.allowed_tokens(state))] = True
            self._masks[state] = mask
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
CACHE_SIZE = 64


def compile_index(pattern: str, vocab: Vocabulary, max_states: int = MAX_STATES) -> TokenIndex:
    """The TokenIndex of `pattern` over `vocab`, from a cache keyed by pattern, vocabulary and limit (the last
    CACHE_SIZE used are kept)."""
    key = (pattern, vocab.fingerprint, max_states)
    index = _INDEXES.get(key)
    if index is None:
        index = TokenIndex(compile_regex(pattern, max_states), vocab)
        _INDEXES[key] = index
        if len(_INDEXES) > CACHE_SIZE:
            _INDEXES.popitem(last=False)
    _INDEXES.move_to_end(key)
    return index
