"""The token masks against outlines-core, state by state, on SmolLM2-135M-Instruct's real 49,152-token vocabulary;
and the JSON-schema patterns against jsonschema's verdicts on hand-written documents.

States are matched by walking the same texts through both: cut by the tokenizer, and byte by byte (the vocabulary
holds every single byte as a token, so the byte walk visits every state on the way, mid-character ones included).
At each visited pair the allowed sets are compared.

outlines-core's index differs from the language in one documented way: its regex engine reports a match one byte
late, and a token is dropped when the byte before its last one completed a match and the token ends outside one
(after "ab" in (ab)+, the token "a" is refused, "ab" allowed). `outlines_rule` is that exception; with it applied
to our sets the two must be equal, and every token outlines-core allows we allow too."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from llminfer.checkpoint import load_tokenizer
from llminfer.structured.index import TokenIndex, Vocabulary, compile_index
from llminfer.structured.json_schema import (NUMBER, STRING, UnsupportedSchema, json_object_regex, schema_to_regex)
from llminfer.structured.regex import DEAD

outlines_core = pytest.importorskip("outlines_core")
pytestmark = pytest.mark.timeout(600)

SMOLLM2 = "smollm2-135m-instruct"

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "country": {"type": "object", "properties": {"name": {"type": "string"}, "code": {"type": "string",
                                                                                       "pattern": "^[A-Z]{2}$"}},
                "required": ["name"]},
    "landmarks": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
    "capital": {"type": "boolean"}}, "required": ["city"]}
MIXED = {"type": "object", "properties": {
    "unit": {"enum": ["celsius", "fahrenheit", 3, None]}, "version": {"const": "v1"},
    "reading": {"type": "number"}, "note": {"type": ["string", "null"]},
    "ok": {"anyOf": [{"type": "boolean"}, {"type": "integer"}]}}, "required": ["unit", "version", "reading"]}

# (pattern, texts in its language to walk)
CORPUS = [
    (r"[0-9]{3}-[0-9]{4}", ["555-0199"]),
    (NUMBER, ["-12.5e+3", "0", "31415"]),
    (r"(true|false)", ["true", "false"]),
    (r"[a-z]+@[a-z]+\.(com|org|net)", ["ada@example.org"]),
    (r"\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}", ["(212) 555-0100"]),
    (r"(Paris|London|Berlin|Madrid)", ["Paris", "Madrid"]),
    (r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8})?", ["Rio Branco"]),
    (STRING, ['"Paris, the \\"capital\\" été 中文 😀"']),
    (r"#[0-9a-fA-F]{6}", ["#1f2E3d"]),
    (r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", ["2024-02-29"]),
    (r"a\.b\*c\[d\]\\e", ["a.b*c[d]\\e"]),
    (r"(ab)+", ["ababab"]),
    (r"[àéîõü]+ café|中文{1,2}", ["éàü café", "中文文"]),
    (r".{1,12}", ["Hé llo 😀 wör"]),
    (r"[^\"\n]{2,6}x", ["abcx", "ñ中x"]),
    (schema_to_regex(PERSON), ['{"name": "Ada Lovelace", "age": 36}']),
    (schema_to_regex(CITY), ['{"city": "Paris", "country": {"name": "France", "code": "FR"}, '
                             '"landmarks": ["Louvre", "Eiffel Tower"], "capital": true}', '{"city": "Lyon"}']),
    (schema_to_regex(MIXED), ['{"unit": "celsius", "version": "v1", "reading": -3.25, "note": null, "ok": 7}',
                              '{"unit": 3, "version": "v1", "reading": 1e9}']),
    (json_object_regex(1), ['{"a": 1, "b": "x", "c": true, "d": null}']),
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return Vocabulary.from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def outlines_vocab(vocab):
    tokens: dict[bytes, list[int]] = {}
    for token_id, data in enumerate(vocab.token_bytes):
        if data and token_id != vocab.eos_token_id:
            tokens.setdefault(data, []).append(token_id)
    return outlines_core.Vocabulary(vocab.eos_token_id, tokens)


def outlines_rule(index: TokenIndex, state: int, allowed) -> set[int]:
    """Our allowed set less the tokens outlines-core's delayed match drops (see the module docstring)."""
    dfa, kept = index.dfa, set()
    if all(t == DEAD for s, row in enumerate(dfa.transitions) if dfa.accepting[s] for t in row):
        return set(allowed.tolist())            # nothing follows a match: no token can end after one
    for token_id in allowed.tolist():
        data = index.vocab.token_bytes[token_id]
        if token_id == index.eos_token_id or not (dfa.accepting[dfa.walk(data[:-1], state)]
                                                  and not dfa.accepting[dfa.walk(data, state)]):
            kept.add(token_id)
    return kept


def test_vocabulary_bytes_are_the_tokenizers(tokenizer, vocab):
    assert len(vocab) == 49152 and vocab.eos_token_id == tokenizer.eos_token_id == 2
    assert all(vocab.token_bytes[i] is None for i in tokenizer.special_tokens.values())
    text = "Paris, été 中文 😀 \n\t{\"a\": 1}"
    ids = tokenizer.encode(text)
    assert b"".join(vocab.token_bytes[i] for i in ids) == text.encode("utf-8")
    partial = [i for i, data in enumerate(vocab.token_bytes) if data and not _is_utf8(data)]
    assert len(partial) > 100                     # byte-level BPE: many tokens hold part of a character
    for i in partial[:200]:
        assert tokenizer.backend.decode([i]) == vocab.token_bytes[i].decode("utf-8", "replace")


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_corpus_size():
    assert len(CORPUS) >= 15 and sum(len(texts) for _, texts in CORPUS) >= 20


