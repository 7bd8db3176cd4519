"""Train the bundled model's byte-level BPE tokenizer on data/corpus/train.txt.

Run `python data/build_tokenizer.py` after data/build_corpus.py; it writes
data/models/tiny-capitals/tokenizer.json. `make model` calls this through
data/build_model.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DATA_DIR = Path(__file__).resolve().parent
MODEL_DIR = DATA_DIR / "models" / "tiny-capitals"
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2
VOCAB_SIZE = 1024

# The source article's prompts and the pieces it shows them split into.
ARTICLE_SPLITS = {
    "The capital of France is": ["The", "capital", "of", "France", "is"],
    "I love AI": ["I", "love", "AI"],
}


def train_tokenizer(sentences: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Return a byte-level BPE tokenizer trained on the sentences (no BOS is added on encode)."""
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: a prompt's first word keeps no leading space ("The", not " The").
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(sentences, trainer=trainer)
    return tokenizer


def readable_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """Return the words each token of text stands for, without the byte-level space marker."""
    ids = tokenizer.encode(text).ids
    return [tokenizer.decode([i]).strip() for i in ids]


def check_tokenizer(tokenizer: Tokenizer, sentences: list[str]) -> None:
    """Raise ValueError unless the article's prompts split as the article shows and text round-trips."""
    for text, expected in ARTICLE_SPLITS.items():
        got = readable_pieces(tokenizer, text)
        if got != expected:
            raise ValueError(f"tokenizer splits {text!r} into {got}, expected {expected}; "
                             f"raise VOCAB_SIZE (now {tokenizer.get_vocab_size()}) or repeat the sentence more")
    for text in sentences[:500] + ["Côte d'Ivoire, São Tomé & Reykjavík!"]:
        back = tokenizer.decode(tokenizer.encode(text).ids)
        if back != text:
            raise ValueError(f"tokenizer does not round-trip {text!r}: decodes to {back!r}")


def tokenizer_config() -> dict:
    """Return tokenizer_config.json content so transformers' AutoTokenizer reads the same special tokens."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 256,
    }


def write_tokenizer(sentences: list[str], out_dir: Path = MODEL_DIR) -> Path:
    """Train, check and save tokenizer.json (and tokenizer_config.json) under out_dir; return its path."""
    tokenizer = train_tokenizer(sentences)
    check_tokenizer(tokenizer, sentences)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tokenizer.save(str(path))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    return path


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(DATA_DIR))
    from build_corpus import read_corpus

    train, _ = read_corpus()
    path = write_tokenizer(train)
    tok = Tokenizer.from_file(str(path))
    lengths = sorted(len(tok.encode(s).ids) for s in train)
    print(f"wrote {path}: vocab {tok.get_vocab_size()}, sentence length median "
          f"{lengths[len(lengths) // 2]} max {lengths[-1]} tokens")
    for text in ARTICLE_SPLITS:
        print(text, "->", tok.encode(text).tokens)
