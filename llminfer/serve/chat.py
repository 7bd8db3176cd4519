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
"""
from __future__ import annotations

import json
from pathlib import Path

from ..tokenizer import PLAIN_TEMPLATE, ChatTemplate, message_text

__all__ = ["PLAIN_TEMPLATE", "ChatTemplate", "load_chat_template", "message_text"]


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
