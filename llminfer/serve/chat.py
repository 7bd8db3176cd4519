"""Chat messages to one prompt string: the chat template. Chapter 11.

A chat model is trained on conversations laid out in one fixed format, with special tokens that mark
who speaks; the server must lay out a request's messages the same way, or the model sees text unlike
anything it learned from. Hugging Face checkpoints ship that format as a Jinja template in
`tokenizer_config.json` (`chat_template`); this module renders it the way `transformers`'
`apply_chat_template` does (a sandboxed Jinja environment, `trim_blocks` and `lstrip_blocks`, the
variables `messages`, `bos_token`, `eos_token`, `add_generation_prompt`).

The bundled model, tiny-capitals, was never trained on conversations, so it has no template. For it the
server uses `PLAIN_TEMPLATE`: the messages' contents, in order, joined by newlines, with no role
markers (a model that knows no roles can only continue text). So the chat request
`[{"role": "user", "content": "The capital of France"}]` becomes the prompt `The capital of France`,
and the model answers ` is Paris.`, as it would to a plain completion request.

A message's content is text, never markup: `chat_prompt_ids` tokenizes the spelling of a special token
(`<|im_end|>`) typed into a message as the characters it is made of, and only the markers the template itself
writes become control tokens, so a user cannot forge another role's turn. It cuts the rendered prompt where
the template's own special tokens stand, as the tokenizer cuts a text at special tokens before anything else,
so a conversation without such spellings gets exactly the ids of tokenizing the whole prompt with its
special tokens read.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..tokenizer import PLAIN_TEMPLATE, ChatTemplate, message_text

__all__ = ["PLAIN_TEMPLATE", "ChatTemplate", "load_chat_template", "message_text", "render_segments",
           "chat_prompt_ids"]

# Content is marked while the template renders by two private-use characters, which no template writes.
_OPEN, _CLOSE = "\ue000", "\ue001"


def _token_text(value) -> str:
    """bos_token / eos_token in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


def load_chat_template(folder: str | Path | None) -> ChatTemplate:
    """The checkpoint's own template (tokenizer_config.json's chat_template, or chat_template.jinja), else PLAIN_TEMPLATE."""
    if folder is None:
        return ChatTemplate()
    if Path(folder).is_file() and Path(folder).suffix == ".gguf":     # a GGUF file carries its own template
        from ..gguf_reader import gguf_tokenizer, read_header
        template = gguf_tokenizer(read_header(folder)).chat_template
        return ChatTemplate() if template is None else ChatTemplate(
            template.source, template.bos_token, template.eos_token, origin=Path(folder).name)
    jinja_file = Path(folder) / "chat_template.jinja"              # newer checkpoints keep it in its own file
    path = Path(folder) / "tokenizer_config.json"
    if not path.is_file():
        return ChatTemplate(jinja_file.read_text(), origin=jinja_file.name) if jinja_file.is_file() else ChatTemplate()
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); fix the file or remove it") from None
    source = config.get("chat_template")
    if isinstance(source, list):                    # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
    if not source and jinja_file.is_file():
        return ChatTemplate(jinja_file.read_text(), bos, eos, origin=jinja_file.name)
    if not source:
        return ChatTemplate(PLAIN_TEMPLATE, bos, eos, origin="plain")
    if not isinstance(source, str):
        raise ValueError(f"{path} has a chat_template that is not a string: {type(source).__name__}")
    return ChatTemplate(source, bos, eos, origin=str(path.name))


def render_segments(template: ChatTemplate, messages: list[dict]) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_content) pieces in order: what the template wrote, and what the messages
    brought (their contents, as the template placed them). Chapter 11.

    Each content is marked while it renders; a template that trims a content's edges (Llama 3's `| trim`) sees the
    marks instead, so the marked content is trimmed here the same way when that is what the plain render shows."""
    marked = []
    for message in messages:
        text = message_text(message.get("content")) if isinstance(message, dict) else None
        if isinstance(message, dict) and "content" in message and (_OPEN in text or _CLOSE in text):
            raise ValueError("message content may not hold the characters U+E000 or U+E001 (private use)")
        marked.append({**message, "content": _OPEN + text + _CLOSE} if isinstance(message, dict) and "content"
                      in message else message)
    rendered = template.render(messages)
    pieces = re.split(f"({_OPEN}.*?{_CLOSE})", template.render(marked), flags=re.DOTALL)
    segments = [(p[1:-1], True) if p.startswith(_OPEN) else (p, False) for p in pieces if p]
    if "".join(text for text, _ in segments) != rendered:
        trimmed = [(text.strip(), True) if content else (text, False) for text, content in segments]
        if "".join(text for text, _ in trimmed) == rendered:
            segments = trimmed
        else:
            raise ValueError(f"the chat template ({template.origin}) changes message content in a way this server "
                             "cannot place; content must appear in the prompt as sent (or trimmed)")
    return segments


def chat_prompt_ids(template: ChatTemplate, tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of messages laid out by template: the template's own special tokens as their ids, everything
    else, the contents included, as plain text (a special token's spelling in a message stays characters).
    Chapter 11."""
    special = tokenizer.special_tokens                                   # spelling -> id
    spellings = sorted(special, key=len, reverse=True)
    marker = re.compile("|".join(re.escape(s) for s in spellings)) if spellings else None
    ids: list[int] = []
    pending: list[str] = []                  # text since the last template marker, encoded as one piece

    def flush():
        if pending:
            ids.extend(tokenizer.encode("".join(pending)))
            pending.clear()

    for text, is_content in render_segments(template, messages):
        if is_content or marker is None:
            pending.append(text)
            continue
        start = 0
        for match in marker.finditer(text):
            pending.append(text[start:match.start()])
            flush()
            ids.append(special[match.group()])
            start = match.end()
        pending.append(text[start:])
    flush()
    return ids
