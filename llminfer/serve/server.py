"""An OpenAI-compatible HTTP server on the engine: FastAPI routes, server-sent events, errors. Chapter 11.

    app = build_app(model, tokenizer, model_name="tiny-capitals")          # a FastAPI app
    with ServerThread(app) as server:                                      # uvicorn on 127.0.0.1, a free port
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")

or from a shell, `python -m llminfer.serve --model tiny-capitals` (see __main__.py).

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
`stream=true`, else one JSON body), GET (or HEAD) /v1/models, /v1/models/{id} and /health, GET /metrics (Prometheus).
With an API key (ServeConfig.api_key, `--api-key` or LLMINFER_API_KEY) every /v1 route wants it as a Bearer token.
Without one, the server is kept from web pages: a POST body must be sent as application/json (415 otherwise: a page
can send text/plain or a form without asking), and the Host header must name the bound address or one of
`--allowed-hosts` (421 otherwise: DNS rebinding). CORS stays closed unless `--allowed-origins` names origins.

A request's path: parse and check the body (400 with an OpenAI error body if anything is wrong, before
the engine sees it), render the chat template, tokenize, check the ids once (`PromptIds`: the engine takes them
as checked), compile a structured output's pattern if the request asks for one (chapter 13: `response_format`,
`structured_outputs`; each prompt then gets its own `Constraint`; the disaggregated pair, whose workers take no
constraint, refuses it with a 400) and hand them to the engine loop (429 if its queue is full), then turn the
token ids coming back into text, incrementally (a multi-byte character split across tokens is held back until it is
whole; so is text that may be the start of a stop string).
A client that goes away mid-request has its request aborted, which frees its KV blocks before the
engine's next step.
"""
from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import logging
import math
import numbers
import reprlib
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from .. import checks
from ..checks import check_flag, check_int, check_sampling
from ..engine import Engine, LLMEngine, PromptIds, SamplingParams
from ..structured import MAX_STATES, Constraint, TokenIndex, UnsupportedSchema, Vocabulary, compile_index
from ..structured import json_object_regex, schema_to_regex
from .async_engine import EngineLoop, EngineUnavailable, QueueFull, RequestHandle, Update
from .chat import ChatTemplate, chat_prompt_ids, load_chat_template
from .jsonscan import BodyScanner, TooMany
from .limits import REFUSE_BODY, body_too_large, uvicorn_options
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_sampling_fields, error_body,
                       new_id, now_s, output_structure)

__all__ = ["ServeConfig", "OpenAIServer", "build_app", "ServerThread", "IncrementalText", "BearerAuth", "HostGuard",
           "HeaderGuard", "bind_host_names"]

DEFAULT_HOST = "127.0.0.1"

log = logging.getLogger("llminfer.serve")


