"""A regular expression compiled to a deterministic finite automaton over UTF-8 bytes. Chapter 13.

Three steps, each small enough to read in one sitting:

1. `parse` turns the pattern into a tree: literals and character classes become `Chars` (sorted code-point ranges),
   and `Concat`, `Alt` and `Repeat` combine them. The subset is what JSON-schema patterns and everyday regexes use:
   literals, escapes (``\\n``, ``\\t``, ``\\.``, ``\\uXXXX`` ...), classes ``[a-z]`` and ``[^...]``, ``\\d \\w \\s``
   (ASCII, as in JSON Schema) and their negations, ``.`` (any character but a newline), groups ``(...)`` and
   ``(?:...)``, alternation ``|`` and the quantifiers ``? * + {m} {m,} {m,n}`` (a lazy ``?`` after one changes which
   match a search prefers, not the language, so it is accepted and ignored). A leading ``^`` and trailing ``$`` are
   accepted: the automaton always matches the whole text. Anything else (backreferences, look-arounds, flags) is a
   ValueError naming it.
2. `Thompson NFA`: each tree node becomes a fragment with one entry and one exit, glued by epsilon moves. The NFA
   reads *bytes*, not characters: a character range becomes the byte sequences of its UTF-8 encodings
   (`utf8_sequences`), so 'é' is the two steps 0xC3 0xA9. A language model's tokens are byte strings, and a token
   may hold half a character; an automaton over bytes walks such a token as far as it goes, exactly as
   outlines-core does.
3. `subset construction`: a DFA state is the set of NFA states the bytes so far can reach. Bytes that no edge tells
   apart share a class (`byte_classes`), so each DFA state is expanded once per class, not 256 times. States from
   which no accepting state can be reached are folded into the dead state, so "not dead" means "can still finish".
   Construction stops with a ValueError naming the pattern and the limit as soon as the DFA passes `max_states`.
   Last, states that no continuation tells apart are merged (`_minimize`), so the DFA is the smallest one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Chars", "Concat", "Alt", "Repeat", "parse", "utf8_sequences", "DFA", "compile_regex", "DEAD",
           "MAX_STATES", "MAX_CODEPOINT"]

MAX_CODEPOINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)          # not characters: UTF-8 cannot encode them
MAX_STATES = 100_000                   # the default limit on a pattern's DFA
DEAD = -1                              # the DFA's dead state: no continuation can match any more


# ---------------------------------------------------------------------------------------------------------------
# 1. The pattern as a tree
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Chars:
    """One character out of a set, kept as sorted, disjoint, non-adjacent inclusive code-point ranges."""
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Concat:
    parts: tuple


@dataclass(frozen=True)
class Alt:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    node: object
    min: int
    max: int | None                    # None: unbounded


def _normalize(ranges) -> tuple[tuple[int, int], ...]:
    merged = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _negate(ranges) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for lo, hi in _normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODEPOINT:
        out.append((start, MAX_CODEPOINT))
    return _normalize(out)


DIGIT = ((ord("0"), ord("9")),)
WORD = _normalize([(ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("_"), ord("_")), (ord("a"), ord("z"))])
SPACE = _normalize([(ord(c), ord(c)) for c in " \t\n\r\f\v"])
CLASS_ESCAPES = {"d": DIGIT, "w": WORD, "s": SPACE,
                 "D": _negate(DIGIT), "W": _negate(WORD), "S": _negate(SPACE)}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
ANY_BUT_NEWLINE = _negate([(10, 10)])


class _Parser:
    """Recursive descent: alternation ⊃ concatenation ⊃ quantified atom."""

    def __init__(self, pattern: str):
        self.pattern, self.pos = pattern, 0

    def error(self, what: str) -> ValueError:
        return ValueError(f"regex {self.pattern!r}: {what} at position {self.pos}; supported are literals, escapes, "
                          "classes [...] [^...], \\d \\w \\s, '.', groups (...) (?:...), '|', ? * + {m,n}")

    def peek(self) -> str | None:
        return self.pattern[self.pos] if self.pos < len(self.pattern) else None

    def take(self) -> str:
        if self.pos >= len(self.pattern):
            raise self.error("the pattern ends too early")
        self.pos += 1
        return self.pattern[self.pos - 1]

    def parse(self):
        node = self.alternation()
        if self.pos != len(self.pattern):
            raise self.error(f"unexpected {self.peek()!r}")
        return node

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def concatenation(self):
        parts = []
        while self.peek() not in (None, "|", ")"):
            if self.peek() == "^" and self.pos == 0:
                self.pos += 1
                continue
            if self.peek() == "$" and self.pos == len(self.pattern) - 1:
                self.pos += 1
                continue
            parts.append(self.quantified())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def quantified(self):
        node = self.atom()
        while self.peek() in ("?", "*", "+", "{"):
            char = self.take()
            if char == "?":
                low, high = 0, 1
            elif char == "*":
                low, high = 0, None
            elif char == "+":
                low, high = 1, None
            else:
                low, high = self.counts()
            node = Repeat(node, low, high)
            if self.peek() == "?":        # lazy: the same language
                self.pos += 1
        return node

    def counts(self) -> tuple[int, int | None]:
        end = self.pattern.find("}", self.pos)
        if end < 0:
            raise self.error("'{' without its '}'")
        text, self.pos = self.pattern[self.pos:end], end + 1
        low, comma, high = text.partition(",")
        try:
            low_n = int(low)
            high_n = (None if high.strip() == "" else int(high)) if comma else low_n
        except ValueError:
            raise self.error(f"the repetition {{{text}}} is not {{m}}, {{m,}} or {{m,n}}") from None
        if low_n < 0 or (high_n is not None and high_n < low_n):
            raise self.error(f"the repetition {{{text}}} needs 0 <= m <= n")
        return low_n, high_n

    def atom(self):
        char = self.take()
        if char == "(":
            if self.peek() == "?":
                if self.pattern.startswith("?:", self.pos):
                    self.pos += 2
                else:
                    raise self.error("look-arounds, named groups and inline flags '(?...' are not supported")
            node = self.alternation()
            if self.peek() != ")":
                raise self.error("a group is not closed")
            self.pos += 1
            return node
        if char == "[":
            return Chars(self.char_class())
        if char == ".":
            return Chars(ANY_BUT_NEWLINE)
        if char == "\\":
            ranges = self.escape()
            return Chars(ranges)
        if char in ")*+?{|" or char in "^$":
            self.pos -= 1
            raise self.error(f"{char!r} has nothing to act on here (escape it as '\\{char}')")
        return Chars(((ord(char), ord(char)),))

    def escape(self) -> tuple[tuple[int, int], ...]:
        """The ranges of an escape after its backslash: a class (\\d ...) or one character."""
        char = self.take()
        if char in CLASS_ESCAPES:
            return CLASS_ESCAPES[char]
        if char in CHAR_ESCAPES:
            code = ord(CHAR_ESCAPES[char])
        elif char in "xu":
            digits = 2 if char == "x" else 4
            text = self.pattern[self.pos:self.pos + digits]
            if len(text) != digits or any(c not in "0123456789abcdefABCDEF" for c in text):
                raise self.error(f"\\{char} needs {digits} hex digits")
            self.pos += digits
            code = int(text, 16)
        elif char.isalnum():
            raise self.error(f"the escape \\{char} (backreference, anchor or unknown class) is not supported")
        else:
            code = ord(char)             # \. \\ \" \/ \[ ...: the character itself
        return ((code, code),)

    def char_class(self) -> tuple[tuple[int, int], ...]:
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges, first = [], True
        while True:
            char = self.take()
            if char == "]" and not first:
                break
            first = False
            if char == "\\":
                item = self.escape()
            elif char == "[" and self.peek() == ":":
                raise self.error("POSIX classes [:alpha:] are not supported")
            else:
                item = ((ord(char), ord(char)),)
            if self.peek() == "-" and self.pattern[self.pos + 1:self.pos + 2] not in ("]", ""):
                if len(item) != 1 or item[0][0] != item[0][1]:
                    raise self.error("a range cannot start at a class like \\d")
                self.pos += 1
                end = self.take()
                end_ranges = self.escape() if end == "\\" else ((ord(end), ord(end)),)
                if len(end_ranges) != 1 or end_ranges[0][0] != end_ranges[0][1] or end_ranges[0][0] < item[0][0]:
                    raise self.error(f"the class range {chr(item[0][0])!r}-{end!r} is reversed or not a range")
                item = ((item[0][0], end_ranges[0][0]),)
            ranges.extend(item)
        return _negate(ranges) if negated else _normalize(ranges)


def parse(pattern: str):
    """The tree of `pattern`: Chars, Concat, Alt and Repeat nodes. ValueError names what is unsupported."""
    if not isinstance(pattern, str):
        raise ValueError(f"a regex is a string, got {type(pattern).__name__}")
    return _Parser(pattern).parse()


# ---------------------------------------------------------------------------------------------------------------
# 2. Characters to UTF-8 byte sequences, and the Thompson NFA over bytes
# ---------------------------------------------------------------------------------------------------------------

def utf8_sequences(lo: int, hi: int):
    """Yield lists of byte ranges [(b1_lo, b1_hi), (b2_lo, b2_hi), ...] whose concatenations are exactly the UTF-8
    encodings of the code points lo..hi (surrogates skipped). The range is split until, in each piece, every byte
    position varies independently: first at the encoding-length boundaries (1, 2, 3, 4 bytes), then wherever a
    piece does not cover whole blocks of continuation bytes."""
    stack = [(lo, hi)]
    while stack:
        lo, hi = stack.pop()
        if lo > hi:
            continue
        if lo <= SURROGATES[1] and hi >= SURROGATES[0]:
            stack += [(SURROGATES[1] + 1, hi), (lo, SURROGATES[0] - 1)]
            continue
        split = next((m for m in (0x7F, 0x7FF, 0xFFFF) if lo <= m < hi), None)
        if split is not None:
            stack += [(split + 1, hi), (lo, split)]
            continue
        if hi <= 0x7F:
            yield [(lo, hi)]
            continue
        for i in range(1, 4):
            mask = (1 << (6 * i)) - 1                 # the low 6*i bits: the last i continuation bytes
            if lo & ~mask != hi & ~mask:
                if lo & mask:
                    stack += [((lo | mask) + 1, hi), (lo, lo | mask)]
                    break
                if hi & mask != mask:
                    stack += [(hi & ~mask, hi), (lo, (hi & ~mask) - 1)]
                    break
        else:
            yield list(zip(chr(lo).encode("utf-8"), chr(hi).encode("utf-8")))


class _NFA:
    """States are numbers; `edges[s]` are (byte_lo, byte_hi, target) moves, `eps[s]` the epsilon moves."""

    def __init__(self, pattern: str, max_states: int):
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []
        self.pattern, self.limit = pattern, 16 * max_states

    def new(self) -> int:
        if len(self.edges) >= self.limit:
            raise ValueError(f"regex {self.pattern[:200]!r} needs more than {self.limit} NFA states (16 x the "
                             f"automaton limit of {self.limit // 16}); shorten its repetitions {{m,n}} or raise "
                             "max_states")
        self.edges.append([])
        self.eps.append([])
        return len(self.edges) - 1

    def build(self, node) -> tuple[int, int]:
        """A fragment for `node`: its entry and exit states."""
        start, end = self.new(), self.new()
        if isinstance(node, Chars):
            for lo, hi in node.ranges:
                for seq in utf8_sequences(lo, hi):
                    state = start
                    for k, (b_lo, b_hi) in enumerate(seq):
                        target = end if k == len(seq) - 1 else self.new()
                        self.edges[state].append((b_lo, b_hi, target))
                        state = target
        elif isinstance(node, Concat):
            state = start
            for part in node.parts:
                first, last = self.build(part)
                self.eps[state].append(first)
                state = last
            self.eps[state].append(end)
        elif isinstance(node, Alt):
            for option in node.options:
                first, last = self.build(option)
                self.eps[start].append(first)
                self.eps[last].append(end)
        elif isinstance(node, Repeat):
            state = start
            for _ in range(node.min):                 # the required copies, one after another
                first, last = self.build(node.node)
                self.eps[state].append(first)
                state = last
            if node.max is None:                      # then a loop: skip it, or go round any number of times
                first, last = self.build(node.node)
                self.eps[state] += [first, end]
                self.eps[last] += [first, end]
            else:                                     # or up to max - min optional copies, each may end the run
                for _ in range(node.max - node.min):
                    first, last = self.build(node.node)
                    self.eps[state] += [first, end]
                    state = last
            self.eps[state].append(end)
        else:
            raise TypeError(f"not a regex node: {node!r}")
        return start, end

    def closure(self, states) -> frozenset[int]:
        """Every state reachable from `states` by epsilon moves alone."""
        seen, stack = set(states), list(states)
        while stack:
            for target in self.eps[stack.pop()]:
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        return frozenset(seen)


# ---------------------------------------------------------------------------------------------------------------
# 3. Subset construction
# ---------------------------------------------------------------------------------------------------------------

class DFA:
    """A deterministic automaton over bytes: `next(state, byte)` is a state or DEAD; state 0 is the start.

    `transitions[s]` is a list of 256 next states, `accepting[s]` whether the bytes read so far are in the language.
    Every state but DEAD can still reach an accepting state."""

    def __init__(self, pattern: str, transitions: list[list[int]], accepting: list[bool]):
        self.pattern = pattern
        self.transitions = transitions
        self.accepting = accepting
        self.initial = 0

    @property
    def num_states(self) -> int:
        return len(self.transitions)

    def next(self, state: int, byte: int) -> int:
        return DEAD if state == DEAD else self.transitions[state][byte]

    def walk(self, data: bytes, state: int | None = None) -> int:
        """The state after reading `data` from `state` (the start by default); DEAD once it cannot match."""
        state = self.initial if state is None else state
        for byte in data:
            if state == DEAD:
                break
            state = self.transitions[state][byte]
        return state

    def matches(self, text: str | bytes) -> bool:
        """Whether the whole text is in the language."""
        state = self.walk(text.encode("utf-8") if isinstance(text, str) else text)
        return state != DEAD and self.accepting[state]

    def __repr__(self) -> str:
        return f"DFA({self.pattern[:60]!r}, {self.num_states} states)"


def byte_classes(nfa: _NFA) -> list[int]:
    """class_of[byte]: bytes that fall on the same side of every edge's range share a class."""
    cuts = {0, 256}
    for edges in nfa.edges:
        for lo, hi, _ in edges:
            cuts.update((lo, hi + 1))
    class_of, bounds = [0] * 256, sorted(cuts)
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        class_of[lo:hi] = [k] * (hi - lo)
    return class_of


