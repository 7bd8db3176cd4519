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

__all__ = ["PLAIN_TEMPLATE", "ChatTemplate", "load_chat_template", "message_text"]

PLAIN_TEMPLATE = (   # the newline is a Jinja string: trim_blocks would eat a bare one after a block tag
    "{% for message in messages %}{{ message['content'] }}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def message_text(content) -> str:
    """A message's content as text: a string as it is; a list of parts, its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message content part of type {kind!r} is not supported; this server takes text "
                             "parts only ({\"type\": \"text\", \"text\": ...})")
        texts.append(part["text"])
    return "".join(texts)


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
        plain = [{**m, "content": message_text(m.get("content"))} for m in messages]
        try:
            return self._template.render(messages=plain, bos_token=self.bos_token, eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:
            raise ValueError(f"the chat template ({self.origin}) refused these messages: {exc}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} characters)"


def _token_text(value) -> str:
    """bos_token / eos_token in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""


def load_chat_template(folder: str | Path | None) -> ChatTemplate:
    """The checkpoint's own template (tokenizer_config.json's chat_template, or chat_template.jinja), else PLAIN_TEMPLATE."""
    if folder is None:
        return ChatTemplate()
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