@pytest.mark.parametrize("pattern,texts", CORPUS, ids=[f"p{i}" for i in range(len(CORPUS))])
def test_allowed_tokens_equal_outlines_core(pattern, texts, tokenizer, vocab, outlines_vocab):
    index = compile_index(pattern, vocab)
    reference = outlines_core.Index(pattern, outlines_vocab)
    byte_token = {data[0]: i for i, data in enumerate(vocab.token_bytes) if data and len(data) == 1}
    ours_of: dict[int, int] = {}                  # their state -> ours: must be a function (ours is minimal)
    kept: dict[int, set[int]] = {}                # our state -> our set under outlines-core's rule
    compared = 0
    for text in texts:
        assert index.dfa.matches(text), text
        data = text.encode("utf-8")
        for walk in (tokenizer.encode(text), [byte_token[b] for b in data]):
            mine, theirs = index.dfa.initial, reference.get_initial_state()
            for token_id in walk + [None]:
                assert ours_of.setdefault(theirs, mine) == mine
                allowed = index.allowed_tokens(mine)
                expected = set(reference.get_allowed_tokens(theirs))
                if mine not in kept:
                    kept[mine] = outlines_rule(index, mine, allowed)
                got = kept[mine]
                assert got == expected, (pattern, text, sorted(got ^ expected)[:10])
                assert expected <= set(allowed.tolist())
                assert (vocab.eos_token_id in expected) == index.dfa.accepting[mine] == reference.is_final_state(theirs)
                compared += 1
                if token_id is None:
                    break
                mine = index.next_state(mine, token_id)
                theirs = reference.get_next_state(theirs, token_id)
                assert mine != DEAD
                if theirs is None:             # outlines-core's delayed-match exception, nothing else
                    assert token_id not in expected and token_id in allowed
                    break
    assert compared >= 2


def test_leftmost_alternative_is_where_outlines_core_differs(vocab, outlines_vocab):
    """'cat|category' as a language holds both words; outlines-core's engine prefers the first alternative and
    stops after 'cat'. Ours continues: the corpus above avoids such patterns."""
    index = compile_index("cat|category", vocab)
    state = index.dfa.walk(b"cat")
    assert index.dfa.accepting[state] and len(index.allowed_tokens(state)) > 1
    reference = outlines_core.Index("cat|category", outlines_vocab)
    theirs = reference.get_initial_state()
    for token_id in (vocab.token_bytes.index(b"c"), vocab.token_bytes.index(b"a"), vocab.token_bytes.index(b"t")):
        theirs = reference.get_next_state(theirs, token_id)
    assert reference.get_allowed_tokens(theirs) == [vocab.eos_token_id]


# jsonschema's verdicts on documents in the canonical layout (", " and ": ")
DOCUMENTS = [
    (PERSON, {"name": "Ada", "age": 36}, True),
    (PERSON, {"name": "Ada"}, False),
    (PERSON, {"name": "Ada", "age": 36.5}, False),
    (PERSON, {"name": "Ada", "age": "36"}, False),
    (PERSON, {"name": "Ada", "age": 36, "x": 1}, False),
    (PERSON, {"age": 36, "name": "Ada"}, True),       # valid, but not in property order: the layout refuses it
    (CITY, {"city": "Paris"}, True),
    (CITY, {"city": "Paris", "capital": False}, True),
    (CITY, {"city": "Paris", "landmarks": []}, False),
    (CITY, {"city": "Paris", "landmarks": ["a", "b", "c", "d"]}, False),
    (CITY, {"city": "Paris", "landmarks": ["a", "b", "c"]}, True),
    (CITY, {"city": "Paris-de-la-ville"}, False),
    (CITY, {"city": "Paris", "country": {"name": "France", "code": "FR"}}, True),
    (CITY, {"city": "Paris", "country": {"name": "France", "code": "Fr"}}, False),
    (CITY, {"city": "Paris", "country": {"code": "FR"}}, False),
    (CITY, {"capital": True}, False),
    (MIXED, {"unit": "kelvin", "version": "v1", "reading": 1}, False),
    (MIXED, {"unit": None, "version": "v1", "reading": 1}, True),
    (MIXED, {"unit": 3, "version": "v2", "reading": 1}, False),
    (MIXED, {"unit": 3, "version": "v1", "reading": 2.5e-3, "note": "hi", "ok": True}, True),
    (MIXED, {"unit": 3, "version": "v1", "reading": 1, "ok": "yes"}, False),
    (MIXED, {"unit": 3, "version": "v1", "reading": 1, "note": 5}, False),
]


@pytest.mark.parametrize("schema,document,valid", DOCUMENTS)
def test_schema_regex_agrees_with_jsonschema(schema, document, valid):
    dfa = compile_index(schema_to_regex(schema), _empty_vocab()).dfa
    assert jsonschema.Draft202012Validator(schema).is_valid(document) == valid
    in_order = list(document) == [k for k in schema["properties"] if k in document]
    assert dfa.matches(json.dumps(document, ensure_ascii=False)) == (valid and in_order)
    if valid and in_order:                                   # other layouts are outside the language
        assert not dfa.matches(json.dumps(document, separators=(",", ":"))) or len(document) == 0


def _empty_vocab():
    return Vocabulary([], None)


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}, "minimum"),
    ({"type": "string", "format": "date-time"}, "format"),
    ({"allOf": [{"type": "string"}]}, "allOf"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, "additionalProperties"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}}},
     "$ref"),
])
def test_unsupported_keyword_is_named(schema, keyword):
    with pytest.raises(UnsupportedSchema, match=re.escape(f"'{keyword}'")) as info:
        schema_to_regex(schema)
    assert info.value.keyword == keyword
