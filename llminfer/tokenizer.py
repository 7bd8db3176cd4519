"""A thin wrapper over `tokenizers.Tokenizer` (from a tokenizer.json or a GGUF file's metadata), and chat templates
rendered in a sandbox. Chapter 01.

A chat model is trained on conversations laid out in one fixed format, with special tokens that mark who speaks;
a prompt must lay out the messages the same way. Checkpoints ship that format as a Jinja template
(`tokenizer_config.json`'s chat_template, or a GGUF file's tokenizer.chat_template); `ChatTemplate` renders it the
way transformers' `apply_chat_template` does: an immutable sandboxed Jinja environment, trim_blocks and
lstrip_blocks, the variables messages, bos_token, eos_token and add_generation_prompt.
"""
from __future__ import annotations

import json
import operator
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer", "ChatTemplate", "PLAIN_TEMPLATE", "message_text", "CHAT_ROLES"]

_BOS_NAMES = ("<bos>", "<s>", "<|begin_of_text|>", "<|im_start|>", "<|endoftext|>")
_EOS_NAMES = ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>")

# The roles of OpenAI's chat messages; a template decides which of them it accepts.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# A model that knows no roles (the bundled tiny-capitals) continues text: the contents joined by newlines.
PLAIN_TEMPLATE = (   # the newline is a Jinja string: trim_blocks would eat a bare one after a block tag
    "{% for message in messages %}{{ message['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def message_text(content) -> str:
    """A message's content as text: a string as it is; a list of parts, its text parts joined. Chapter 11."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content part of type {kind!r} is not supported; this server takes text "
                             "parts only ({\"type\": \"text\", \"text\": ...})")
        texts.append(part["text"])
    return "".join(texts)


def _checked_messages(messages) -> list[dict]:
    """messages with each content as text; ValueError for a message without a known role or without content."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got "
                         f"{messages!r}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] is a {type(message).__name__}; each message is a dict with 'role' "
                             "and 'content'")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}] has the role {role!r}; known roles are {', '.join(CHAT_ROLES)}")
        if "content" not in message:
            raise ValueError(f"messages[{i}] (role {role!r}) has no 'content'; give it the text, e.g. "
                             "{'role': 'user', 'content': 'Hello'}")
        checked.append({**message, "content": message_text(message["content"])})
    return checked


