"""The regex → byte DFA compiler (llminfer.structured.regex) against Python's `re` on random texts, UTF-8 byte
sequences against Python's encoder, and its errors: unsupported syntax and the state limit, raised before the
automaton grows past it."""
from __future__ import annotations

import random
import re

import pytest

from llminfer.structured.regex import DEAD, compile_regex, parse, utf8_sequences

pytestmark = pytest.mark.timeout(120)

PATTERNS = [
    r"a|ab", r"(ab|a)(b|)+", r"[a-c]{2,3}x?", r"(a|b)*é{1,2}", r"[^ab]+", r"[a-é]*", "[\u00e0-\u4e2d]+😀?",
    r".{0,3}", r".*", r"\d+(\.\d+)?", r"[\w-]+", r"\s?\S{1,2}", r"(?:ab){2,}", r"x{3}", r"[\-a]b\.", r"\u00e9|\x41",
    r"^a*b$", r"[^\n]", r"(a|)*?b+?",
]
ALPHABET = ["a", "b", "c", "x", "é", "中", "😀", "\n", " ", "-", ".", "1", "A", "_"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_dfa_matches_like_python_re(pattern):
    dfa = compile_regex(pattern)
    reference = re.compile(pattern, re.ASCII)
    rng = random.Random(0)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))) for _ in range(3000)]
    texts += ["a", "ab", "abb", "ab.", "éé", "abab", "b", ""]
    for text in texts:
        assert dfa.matches(text) == bool(reference.fullmatch(text)), (pattern, text)


def test_every_live_state_can_still_accept():
    dfa = compile_regex(r"(ab|cd)*e[^x]")
    for state in range(dfa.num_states):            # from every state some bytes reach acceptance
        seen, frontier = {state}, [state]
        while frontier and not any(dfa.accepting[s] for s in frontier):
            frontier = [t for s in frontier for t in dfa.transitions[s] if t != DEAD and t not in seen]
            seen.update(frontier)
        assert any(dfa.accepting[s] for s in seen)


def test_minimal_number_of_states():
    assert compile_regex("[a-z]+").num_states == 2
    assert compile_regex("(a|b)(a|b)").num_states == 3
    # '.': start, end, 1, 2 or 3 continuation bytes to go, and the 4 restricted second bytes of UTF-8
    # (after E0: A0-BF, after ED: 80-9F (no surrogates), after F0: 90-BF, after F4: 80-8F)
    assert compile_regex(".").num_states == 9


@pytest.mark.parametrize("lo,hi", [(0, 0x10FFFF), (0x41, 0x7A), (0x7F, 0x800), (0xD000, 0xE100), (0xFFF0, 0x10010),
                                   (0x4E2D, 0x4E2D), (0x80, 0x7FF)])
def test_utf8_sequences_cover_exactly_the_range(lo, hi):
    sequences = list(utf8_sequences(lo, hi))
    rng = random.Random(lo)
    codes = {lo, hi, *(rng.randint(lo, hi) for _ in range(2000))} - set(range(0xD800, 0xE000))
    for code in codes:
        data = chr(code).encode("utf-8")
        hits = [s for s in sequences if len(s) == len(data) and all(a <= b <= c for (a, c), b in zip(s, data))]
        assert len(hits) == 1, (hex(code), hits)
    for seq in sequences:                                # and nothing outside: each sequence's ends decode inside
        for pick in (0, 1):
            text = bytes(r[pick] for r in seq).decode("utf-8")
            assert lo <= ord(text) <= hi


@pytest.mark.parametrize("pattern,word", [
    (r"(a", "not closed"), (r"a)", "unexpected"), (r"*a", "nothing to act on"), (r"\1", r"\1"),
    (r"(?=a)", "look-arounds"), (r"a{3,1}", "m <= n"), (r"[z-a]", "reversed"), (r"a{x}", "{x}"),
    (r"\b", r"\b"), (r"a^", "'^'"),
])
def test_unsupported_syntax_is_named(pattern, word):
    with pytest.raises(ValueError, match=re.escape(word)):
        parse(pattern)


def test_state_limit_names_pattern_and_limit():
    with pytest.raises(ValueError, match=r"\[a-z\]\{200\}.*max_states=100"):
        compile_regex("[a-z]{200}", max_states=100)
    assert compile_regex("[a-z]{200}", max_states=1000).num_states == 201
    with pytest.raises(ValueError, match="1600 NFA states"):            # a huge NFA is stopped while it is built
        compile_regex("(abcdefgh){100000}", max_states=100)
    with pytest.raises(ValueError, match="max_states=0"):
        compile_regex("a", max_states=0)


def test_threads_compiling_one_pattern_share_one_index():
    import threading

    from llminfer.structured.index import Vocabulary, compile_index

    vocab = Vocabulary([bytes([b]) for b in range(256)] + [b"ab", b"abc"], eos_token_id=None)
    pattern = "(ab|c)+[0-9]{2,40}"                   # a few hundred states: the compiles overlap in time
    start, found = threading.Barrier(8), []

    def compile_it():
        start.wait()
        found.append(compile_index(pattern, vocab))

    threads = [threading.Thread(target=compile_it) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(found) == 8 and len({id(index) for index in found}) == 1
