"""The tokenizer: special-token spellings in text stay text unless asked for; decode refuses ids it does not have."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

import llminfer

TOKENIZER_JSON = Path(__file__).resolve().parents[2] / "data" / "models" / "tiny-capitals" / "tokenizer.json"
TEXTS = ["a <eos> b", "<eos>", "The capital of France<eos>", "<bos><pad><eos>", "x<eos>y <bos> z", "<eo", "<<eos>>"]


@pytest.fixture(scope="module")
def tokenizer():
    return llminfer.Tokenizer.from_file(TOKENIZER_JSON)


@pytest.fixture(scope="module")
def reference():
    """transformers' fast tokenizer on the same file; split_special_tokens=True reads special spellings as text."""
    return (PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON), split_special_tokens=True),
            PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER_JSON)))


def test_the_bundled_tokenizer_has_the_special_tokens_the_tests_use(tokenizer):
    assert tokenizer.special_tokens == {"<pad>": 0, "<bos>": 1, "<eos>": 2}
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1 and tokenizer.vocab_size == 1024


def test_special_spelling_in_text_is_plain_text(tokenizer):
    ids = tokenizer.encode("a <eos> b")
    assert tokenizer.eos_token_id not in ids
    assert tokenizer.tokens(ids)[-5:-1] == ["<", "e", "os", ">"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_round_trips(tokenizer, reference, text):
    split, whole = reference
    ids = tokenizer.encode(text)
    assert not set(ids) & set(tokenizer.special_tokens.values())
    assert ids == split(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    special = tokenizer.encode(text, allow_special=True)
    assert special == whole(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(special, skip_special_tokens=False) == text


def test_allow_special_uses_the_special_id(tokenizer):
    ids = tokenizer.encode("a <eos> b", allow_special=True)
    assert ids.count(tokenizer.eos_token_id) == 1
    assert tokenizer.decode(ids) == "a  b"          # skipped as a special token, as transformers does
    assert tokenizer.encode("<bos>x", add_bos=True)[0] == tokenizer.bos_token_id
    assert tokenizer.encode("<bos>x", add_bos=True).count(tokenizer.bos_token_id) == 1


@pytest.mark.parametrize("bad,message", [
    ([5, -1], r"token id -1 is outside the vocabulary of 1024 ids"),
    ([1024], r"token id 1024 is outside the vocabulary of 1024 ids"),
    ([10**12], r"token id 1000000000000 is outside the vocabulary of 1024 ids"),
    (torch.tensor([3, 2000]), r"token id 2000 is outside the vocabulary of 1024 ids"),
    ([1.5], r"token id 1.5 is not an integer.*1024 ids"),
    ([2.0], r"token id 2.0 is not an integer.*1024 ids"),
    ([True], r"token id True is not an integer.*1024 ids"),
    ([np.True_], r"token id np.True_ is not an integer.*1024 ids"),
    ([None], r"token id None is not an integer.*1024 ids"),
    ([torch.tensor(1.0)], r"token id tensor\(1.\) is not an integer.*1024 ids"),
    (torch.tensor([1.0, 2.0]), r"one sequence of integers 0..1023.*torch.float32"),
    (np.array([True]), r"one sequence of integers 0..1023.*bool"),
    (torch.tensor([[1, 2]]), r"one sequence of integers 0..1023.*shape \(1, 2\)"),
    ("hello", r"got text 'hello'.*tokenizer.encode"),
    (7, r"a sequence of token ids, got 7.*\[id\]"),
])
def test_decode_refuses_ids_outside_the_vocabulary(tokenizer, bad, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.decode(bad)
    with pytest.raises(ValueError, match=message):
        tokenizer.tokens(bad)


def test_decode_takes_lists_tensors_and_arrays_of_ids(tokenizer):
    ids = tokenizer.encode("The capital of France")
    text = tokenizer.decode(ids)
    assert text == "The capital of France"
    assert tokenizer.decode(torch.tensor(ids)) == text
    assert tokenizer.decode(np.array(ids, dtype=np.int32)) == text
    assert tokenizer.decode([np.int64(i) for i in ids]) == text
    assert tokenizer.decode(torch.tensor(ids[0])) == tokenizer.decode(ids[:1])
    assert tokenizer.decode([]) == ""
    assert tokenizer.decode([0, 1023]) == tokenizer.decode([1023])   # both ends of the vocabulary are ids


@pytest.mark.parametrize("field", ["bos_token_id", "eos_token_id"])
@pytest.mark.parametrize("value", [1024, -1, 2.0, True])
def test_special_ids_outside_the_vocabulary_are_refused(field, value):
    backend = llminfer.Tokenizer.from_file(TOKENIZER_JSON).backend
    with pytest.raises(ValueError, match=rf"{field}={value!r} is not an id in this tokenizer's vocabulary of 1024"):
        llminfer.Tokenizer(backend, **{field: value})


def test_a_backend_set_to_split_special_tokens_still_honours_allow_special(tokenizer):
    backend = llminfer.Tokenizer.from_file(TOKENIZER_JSON).backend
    backend.encode_special_tokens = True
    wrapped = llminfer.Tokenizer(backend)
    assert wrapped.encode("a <eos> b") == tokenizer.encode("a <eos> b")
    assert wrapped.encode("a <eos> b", allow_special=True) == tokenizer.encode("a <eos> b", allow_special=True)