class ChatTemplate:
    """A compiled chat template: `render(messages)` gives the prompt string. Chapter 11."""

    def __init__(self, source: str = PLAIN_TEMPLATE, bos_token: str = "", eos_token: str = "",
                 origin: str = "plain"):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ValueError(f"the chat template from {origin} does not compile: {exc}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.origin = origin

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (dicts with 'role' and 'content'), ready to tokenize."""
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        plain = _checked_messages(messages)
        try:
            return self._template.render(messages=plain, bos_token=self.bos_token, eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt)
        except (TemplateError, SecurityError) as exc:
            raise ValueError(f"the chat template ({self.origin}) refused these messages: {exc}") from None
        except Exception as exc:   # the template's own code failed (a bad index, a type error) in the sandbox
            raise ValueError(f"the chat template ({self.origin}) failed on these messages: "
                             f"{type(exc).__name__}: {exc}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} characters)"


class Tokenizer:
    """Text to token ids and back; `tokens` shows the pieces a text was cut into. Chapter 01."""

    def __init__(self, backend: _HFTokenizer, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 chat_template: str | None = None, add_bos_token: bool = False):
        self.backend = backend
        # Two views of one tokenizer: `_plain` reads a special token's spelling in the text ("<eos>") as the
        # characters it is made of; `_special` turns it into the special id, for callers who ask with allow_special.
        self._plain = _HFTokenizer.from_str(backend.to_str())
        self._plain.encode_special_tokens = True
        self._special = backend
        if backend.encode_special_tokens:
            self._special = _HFTokenizer.from_str(backend.to_str())
            self._special.encode_special_tokens = False
        for name, value in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < self.vocab_size):
                raise ValueError(f"{name}={value!r} is not an id in this tokenizer's vocabulary of {self.vocab_size} "
                                 f"ids; pass an id 0..{self.vocab_size - 1}, or None to look the token up by name")
        self.bos_token_id = bos_token_id if bos_token_id is not None else self._find(_BOS_NAMES)
        self.eos_token_id = eos_token_id if eos_token_id is not None else self._find(_EOS_NAMES)
        self.add_bos_token = add_bos_token          # whether the checkpoint's own tokenizer starts a text with BOS
        self.chat_template = None if chat_template is None else ChatTemplate(
            chat_template, self._spelling(self.bos_token_id), self._spelling(self.eos_token_id), "the checkpoint")

    def _spelling(self, token_id: int | None) -> str:
        return "" if token_id is None else self.backend.id_to_token(token_id) or ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True) -> list[int] | str:
        """The token ids (or, tokenize=False, the text) of messages laid out by the checkpoint's chat template,
        special tokens as their ids. Chapter 01."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (the checkpoint ships none); encode a plain "
                             "prompt with tokenizer.encode(text), or build a llminfer.tokenizer.ChatTemplate")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, allow_special=True) if tokenize else text

    @classmethod
    def from_file(cls, path: str | Path, bos_token_id: int | None = None, eos_token_id: int | None = None,
                  chat_template: str | None = None, add_bos_token: bool = False) -> "Tokenizer":
        """Load a tokenizer.json; a missing file gets a FileNotFoundError naming it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}; a model folder needs tokenizer.json")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises its own exception type
            raise ValueError(f"{path} is not a readable tokenizer.json: {exc}") from None
        return cls(backend, bos_token_id, eos_token_id, chat_template, add_bos_token)

    def _find(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            token_id = self.backend.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        """The special tokens' spellings and ids, e.g. {'<bos>': 1, '<eos>': 2}."""
        return {token.content: token_id for token_id, token in sorted(self.backend.get_added_tokens_decoder().items())
                if token.special}

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. A special token's spelling in the text ("<eos>") is plain text unless allow_special."""
        if not isinstance(text, str):
            raise ValueError(f"encode takes a string, got {type(text).__name__}")
        backend = self._special if allow_special else self._plain
        ids = backend.encode(text, add_special_tokens=False).ids
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("this tokenizer has no beginning-of-sequence token; call encode(text) without add_bos")
            ids = [self.bos_token_id] + ids
        return ids

    def _checked_ids(self, ids) -> list[int]:
        """ids (a sequence, 1-D tensor or array of integers) as a list of ints, each checked against the vocabulary."""
        vocab_size = self.vocab_size
        if isinstance(ids, (str, bytes)):
            raise ValueError(f"expected token ids, got text {ids!r}; encode text with tokenizer.encode(text)")
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            integer = ids.dtype not in (torch.bool, np.bool_) and (
                not ids.is_floating_point() and not ids.is_complex() if isinstance(ids, torch.Tensor)
                else np.issubdtype(ids.dtype, np.integer))
            if not integer or ids.ndim > 1:
                raise ValueError(f"token ids must be one sequence of integers 0..{vocab_size - 1}, got a "
                                 f"{type(ids).__name__} of {ids.dtype} with shape {tuple(ids.shape)}")
            ids = ids.tolist() if ids.ndim == 1 else [ids.item()]
        try:
            ids = list(ids)
        except TypeError:
            raise ValueError(f"expected a sequence of token ids, got {ids!r}; wrap a single id as [id]") from None
        checked = []
        for token_id in ids:
            value = None
            if not isinstance(token_id, (bool, np.bool_)):
                try:
                    value = operator.index(token_id)    # int, numpy integers, one-element integer tensors
                except TypeError:
                    pass
            if value is None or (isinstance(token_id, torch.Tensor) and token_id.dtype == torch.bool):
                raise ValueError(f"token id {token_id!r} is not an integer; token ids are whole numbers "
                                 f"0..{vocab_size - 1} (the vocabulary holds {vocab_size} ids)")
            if not 0 <= value < vocab_size:
                raise ValueError(f"token id {value} is outside the vocabulary of {vocab_size} ids (valid ids are "
                                 f"0..{vocab_size - 1}); were the ids made for this tokenizer's model?")
            checked.append(value)
        return checked

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of token ids; an id outside the vocabulary is a ValueError naming it."""
        return self.backend.decode(self._checked_ids(ids), skip_special_tokens=skip_special_tokens)

    def tokens(self, ids) -> list[str]:
        """Each id as the text it stands for (special tokens by name), e.g. [' Paris', '.', '<eos>']."""
        return [self.backend.decode([i], skip_special_tokens=False) for i in self._checked_ids(ids)]

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id})"