def compile_regex(pattern: str, max_states: int = MAX_STATES) -> DFA:
    """The DFA over UTF-8 bytes that accepts exactly the texts `pattern` matches whole. ValueError names the pattern
    and the limit once the automaton would pass `max_states` states (before building further)."""
    if isinstance(max_states, bool) or not isinstance(max_states, int) or max_states < 1:
        raise ValueError(f"max_states={max_states!r}: give a positive whole number of states, e.g. {MAX_STATES}")
    nfa = _NFA(pattern, max_states)
    start, final = nfa.build(parse(pattern))
    class_of = byte_classes(nfa)
    members = [[] for _ in range(max(class_of) + 1)]         # the bytes of each class
    for byte, k in enumerate(class_of):
        members[k].append(byte)
    moves = [{} for _ in nfa.edges]                           # moves[s][k]: where NFA state s goes on class k
    for s, edges in enumerate(nfa.edges):
        for lo, hi, target in edges:
            for k in range(class_of[lo], class_of[hi] + 1):
                moves[s].setdefault(k, []).append(target)

    first = nfa.closure([start])
    index = {first: 0}
    sets, rows = [first], []
    while len(rows) < len(sets):
        by_class: dict[int, list[int]] = {}
        for s in sets[len(rows)]:
            for k, targets in moves[s].items():
                by_class.setdefault(k, []).extend(targets)
        row = [DEAD] * 256
        for k, targets in by_class.items():
            target = nfa.closure(targets)
            if target not in index:
                if len(sets) >= max_states:
                    raise ValueError(f"regex {pattern[:200]!r} needs more than max_states={max_states} automaton "
                                     "states; simplify it (smaller {m,n} bounds, fewer nested optional parts) or "
                                     "raise the limit")
                index[target] = len(sets)
                sets.append(target)
            for b in members[k]:
                row[b] = index[target]
        rows.append(row)
    accepting = [final in s for s in sets]
    return DFA(pattern, *_minimize(*_prune(rows, accepting)))


