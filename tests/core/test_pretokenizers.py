"""GGUF pre-tokenizers (tokenizer.ggml.pre): a file with each value splits text as transformers' GGUF loader splits
the same file, on a vocabulary whose merges cross every boundary so that each split shows in the ids; SmolLM's
split is checked against its own tokenizer.json pipeline; an unknown value is refused and named."""
from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers, trainers

from llminfer import checkpoint, gguf_reader

transformers = pytest.importorskip("transformers")

CORPUS = [
    "12345 678", "3.14159 -42 1e-5 2026-12-07 1,000,000 x2y 007",
    "I'm, you'll, DON'T", "we'd THEY'RE it's O'Neil's 'quoted' 'tis the 'season, don'tcha know",
    "   three spaces,\t\ttabs\n\n\n  and   runs  ", "line one\r\nline two\r\n \n",
    "日本語のテキスト, 中文 and 한국어", "emoji 🤖🚀👍🏽 ✓ ✗", "naïve café, e\u0301 combining, Ελληνικά",
    "def f(x):\n    return x ** 2  # HTTPServer camelCase\n\tif a/b: pass", "{\"json\": [1, 2, {\"a\": null}]}",
    "<|endoftext|> spelled in the text", "",
]
# Trained with no split at all, so merges join digits, spaces, letters and symbols across any pattern's boundaries:
# a piece cut at another place gets other merges, and so other ids.
TRAINING = CORPUS * 2 + ["The 1234567 numbers, I'LL say: you'RE HTTPRequest.get(url) // comment\n\n  done"]


@pytest.fixture(scope="module")
def vocabulary():
    """(tokens, merges) of a byte-level BPE trained on TRAINING without pre-tokenization; token 0 is a control."""
    trained = Backend(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trained.train_from_iterator(TRAINING, trainers.BpeTrainer(
        vocab_size=900, min_frequency=1, show_progress=False, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(trained.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    assert len(merges) > 200
    return tokens, merges


def write_tokenizer(path, tokens, merges, pre):
    """A GGUF file holding only a byte-level BPE tokenizer with tokenizer.ggml.pre = pre (None: no such key)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def encode_both(vocabulary, tmp_path_factory):
    """pre -> (ours, transformers'): the ids of every CORPUS text, the file read by llminfer and by transformers."""
    folder = tmp_path_factory.mktemp("pre")

    def encode(pre):
        name = f"{pre or 'missing'}.gguf"
        path = write_tokenizer(folder / name, *vocabulary, pre)
        ours = checkpoint.load_tokenizer(path)
        theirs = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=name)
        return ([ours.encode(text, allow_special=True) for text in CORPUS],
                [theirs(text, add_special_tokens=False)["input_ids"] for text in CORPUS])
    return encode


def transformers_pre_tokenizers() -> list[str]:
    """The tokenizer.ggml.pre values transformers' GGUF loader gives a split of their own."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    return sorted(GGUF_PRE_TOKENIZER_SPLITS)


def test_every_pre_transformers_maps_is_known():
    names = transformers_pre_tokenizers()
    assert {"llama-bpe", "llama3", "qwen2", "qwen35", "tekken", "gpt-4o"} <= set(names)
    assert set(names) <= set(gguf_reader.PRE_TOKENIZERS)


@pytest.mark.parametrize("pre", transformers_pre_tokenizers() + ["gpt-2", "default", None])
def test_a_file_splits_text_as_transformers_gguf_loader_does(encode_both, pre):
    ours, theirs = encode_both(pre)
    for text, mine, reference in zip(CORPUS, ours, theirs):
        assert mine == reference, (pre, text)


def test_the_vocabulary_tells_the_splits_apart(encode_both):
    """The comparisons above can fail: on this vocabulary each split gives other ids for digits and contractions."""
    families = ("gpt-2", "smollm", "llama-bpe", "qwen2", "qwen35", "tekken", "gpt-4o")
    ids = {pre: encode_both(pre)[0] for pre in families}
    assert len({tuple(map(tuple, ids[pre])) for pre in families}) == len(families)
    digits, contractions = CORPUS.index("12345 678"), CORPUS.index("I'm, you'll, DON'T")
    assert ids["gpt-2"][digits] != ids["llama-bpe"][digits] != ids["qwen2"][digits]
    assert ids["gpt-2"][contractions] != ids["llama-bpe"][contractions]


@pytest.mark.parametrize("pre,text,pieces", [
    ("gpt-2", "12345 678", ["12345", "Ġ678"]),                          # numbers whole, the space joins the next
    ("llama-bpe", "12345 678", ["123", "45", "Ġ", "678"]),               # runs of up to three digits
    ("qwen2", "12345 678", ["1", "2", "3", "4", "5", "Ġ", "6", "7", "8"]),
    ("smollm", "12345 678", ["1", "2", "3", "4", "5", "Ġ", "6", "7", "8"]),
    ("gpt-2", "I'm, DON'T", ["I", "'m", ",", "ĠDON", "'", "T"]),        # contractions in lower case only
    ("llama-bpe", "I'm, DON'T", ["I", "'m", ",", "ĠDON", "'T"]),         # ... in any case
    ("gpt-4o", "I'm, DON'T", ["I'm", ",", "ĠDON'T"]),                    # ... kept with their word
    ("tekken", "HTTPServer camelCase", ["HTTPServer", "Ġcamel", "Case"]),
    ("gpt-2", "a  \n\nb", ["a", "ĠĠĊ", "Ċ", "b"]),                    # a blank run leaves its last to the word
    ("llama-bpe", "a  \n\nb", ["a", "ĠĠĊĊ", "b"]),                        # line breaks take the blanks before them
])
def test_pieces_follow_each_pattern(vocabulary, tmp_path, pre, text, pieces):
    tokenizer = checkpoint.load_tokenizer(write_tokenizer(tmp_path / "t.gguf", *vocabulary, pre))
    assert [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)] == pieces
    assert tokenizer.pre_tokenizer_type == pre


def test_smollm_splits_as_its_own_tokenizer_json(vocabulary, tmp_path):
    """transformers' GGUF loader has no rule for 'smollm' and falls back to GPT-2's split; llama.cpp, and SmolLM's
    tokenizer.json (digits one by one, then byte-level GPT-2), split digits apart. On SmolLM's own vocabulary, which
    has no merge across digits, the two agree (tests/core/test_gguf.py); on this one they do not."""
    tokens, merges = vocabulary
    ours = checkpoint.load_tokenizer(write_tokenizer(tmp_path / "s.gguf", tokens, merges, "smollm"))
    own = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    own.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    for text in CORPUS:
        if "<|endoftext|>" not in text:
            assert ours.encode(text) == own.encode(text).ids, text
    for name in ("starcoder", "command-r", "refact"):      # llama.cpp splits these the same way
        assert gguf_reader.PRE_TOKENIZERS[name] == gguf_reader.PRE_TOKENIZERS["smollm"]


def test_an_unknown_pre_is_named_with_the_known_ones(vocabulary, tmp_path):
    path = write_tokenizer(tmp_path / "u.gguf", *vocabulary, "no-such-split")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='no-such-split', a pre-tokenizer llminfer does not "
                                         r"know.*known values: .*'?default.*gpt-2.*llama-bpe.*qwen2.*smollm.*"
                                         r"load_tokenizer=False"):
        checkpoint.load_tokenizer(path)
