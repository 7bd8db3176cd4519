"""A thin wrapper over `tokenizers.Tokenizer`, read from a tokenizer.json. Chapter 01."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer"]

_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|im_start|>", "<|endoftext|>")
_EOS_NAMES = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>")


class Tokenizer:
    """Text to token ids and back; `tokens` shows the pieces a text was cut into. Chapter 01."""

    def __init__(self, backend: _HFTokenizer, bos_token_id: int | None = None, eos_token_id: int | None = None):
        self.backend = backend
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._find(_BOS_NAMES)
        self.eos_token_id = eos_token_id if eos_token_id is not None else self._find(_EOS_NAMES)

    @classmethod
    def from_file(cls, path: str | Path, bos_token_id: int | None = None,
                  eos_token_id: int | None = None) -> "Tokenizer":
        """Load a tokenizer.json; a missing file gets a FileNotFoundError naming it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}; a model folder needs tokenizer.json")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ValueError(f"{path} is not a readable tokenizer.json: {exc}") from None
        return cls(backend, bos_token_id, eos_token_id)

    def _find(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            token_id = self.backend.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text` (no special tokens unless add_bos)."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a string, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("this tokenizer has no beginning-of-sequence token; call encode(text) without add_bos")
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of token ids."""
        return self.backend.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)

    def tokens(self, ids) -> list[str]:
        """Each id as the text it stands for (special tokens by name), e.g. [' Paris', '.', '<eos>']."""
        return [self.backend.decode([int(i)], skip_special_tokens=False) for i in ids]

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id})"