@dataclass
class ServeConfig:
    """How the server runs: its name for the model, queue bound, shutdown drain, default sampling, and what one
    request or connection may cost (body bytes, header/body/idle timeouts, connections). Chapter 11."""
    model_name: str = "tiny-capitals"
    max_queued_requests: int = 128
    drain_timeout_s: float = 10.0
    default_temperature: float = 1.0          # the OpenAI API's default when a request leaves it unset
    add_bos: bool = False                     # prepend the BOS token to text prompts (tokenizer_config.json)
    engine_kwargs: dict = field(default_factory=dict)
    max_request_bytes: int = 4 * 2**20        # a larger body gets 413
    header_timeout_s: float = 10.0            # a request's headers must arrive within this (slow clients are closed)
    body_timeout_s: float = 30.0              # and its body within this once the headers are in
    keep_alive_timeout_s: float = 5.0         # an idle keep-alive connection is closed after this
    max_connections: int = 256                # more concurrent connections get 503 from uvicorn
    api_key: str | None = None                # if set, every /v1 route wants "Authorization: Bearer <api_key>"
    allowed_hosts: tuple[str, ...] = ()       # Host values served beside the bind address's (checked without a key)
    allowed_origins: tuple[str, ...] = ()     # web origins CORS lets read responses (none: CORS stays closed)
    max_structured_states: int = MAX_STATES   # a structured-output pattern with a larger automaton gets 400 (ch. 13)

    def __post_init__(self):
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name must be a non-empty string, got {self.model_name!r}")
        check_int("max_queued_requests", self.max_queued_requests, 1)
        check_int("max_request_bytes", self.max_request_bytes, 1024)
        check_int("max_connections", self.max_connections, 1)
        check_int("max_structured_states", self.max_structured_states, 1)
        check_flag("add_bos", self.add_bos)
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key.strip()
                                         or not self.api_key.isprintable()):
            raise ValueError("api_key must be a non-empty printable string, or None for no key")
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) and v and v.isprintable() and " " not in v
                                                 for v in value):
                raise ValueError(f"{name} must be a list of names without spaces, e.g. ['example.com:8000'], "
                                 f"got {value!r}")
            setattr(self, name, tuple(value))
        for name in ("drain_timeout_s", "header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            low = 0 if name == "drain_timeout_s" else 0.001
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or value < low:
                raise ValueError(f"{name} must be a finite number of seconds >= {low}, got {value!r}")
        try:
            check_sampling(temperature=self.default_temperature)
        except ValueError as exc:
            raise ValueError(f"default_temperature: {exc}") from None
        if self.default_temperature > 2:
            raise ValueError(f"default_temperature must lie in 0..2, as a request's temperature must, "
                             f"got {self.default_temperature!r}")


class BearerAuth:
    """ASGI middleware: a /v1 request without "Authorization: Bearer <key>" gets an OpenAI-style 401; /health and
    /metrics stay open (for probes and scrapers). Chapter 11."""

    def __init__(self, app, api_key: str, on_refusal=None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.on_refusal = on_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            given = b"".join(v for k, v in scope.get("headers") or [] if k == b"authorization")
            if not hmac.compare_digest(given, self.expected):
                if self.on_refusal is not None:
                    self.on_refusal()
                message = ("Incorrect API key provided" if given else
                           "You didn't provide an API key; send it as the header 'Authorization: Bearer <key>'")
                response = JSONResponse(error_body(message, code="invalid_api_key"), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def bind_host_names(host: str, port: int) -> set[str]:
    """The Host header values that name a server bound to host:port: the address itself, and for a loopback
    address the names of this machine (127.0.0.1, localhost, [::1]); without the port too where it is 80."""
    names = {f"[{host}]" if ":" in host else host}
    if host in ("127.0.0.1", "::1", "localhost") or host.startswith("127."):
        names |= {"127.0.0.1", "localhost", "[::1]"}
    return {f"{name}:{port}" for name in names} | (names if port == 80 else set())


class HostGuard:
    """ASGI middleware: a request whose Host header names neither the bound address (`bind_host_names`) nor one of
    `allowed` gets a 421, so a web page whose name was rebound to this machine's address (DNS rebinding) cannot
    read the server's answers. An entry of `allowed` without a port matches that name on any port. Chapter 11."""

    def __init__(self, app, allowed: tuple[str, ...] = ()):
        self.app = app
        self.allowed = {name.lower() for name in allowed}

    def admits(self, host: str, server: tuple | None) -> bool:
        host = host.lower()
        if host in self.allowed or "*" in self.allowed or host.rsplit(":", 1)[0] in self.allowed:
            return True
        return server is not None and host in bind_host_names(server[0], server[1])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            hosts = [v for k, v in scope.get("headers") or [] if k == b"host"]
            host = hosts[0].decode("latin-1") if len(hosts) == 1 else ""
            if not self.admits(host, scope.get("server")):
                message = (f"the Host header {host!r} does not name this server; send the address it listens on "
                           "(127.0.0.1:PORT or localhost:PORT), or start it with --allowed-hosts naming this one")
                response = JSONResponse(error_body(message, code="misdirected_request"), status_code=421)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


SINGLE_HEADERS = (b"host", b"authorization", b"content-length", b"content-type", b"transfer-encoding")


class HeaderGuard:
    """ASGI middleware: 400 for a request that sends one of SINGLE_HEADERS twice (two keys, two lengths: the last
    one must not quietly win) or both Transfer-Encoding and Content-Length (read differently by a proxy in front,
    that is request smuggling). Chapter 11."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = [k for k, _ in scope.get("headers") or []]
            twice = [n.decode() for n in SINGLE_HEADERS if names.count(n) > 1]
            message = (f"the request sends the header {twice[0]!r} more than once; send it once" if twice else
                       "the request sends both Transfer-Encoding and Content-Length; send one of them"
                       if b"transfer-encoding" in names and b"content-length" in names else None)
            if message is not None:
                response = JSONResponse(error_body(message, code="bad_headers"), status_code=400,
                                        headers={"Connection": "close"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class IncrementalText:
    """Token ids in, text deltas out: holds back a split multi-byte character and a possible stop string. Chapter 11."""

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []
        self.text = ""           # everything decoded so far (cut at a stop string once one is found)
        self.sent = 0            # characters of self.text already handed out
        self.stopped = False     # a stop string was found

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The new text these tokens make visible (all of it when final)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        if self.stop:
            start = max(0, self.sent - max(len(s) for s in self.stop))
            hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                text, final, self.stopped = text[:min(hits)], True, True
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":    # an unfinished UTF-8 sequence
                end -= 1
            for keep in range(min(max((len(s) for s in self.stop), default=1) - 1, end - self.sent), 0, -1):
                if any(s.startswith(text[end - keep:end]) for s in self.stop):
                    end -= keep                                      # might be the start of a stop string
                    break
        self.text = text
        delta = text[self.sent:end]
        self.sent = end
        return delta


class OpenAIServer:
    """The state behind the routes: engine loop, tokenizer, chat template, metrics. Chapter 11."""

    def __init__(self, model, tokenizer, config: ServeConfig | None = None, chat_template: ChatTemplate | None = None,
                 engine: Engine | None = None, model_folder: str | Path | None = None, close_engine: bool = False):
        """The server's state; engine: any engine protocol implementation (default: an LLMEngine on model)."""
        self.config = config or ServeConfig()
        if engine is None and model is None:
            raise ValueError("OpenAIServer needs a model (to build an LLMEngine on) or an engine; got neither")
        self.model = model
        self.tokenizer = tokenizer
        self.engine = engine if engine is not None else LLMEngine(model, **self.config.engine_kwargs)
        self.close_engine = close_engine       # the server owns it (the disaggregated pair): close it at stop
        # Structured output needs an engine whose add_request takes constraint= (LLMEngine; not the disaggregated pair)
        self.structured = "constraint" in inspect.signature(self.engine.add_request).parameters
        self.chat_template = chat_template or load_chat_template(model_folder)
        self.loop = EngineLoop(self.engine, self.config.max_queued_requests)
        self.metrics = ServerMetrics(self.loop)
        self.loop.on_step = self.metrics.on_step
        self.loop.on_finish = self.metrics.on_finish
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.config.vocab_size
        # No token spells more than longest_token characters, so a text longer than max_model_len of them (twice
        # that, for normalizers that merge characters) cannot fit: it is refused before it is tokenized.
        self.max_prompt_chars = 2 * self.max_model_len * longest_token_chars(tokenizer)
        self.created = now_s()
        self.clock = self.engine.clock

    # --- lifecycle ---------------------------------------------------------------------------------------

    def start(self) -> None:
        if self.loop.state == "new":
            self.loop.start()

    def stop(self) -> None:
        try:
            self.loop.stop(drain_timeout_s=self.config.drain_timeout_s)
        finally:
            if self.close_engine:
                self.engine.close()

    # --- request checks ----------------------------------------------------------------------------------

    def _check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise APIError(f"The model {name!r} does not exist: this server serves {self.config.model_name!r} "
                           "(GET /v1/models lists it)", status_code=404, param="model", code="model_not_found")

    def _token_prompt(self, ids: list[int], where: str) -> list[int]:
        if not ids:
            raise APIError(f"{where} is empty; send at least one token", param="prompt")
        return ids                                  # its ids are checked once, by submit

    def _check_text_length(self, text: str, where: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise APIError(f"{where} has {len(text)} characters, more than the {self.max_prompt_chars} that could fit "
                           f"this model's maximum context length of {self.max_model_len} tokens; shorten it",
                           param=param, code="context_length_exceeded")

    def _text_prompt(self, text: str, where: str, param: str = "prompt") -> list[int]:
        if text == "":
            raise APIError(f"{where} is empty; send some text", param=param)
        self._check_text_length(text, where, param)
        ids = self.tokenizer.encode(text, add_bos=self.config.add_bos)
        if not ids:
            raise APIError(f"{where} tokenizes to no tokens; send some text", param=param)
        return ids

    def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        """The request's prompts as token-id lists (a 400 for an empty one)."""
        prompt = request.prompt
        if isinstance(prompt, str):
            return [self._text_prompt(prompt, "the prompt")]
        if not prompt:
            raise APIError("the prompt is empty; send a string, a list of strings, or token ids", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [self._token_prompt(prompt, "the prompt")]
        out = []
        for i, p in enumerate(prompt):
            out.append(self._text_prompt(p, f"prompt[{i}]") if isinstance(p, str)
                       else self._token_prompt(p, f"prompt[{i}]"))
        return out

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        """The messages through the chat template, tokenized: the template's own special tokens as such, the
        messages' contents as plain text (`chat.chat_prompt_ids`: a content cannot forge a role marker)."""
        if not request.messages:
            raise APIError("messages is empty; send at least one message", param="messages")
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        try:
            text = self.chat_template.render(messages)
            if text == "":
                raise APIError("the messages render to an empty prompt; send some text", param="messages")
            self._check_text_length(text, "the rendered messages", "messages")
            ids = chat_prompt_ids(self.chat_template, self.tokenizer, messages)
        except ValueError as exc:
            raise APIError(str(exc), param="messages") from None
        if not ids:
            raise APIError("the messages tokenize to no tokens; send some text", param="messages")
        return ids

    def sampling_params(self, request, prompt_len: int, max_tokens: int | None,
                        name: str = "max_tokens") -> SamplingParams:
        """SamplingParams for one prompt: max_tokens (the field `name` the client sent) checked against the context
        (400 naming that field if it does not fit)."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens, and the prompt "
                           f"alone has {prompt_len}, leaving no room for a completion; shorten the prompt",
                           param="messages" if isinstance(request, ChatCompletionRequest) else "prompt",
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = room
        if max_tokens < 1:
            raise APIError(f"{name}={max_tokens} is invalid: it must be at least 1", param=name)
        if prompt_len + max_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} "
                           f"in the completion); pass {name} <= {room} or shorten the prompt",
                           param=name, code="context_length_exceeded")
        temperature = self.config.default_temperature if request.temperature is None else request.temperature
        top_k = None if request.top_k in (None, -1, 0) else request.top_k        # vLLM's: -1 and 0 are no cut
        top_p = None if request.top_p in (None, 1.0) else request.top_p
        eos = None if request.ignore_eos else self.tokenizer.eos_token_id
        penalties = {name: value for name in ("repetition_penalty", "presence_penalty", "frequency_penalty")
                     if (value := getattr(request, name)) is not None}          # unset: the neutral default
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                  eos_token_id=eos, seed=request.seed, min_p=request.min_p, **penalties)
        except ValueError as exc:
            raise APIError(str(exc)) from None

    def output_index(self, request) -> TokenIndex | None:
        """The compiled pattern the request's output must match (`protocol.output_structure`), or None for free text.
        Compiling stops at config.max_structured_states automaton states; a schema keyword the compiler does not
        handle, a regex that does not parse (its message gives the position) or a pattern over the limit is a 400
        naming the field, before any compute. Chapter 13."""
        found = output_structure(request)
        if found is None:
            return None
        kind, value, param = found
        if not self.structured:
            raise APIError(f"{param} (structured output) is not supported by this server's engine "
                           f"({type(self.engine).__name__}, e.g. the disaggregated pair); send free-text requests, or "
                           "serve with one engine", param=param)
        limit = self.config.max_structured_states
        try:
            pattern = value if kind == "regex" else json_object_regex() if kind == "json_object" \
                else schema_to_regex(value)
            return compile_index(pattern, Vocabulary.from_tokenizer(self.tokenizer), limit)
        except UnsupportedSchema as exc:
            raise APIError(f"{param}: {exc}", param=param, code="unsupported_schema") from None
        except ValueError as exc:
            fix = f" (this server's --max-structured-states is {limit})" if "max_states" in str(exc) else ""
            raise APIError(f"{param}: {exc}{fix}", param=param) from None

    # --- parsing a body --------------------------------------------------------------------------------

    def parse_body(self, raw: bytes, schema, counted: bool = False):
        """The request parsed and checked in size and type, or an APIError (400) naming what is wrong. Chapter 11.

        Sizes come first and cost little: the JSON's arrays, objects and values are counted in its bytes before it
        is parsed (`count_structure`; not again when a `body_scanner` counted them as the body arrived: counted),
        integers too long to convert are kept as text (`checks.parse_json_int`), and the prompts' number, each
        prompt's length and their total are checked on the parsed document (`check_sizes`) before the schema
        reads it, so an oversized request is refused before any per-prompt work."""
        limit, most_values = self.max_json_containers, self.max_json_values
        containers, commas = (0, 0) if counted else count_structure(raw, min(limit, most_values))
        if containers > limit:
            raise self.too_many(TooMany("containers", containers, limit, None))
        if commas >= most_values:
            raise self.too_many(TooMany("values", commas + 1, most_values, None))
        try:
            body = json.loads(raw, parse_int=checks.parse_json_int)
        except (ValueError, UnicodeDecodeError) as exc:       # JSONDecodeError is a ValueError
            raise APIError(f"We could not parse the JSON body of your request ({str(exc)[:200]}); send a JSON "
                           "object (Content-Type: application/json)") from None
        except RecursionError:
            raise APIError(f"the JSON body is nested too deeply to parse; a request nests at most {MAX_JSON_DEPTH} "
                           "levels") from None
        if not isinstance(body, dict):
            raise APIError(f"the request body must be a JSON object, got a JSON {type(body).__name__}")
        self.check_sizes(body)                # lengths first: cheaper than a walk over every value
        check_json_values(body)
        try:
            parsed = schema.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = _field_path(first["loc"])
            if first["type"] == "extra_forbidden":
                raise APIError(f"Unrecognized request argument supplied: {where}", param=where) from None
            if first["type"] == "missing":
                raise APIError(f"Missing required parameter: {where!r}", param=where) from None
            if where == "prompt":                 # a union: name what it may be, not the first branch tried
                raise APIError(f"Invalid value for 'prompt': it must be a string, a list of strings, a list of "
                               f"token ids (integers) or a list of such lists (got {_shown(body.get('prompt'))})",
                               param=where) from None
            raise APIError(f"Invalid value for {where!r}: {first['msg']} (got {_shown(first.get('input'))})",
                           param=where) from None
        self._check_model(parsed.model)
        return parsed

    def body_scanner(self) -> BodyScanner:
        """A scanner that counts a body's values as it streams in, with this server's limits (`jsonscan`)."""
        return BodyScanner(self.max_json_containers, self.max_json_values, self.loop.max_queued_requests,
                           self.max_prompt_chars)

    def too_many(self, exc: TooMany) -> APIError:
        """The 400 for a body past one of its size limits, counted in its bytes (`jsonscan.TooMany`): the count, the
        limit, the field being read where known, and the fix."""
        queued, where = self.loop.max_queued_requests, f" (in the field {exc.field!r})" if exc.field else ""
        if exc.what == "containers":
            return APIError(f"the JSON body holds at least {exc.count} arrays and objects{where}, more than the "
                            f"{exc.limit} a request may hold (at most {queued} prompts); send fewer prompts or "
                            "messages per request", param=exc.field, code="too_many_values")
        if exc.what == "values":
            return APIError(f"the JSON body holds at least {exc.count} values{where}, more than the {exc.limit} a "
                            f"request may hold (at most {queued} prompts of at most {self.max_model_len} tokens); "
                            "send fewer or shorter prompts", param=exc.field, code="too_many_values")
        if exc.what == "prompts":
            return APIError(f"the request holds at least {exc.count} prompts but this server queues at most {queued} "
                            "requests (max_queued_requests); send at most that many prompts per request",
                            param="prompt", code="too_many_prompts")
        return APIError(f"{exc.field} has at least {exc.count} characters, more than the {exc.limit} that could fit "
                        f"this model's maximum context length of {self.max_model_len} tokens; shorten it",
                        param="prompt", code="context_length_exceeded")

    @property
    def max_json_containers(self) -> int:
        """The most arrays and objects a body may hold: a list per prompt, and room for messages and options."""
        return self.loop.max_queued_requests + MAX_MESSAGES * 4 + 64

    @property
    def max_json_values(self) -> int:
        """The most values a body may hold: every prompt's every token, and room for messages and options."""
        return self.loop.max_queued_requests * self.max_model_len + MAX_MESSAGES * 8 + 1024

    def check_sizes(self, body: dict) -> None:
        """APIError (400) for more prompts than the queue holds, a prompt longer than the context (in tokens, or in
        characters where no token list of that length could fit), or more messages than MAX_MESSAGES whose text
        is longer than any context: on the parsed JSON, before the schema or the tokenizer sees it. Chapter 11."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt[:1]):
            if len(prompt) > self.loop.max_queued_requests:
                raise APIError(f"the request holds {len(prompt)} prompts but this server queues at most "
                               f"{self.loop.max_queued_requests} requests (max_queued_requests); send at most that "
                               "many prompts per request", param="prompt", code="too_many_prompts")
            items = [(f"prompt[{i}]", p) for i, p in enumerate(prompt)]
        else:
            items = [("the prompt", prompt)]
        for where, item in items:
            if isinstance(item, list) and len(item) > self.max_model_len:
                raise APIError(f"{where} has {len(item)} tokens, more than this model's maximum context length of "
                               f"{self.max_model_len} tokens; shorten it", param="prompt",
                               code="context_length_exceeded")
            if isinstance(item, str):
                self._check_text_length(item, where, "prompt")
        messages = body.get("messages")
        if isinstance(messages, list):
            if len(messages) > MAX_MESSAGES:
                raise APIError(f"the request holds {len(messages)} messages, more than the {MAX_MESSAGES} a request "
                               "may hold; send fewer", param="messages")
            chars = sum(len(m["content"]) for m in messages
                        if isinstance(m, dict) and isinstance(m.get("content"), str))
            if chars > self.max_prompt_chars:
                raise APIError(f"the messages hold {chars} characters, more than the {self.max_prompt_chars} that "
                               f"could fit this model's maximum context length of {self.max_model_len} tokens; "
                               "shorten them", param="messages", code="context_length_exceeded")

    # --- submitting --------------------------------------------------------------------------------------

    def prompt_ids(self, prompts: list[list[int]]) -> list[PromptIds]:
        """Each prompt's ids checked, once on their way to the engine, which takes them as checked (a 400 naming the
        prompt and the id otherwise). Chapter 11."""
        checked = []
        for index, prompt in enumerate(prompts):
            try:
                checked.append(PromptIds(self.engine.config, prompt))
            except ValueError as exc:
                where = "the prompt" if len(prompts) == 1 else f"prompt[{index}]"
                raise APIError(f"{where}: {exc}", param="prompt") from None
        return checked

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams],
                     index: TokenIndex | None = None) -> list[RequestHandle]:
        """Hands every prompt to the engine loop; all or none (an error aborts those already added). index: the
        compiled output pattern (`output_index`); each prompt gets a fresh Constraint on it (a Constraint advances
        in place)."""
        handles: list[RequestHandle] = []
        if len(prompts) > self.loop.max_queued_requests:     # could never be queued, however idle the server
            raise APIError(f"the request holds {len(prompts)} prompts but this server queues at most "
                           f"{self.loop.max_queued_requests} requests (max_queued_requests); send at most that many "
                           "prompts per request", param="prompt", code="too_many_prompts")
        checked = await asyncio.to_thread(self.prompt_ids, prompts)          # a check per id: off the event loop
        try:
            for prompt, p in zip(checked, params):
                constraint = None if index is None else Constraint(index, self.tokenizer)
                handles.append(await self.loop.add_request(prompt, p, constraint=constraint))
        except BaseException as exc:
            for handle in handles:
                handle.abort()
            if isinstance(exc, QueueFull):
                self.metrics.rejected.labels("queue_full").inc()
                raise APIError(str(exc), status_code=429, type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"}) from None
            if isinstance(exc, EngineUnavailable):
                self.metrics.rejected.labels("unavailable").inc()
                raise APIError(str(exc), status_code=503, type="server_error", code="unavailable",
                               headers={"Retry-After": "1"}) from None
            if isinstance(exc, ValueError):       # the engine's own checks; counted by the 400 handler
                raise APIError(str(exc)) from None
            raise
        return handles


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return f"data: {data}\n\n"


MAX_JSON_DEPTH = 32      # objects and arrays inside one another; OpenAI requests need about 6
MAX_MESSAGES = 2048      # messages in one chat request


def count_structure(raw: bytes, limit: int) -> tuple[int, int]:
    """(arrays and objects, commas) in a JSON text, counted in its bytes outside its strings, where either passes
    limit (at the speed of bytes methods: a body of a million tiny lists is counted in milliseconds, where parsing
    it takes seconds). A count within limit in the raw bytes is returned as it is, strings included."""
    brackets, commas = raw.count(b"[") + raw.count(b"{"), raw.count(b",")
    if brackets <= limit and commas <= limit:
        return brackets, commas
    # outside strings only: escaped backslashes and quotes dropped, then every other piece between quotes
    unquoted = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])
    return unquoted.count(b"[") + unquoted.count(b"{"), unquoted.count(b",")


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict = 3, 8, 8
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = _SHORT_REPR.maxlong = 120


def _shown(value) -> str:
    """A short repr of a request's value, for an error message (a list of a million prompts costs no more than one)."""
    return _SHORT_REPR.repr(value)


def check_json_values(body) -> None:
    """APIError (400) for JSON nested deeper than MAX_JSON_DEPTH or a string that is not valid Unicode
    (`checks.check_json_values`). Chapter 11."""
    try:
        checks.check_json_values(body, MAX_JSON_DEPTH)
    except checks.InvalidValue as exc:
        raise APIError(str(exc), param=exc.param) from None


def longest_token_chars(tokenizer) -> int:
    """The most characters any one token of the tokenizer spells (special tokens included); 64 if unknown."""
    backend = getattr(tokenizer, "backend", None)
    try:
        return max(max(len(token) for token in backend.get_vocab(with_added_tokens=True)), 1)
    except (AttributeError, TypeError, ValueError):
        return 64


DRAIN_BYTES = 16 * 2**20     # a body over the limit is read and dropped up to this, so its client gets the 413


async def read_limited(request: Request, limit: int, scan=None) -> bytes:
    """The request body, or APIError 413 if it exceeds limit bytes. Chapter 11.

    scan(chunk), if given, sees each chunk as it arrives and may raise an APIError (`jsonscan`: too many values):
    the HTTP protocol then answers it at once and drops the rest of the body unread (`limits`, REFUSE_BODY).

    A declared Content-Length over the limit never gets here: the HTTP protocol answers it from the headers
    (`limits`). For a body sent in chunks, or longer than it said, the excess is read and dropped (never kept) up
    to DRAIN_BYTES more, so that the client, still sending, reads the 413 instead of a reset connection; a larger
    body is answered at once and its connection closed."""
    def too_large(close: bool = False) -> APIError:
        message, code = body_too_large(limit)
        return APIError(message, status_code=413, code=code, headers={"Connection": "close"} if close else None)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + DRAIN_BYTES:
        raise too_large(close=True)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit + DRAIN_BYTES:
                raise too_large(close=True)
            if size <= limit:
                chunks.append(chunk)
                if scan is not None:
                    _scan(request, scan, chunk)
    except ClientDisconnect:
        raise APIError("the client went away before its request body arrived", status_code=408) from None
    if size > limit:
        raise too_large()
    return b"".join(chunks)


def _scan(request: Request, scan, chunk: bytes) -> None:
    """scan(chunk); an APIError it raises is answered by the HTTP protocol where it can (the rest of the body is then
    dropped as it arrives, never parsed), and raised on for the app's error handler (its log line and metrics)."""
    try:
        scan(chunk)
    except APIError as exc:
        refuse = request.scope.get("extensions", {}).get(REFUSE_BODY)
        if refuse is not None:
            refuse(exc.status_code, exc.body())
        raise


def _field_path(loc: tuple) -> str | None:
    """'prompt' or 'messages.0.role' from a pydantic error location, without the union branch it tried
    ('prompt.list[int].0' names the field 'prompt.0')."""
    parts = [str(p) for p in loc if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _finish_reason(update: Update, text: IncrementalText) -> str:
    return "stop" if text.stopped else (update.finish_reason or "abort")


async def _wait_for_disconnect(request) -> None:
    """Returns when the HTTP client goes away (the ASGI 'http.disconnect' message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def build_app(model=None, tokenizer=None, config: ServeConfig | None = None, server: OpenAIServer | None = None,
              model_folder: str | Path | None = None):
    """The FastAPI app: the OpenAI routes, /health and /metrics, and the engine loop's lifespan. Chapter 11."""
    state = server or OpenAIServer(model, tokenizer, config, model_folder=model_folder)

    @asynccontextmanager
    async def lifespan(app):
        state.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.stop)

    app = FastAPI(title="llminfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    if state.config.api_key is not None:
        app.add_middleware(BearerAuth, api_key=state.config.api_key,
                           on_refusal=state.metrics.rejected.labels("unauthorized").inc)
    if state.config.allowed_origins:          # outside the key's check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(state.config.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    if state.config.api_key is None or state.config.allowed_hosts:
        app.add_middleware(HostGuard, allowed=state.config.allowed_hosts)
    app.add_middleware(HeaderGuard)           # outermost: the first check a request meets

    def error_response(exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        if exc.status_code == 400 or exc.status_code == 404:
            state.metrics.rejected.labels("invalid").inc()
        if exc.status_code < 500:                      # one line per refused request, never a traceback
            log.info("refused %s %s: %d %s", request.method, request.url.path, exc.status_code, exc.message[:300])
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc):
        state.metrics.rejected.labels("invalid").inc()
        return JSONResponse(error_body(f"invalid request: {exc.errors()[:1]}"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = (f"Unknown route {request.method} {request.url.path}; this server has POST /v1/completions, "
                       "POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics")
            body = error_body(message, code="not_found")
        elif exc.status_code == 405:
            body = error_body(f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        else:
            body = error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body(f"the server failed on this request ({type(exc).__name__}); the server log "
                                       "has the details", "server_error"), status_code=500)

    async def read_body(request: Request, schema):
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":        # a web page can POST text/plain or a form without a preflight
            raise APIError(f"the request body must be JSON sent as Content-Type: application/json, got "
                           f"{_shown(kind or 'no Content-Type')}", status_code=415, code="unsupported_media_type")
        scanner = state.body_scanner()

        def scan(chunk: bytes) -> None:         # counted as it arrives: a body past a limit is refused at once
            try:
                scanner.feed(chunk)
            except TooMany as exc:
                raise state.too_many(exc) from None
        raw = await read_limited(request, state.config.max_request_bytes, scan)
        parsed = await asyncio.to_thread(state.parse_body, raw, schema, True)    # parsing and checking: off the loop
        check_sampling_fields(parsed)
        return parsed

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if state.loop.state in ("running", "new"):
            return Response(status_code=200)
        return JSONResponse(error_body(f"the engine is {state.loop.state}", "server_error"), status_code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": state.config.model_name, "object": "model", "created": state.created, "owned_by": "llminfer",
                "max_model_len": state.max_model_len}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        state._check_model(model_id)
        return model_card()

    async def run(request: Request, body, prompts: list[list[int]], chat: bool, received: float):
        max_tokens, name = body.max_tokens, "max_tokens"
        if chat and body.max_completion_tokens is not None:
            max_tokens, name = body.max_completion_tokens, "max_completion_tokens"
        params = [state.sampling_params(body, len(p), max_tokens, name) for p in prompts]
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        index = await asyncio.to_thread(state.output_index, body)    # compiling a pattern: off the event loop
        handles = await state.submit(prompts, params, index)
        response_id = new_id("chatcmpl" if chat else "cmpl")
        created = now_s()
        kind = "chat.completion" if chat else "text_completion"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(
                _stream(handles, prompts, stops, chat, response_id, created, body, include_usage, received),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(_collect(handles, stops))
        gone = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():                # the client left: stop its requests, free their blocks
                collect.cancel()
                for handle in handles:
                    handle.abort()
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        results = collect.result()
        choices, completion_tokens = [], 0
        for index, (text, update_last, n_tokens, timings) in enumerate(results):
            completion_tokens += n_tokens
            choice = {"index": index, "finish_reason": _finish_reason(update_last, text), "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text.text}
            else:
                choice["text"] = text.text
            if body.return_timings:
                choice["timings"] = _timings(handles[index], update_last, received, timings, state.clock())
            choices.append(choice)
        errors = [u.error for _, u, _, _ in results if u.error]
        if errors:
            raise APIError(errors[0], status_code=500, type="server_error", code="engine_error")
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": response_id, "object": kind, "created": created, "model": state.config.model_name,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    async def _collect(handles: list[RequestHandle], stops: list[str]):
        async def one(handle):
            text = IncrementalText(state.tokenizer, stops)
            n_tokens, last, sent_times = 0, None, []
            async for update in handle:
                n_tokens += len(update.token_ids)
                text.add(update.token_ids, final=update.finished)
                sent_times.append(state.clock())
                last = update
                if text.stopped and not update.finished:
                    handle.abort()
                    last = Update([], True, "stop", None, update.engine_time_s)
                    break
            return text, last, n_tokens, sent_times
        return await asyncio.gather(*(one(h) for h in handles))

    def _timings(handle: RequestHandle, last: Update, received: float, sent_times: list[float], now: float) -> dict:
        """The request as the server and the engine saw it, in seconds from the server's receipt of it."""
        out = last.output
        return {
            "server_clock_received_s": received,   # the server's perf_counter (CLOCK_MONOTONIC on Linux)
            "server_received_s": 0.0,
            "engine_arrival_s": handle.engine_arrival_s - received,
            "engine_ttft_s": out.ttft_s if out is not None else None,
            "engine_queue_s": out.queue_s if out is not None else None,
            "engine_itl_s": list(out.itl_s) if out is not None else None,
            "engine_num_cached_tokens": out.num_cached_tokens if out is not None else None,
            "server_sent_s": [t - received for t in sent_times],
        }

    async def _stream(handles, prompts, stops, chat, response_id, created, body, include_usage, received):
        kind = "chat.completion.chunk" if chat else "text_completion"
        model_name = state.config.model_name
        queue: asyncio.Queue = asyncio.Queue()
        texts = [IncrementalText(state.tokenizer, stops) for _ in handles]
        counts = [0] * len(handles)
        sent_times: list[list[float]] = [[] for _ in handles]

        async def pump(index, handle):
            try:
                async for update in handle:
                    await queue.put((index, update))
                    if text_done[index]:
                        break
            except asyncio.CancelledError:
                raise

        text_done = [False] * len(handles)
        pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]

        def chunk(index, delta_text=None, finish=None, role=False):
            if chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                    delta["content"] = ""
                elif delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": index, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            return {"id": response_id, "object": kind, "created": created, "model": model_name, "choices": [choice]}

        finished = 0
        try:
            if chat:
                for i in range(len(handles)):
                    yield _sse(chunk(i, role=True))
            while finished < len(handles):
                index, update = await queue.get()
                if text_done[index]:
                    continue
                if update.error is not None:          # this request failed: an error event, then the stream ends
                    yield _sse(error_body(update.error, "server_error", code="engine_error"))
                    return
                counts[index] += len(update.token_ids)
                delta = texts[index].add(update.token_ids, final=update.finished)
                done = update.finished or texts[index].stopped
                if texts[index].stopped and not update.finished:
                    handles[index].abort()
                reason = _finish_reason(update, texts[index]) if done else None
                payload = chunk(index, delta, reason)
                if done and body.return_timings:
                    last = update if update.finished else Update([], True, "stop", None, update.engine_time_s)
                    payload["choices"][0]["timings"] = _timings(handles[index], last, received,
                                                                sent_times[index] + [state.clock()], state.clock())
                sent_times[index].append(state.clock())
                yield _sse(payload)
                if done:
                    text_done[index] = True
                    finished += 1
            if include_usage:
                prompt_tokens = sum(len(p) for p in prompts)
                completion_tokens = sum(counts)
                yield _sse({"id": response_id, "object": kind, "created": created, "model": model_name,
                            "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                     "completion_tokens": completion_tokens,
                                                     "total_tokens": prompt_tokens + completion_tokens}})
            yield _sse("[DONE]")
        finally:                                  # normal end, or the client went away (cancellation)
            for pump_task in pumps:
                pump_task.cancel()
            for handle in handles:
                handle.abort()

    @app.post("/v1/completions")
    async def completions(request: Request):
        received = state.clock()
        body = await read_body(request, CompletionRequest)
        prompts = await asyncio.to_thread(state.completion_prompts, body)     # tokenizing: off the event loop
        return await run(request, body, prompts, chat=False, received=received)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        received = state.clock()
        body = await read_body(request, ChatCompletionRequest)
        prompt = await asyncio.to_thread(state.chat_prompt, body)
        return await run(request, body, [prompt], chat=True, received=received)

    return app


class ServerThread:
    """uvicorn serving an app on a background thread (127.0.0.1, a free port by default); a context manager.

    Used by the tests and by notebooks that want the server in their own process. `stop()` asks
    uvicorn to shut down (in-flight requests drain for up to `drain_timeout_s`) and joins the thread.
    """

    def __init__(self, app, host: str = DEFAULT_HOST, port: int = 0, drain_timeout_s: float = 5.0,
                 log_level: str = "warning"):
        import socket

        import uvicorn
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = self._sock.getsockname()[:2]
        limits = uvicorn_options(app.state.server.config) if hasattr(app.state, "server") else {}
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=max(1, int(drain_timeout_s)),
                                access_log=False, lifespan="on", **limits)
        self.server = uvicorn.Server(config)
        self.app = app
        self._thread = threading.Thread(target=self._serve, name="llminfer-http", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self._sock])
        except BaseException as exc:  # pragma: no cover - reported by start()
            self._error = exc

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the server did not start: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 60.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