def _prune(rows: list[list[int]], accepting: list[bool]) -> tuple[list[list[int]], list[bool]]:
    """Fold the states that cannot reach an accepting state into DEAD, keeping the start as state 0."""
    incoming = [set() for _ in rows]
    for s, row in enumerate(rows):
        for t in row:
            if t != DEAD:
                incoming[t].add(s)
    live = {s for s, ok in enumerate(accepting) if ok}
    stack = list(live)
    while stack:
        for s in incoming[stack.pop()]:
            if s not in live:
                live.add(s)
                stack.append(s)
    if 0 not in live:                                   # an empty language: a start state with no way forward
        return [[DEAD] * 256], [False]
    order = sorted(live)
    renumber = {old: new for new, old in enumerate(order)}
    new_rows = [[renumber.get(t, DEAD) for t in rows[s]] for s in order]
    return new_rows, [accepting[s] for s in order]


def _minimize(rows: list[list[int]], accepting: list[bool]) -> tuple[list[list[int]], list[bool]]:
    """Merge the states no continuation tells apart (Moore's partition refinement): start from two blocks,
    accepting and not, and split a block while its states move to different blocks on some byte. Subset
    construction leaves such twins, e.g. one state after each UTF-8 sequence of a class that ends at the same
    place; merging them makes fewer states to compute token sets for."""
    n = len(rows)
    table = np.array(rows, dtype=np.int64).reshape(n, 256)
    table[table == DEAD] = n                            # DEAD as an extra state n, alone in its own block
    block = np.array([int(ok) for ok in accepting] + [-1])
    count = len(set(block[:n].tolist()))
    while True:
        signatures = np.concatenate([block[:n, None], block[table]], axis=1)      # (n, 1 + 256)
        numbers: dict[bytes, int] = {}
        new_block = [numbers.setdefault(row.tobytes(), len(numbers)) for row in signatures]
        new_count = len(numbers)
        block = np.array(new_block + [-1])
        if new_count == count:
            break
        count = new_count
    _, first = np.unique(block[:n], return_index=True)  # number the blocks in order of first state: start stays 0
    order = np.empty(count, dtype=np.int64)
    order[block[np.sort(first)]] = np.arange(count)
    keep = np.sort(first)
    new_table = np.where(table[keep] == n, DEAD, order[block[np.minimum(table[keep], n)]])
    new_table[table[keep] == n] = DEAD
    return new_table.tolist(), [accepting[s] for s in keep.tolist()]
