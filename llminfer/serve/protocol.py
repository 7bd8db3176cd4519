"""The OpenAI request and response shapes the server speaks, and its errors. Chapter 11.

Requests are pydantic models with `extra="forbid"`: a field the OpenAI API does not define is refused
with HTTP 400, as the OpenAI API refuses it ("Unrecognized request argument supplied: ..."). Fields the
API defines but this server does not implement (n > 1, logprobs, tools, logit_bias, ...) are accepted at
their neutral value and refused with a 400 that names them otherwise, so a client never gets silently
different behaviour. presence_penalty, frequency_penalty and seed are the OpenAI fields of chapter 13's sampling
pipeline. Extensions, spelled as vLLM spells them, ride in the same body (`extra_body=` in the openai client):
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `structured_outputs` {"regex"} or {"json"} (vLLM 0.11's name;
its older `guided_regex` and `guided_json` too: chapter 13's constrained output, beside the chat route's OpenAI
`response_format`), and `return_timings` (the server's and the engine's view of the request's timings, chapter
11's serving-overhead measurement).
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..checks import FLOAT32_MAX, FLOAT32_TINY, INT64_MAX, SEED_RANGE, check_processors, float32_edge

__all__ = ["APIError", "error_body", "CompletionRequest", "ChatCompletionRequest", "ChatMessage",
           "StreamOptions", "ResponseFormat", "JSONSchemaFormat", "StructuredOutputs", "output_structure",
           "check_float_fields", "check_processor_fields", "check_sampling_fields",
           "new_id", "now_s"]


class APIError(Exception):
    """An error the client caused (or a refusal), sent as an OpenAI error body with its HTTP status. Chapter 11."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}: the shape of every OpenAI error response."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    """A response id in OpenAI's style, e.g. 'cmpl-3f2a...'."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """Unix time in whole seconds: the `created` field."""
    return int(time.time())


Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]        # every integer field, unless bounded closer
Count = Annotated[int, Field(le=INT64_MAX)]                            # a count or length (its minimum checked later)
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]       # what a random generator takes


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class JSONSchemaFormat(BaseModel):
    """response_format.json_schema, OpenAI's structured outputs: the output is a JSON document valid against `schema`
    (chapter 13's compiler; `strict` is accepted either way: the output always follows the schema)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """response_format: "text" (free text), "json_object" (one JSON object) or "json_schema" (valid against it)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra field (vLLM 0.11 and later): `regex` or `json` (a JSON Schema, or its text).
    vLLM's other keys are refused by name."""
    model_config = ConfigDict(extra="forbid", strict=True)
    regex: str | None = None
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None


class _Sampling(BaseModel):
    """The fields the two endpoints share."""
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: Count | None = None
    seed: Seed | None = None
    stop: Union[str, list[str], None] = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # extensions (vLLM's names)
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    return_timings: bool = False
    structured_outputs: StructuredOutputs | None = None       # chapter 13; vLLM 0.11's spelling
    guided_regex: str | None = None                           # vLLM's older spellings of the same (before 0.12)
    guided_json: Union[dict[str, Any], str, None] = None


class CompletionRequest(_Sampling):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""
    prompt: Union[str, list[str], list[Int64], list[list[Int64]]]
    max_tokens: Count | None = 16                    # the OpenAI default for completions
    best_of: Count | None = None
    echo: bool | None = False
    logprobs: Count | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage]
    max_tokens: Count | None = None                # None: as many as the context allows
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: Count | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Union[str, dict[str, Any], None] = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


_UNSUPPORTED_IF_SET = {
    # field: (neutral values, what to say)
    "n": ((None, 1), "this server returns one choice per prompt; pass n=1"),
    "best_of": ((None, 1), "this server returns one choice per prompt; pass best_of=1"),
    "echo": ((None, False), "echo is not supported; leave it false"),
    "logprobs": ((None, False, 0), "log-probabilities are not returned by this server; leave logprobs unset"),
    "top_logprobs": ((None, 0), "log-probabilities are not returned by this server; leave top_logprobs unset"),
    "suffix": ((None, ""), "suffix (insertion) is not supported; leave it unset"),
    "logit_bias": ((None,), "logit_bias is not supported; leave it unset"),
    "tools": ((None,), "tool calling is not supported by this server; leave tools unset"),
    "functions": ((None,), "function calling is not supported by this server; leave functions unset"),
    "tool_choice": ((None, "none"), "tool calling is not supported by this server; leave tool_choice unset"),
    "function_call": ((None, "none"), "function calling is not supported; leave function_call unset"),
}


def _floats(request: BaseModel, where: str = ""):
    """(field path, value) of every float the parsed request carries, in its nested models and containers too."""
    stack = [(where, request)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float):
            yield path, value
        elif isinstance(value, BaseModel):
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in value)
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))


def check_float_fields(request: BaseModel) -> None:
    """APIError (400) for a float in the request that float32, where sampling computes, cannot hold as itself: NaN,
    inf, a subnormal, or a value that becomes 0 or inf there (temperature=1e-45, top_p=1e-300, 1e39). Chapter 11."""
    for where, value in _floats(request):
        problem = float32_edge(value)
        if problem is not None:
            name = where.split(".")[0]
            fix = _FLOAT_FIXES.get(name) or (_UNSUPPORTED_IF_SET[name][1] if name in _UNSUPPORTED_IF_SET else
                                             f"pass 0 or a value from {FLOAT32_TINY:.3g} to {FLOAT32_MAX:.3g}")
            raise APIError(f"{where}={value!r} is invalid: it {problem}; {fix}", param=where)


_FLOAT_FIXES = {
    "temperature": "pass temperature=0 for greedy decoding, or a temperature from 1.18e-38 to 2",
    "top_p": "pass top_p from 1.18e-38 to 1 (any top_p that small keeps only the most likely token)",
    "min_p": "pass min_p from 1.18e-38 to 1, or 0 for no min-p cut",
    "repetition_penalty": "pass a repetition_penalty > 0 (1: none)",
    "presence_penalty": "pass presence_penalty from -2 to 2 (0: none)",
    "frequency_penalty": "pass frequency_penalty from -2 to 2 (0: none)",
}


def check_processor_fields(request: _Sampling) -> None:
    """APIError (400) naming min_p, repetition_penalty, presence_penalty or frequency_penalty out of its range
    (`checks.check_processors`' ranges, its message). Chapter 13."""
    for name in ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(request, name)
        if value is not None:
            try:
                check_processors(**{name: value})
            except ValueError as exc:
                raise APIError(str(exc), param=name) from None


_VLLM_UNSUPPORTED = ("choice", "grammar", "json_object", "structural_tag", "whitespace_pattern")


def output_structure(request: _Sampling) -> tuple[str, Any, str] | None:
    """What the output must match, or None for free text: ("regex", pattern, param), ("schema", schema, param) or
    ("json_object", None, param), where param names the field a 400 about it names. Chapter 13.

    The chat route's response_format, and on both routes vLLM's extra fields: `structured_outputs` {"regex": ...}
    or {"json": ...} (vLLM 0.11 and later) and the older `guided_regex` / `guided_json`. Two at once are a 400."""
    found = []
    fmt = getattr(request, "response_format", None)
    if fmt is not None and fmt.type != "json_schema" and fmt.json_schema is not None:
        raise APIError(f"response_format.json_schema is only read with type 'json_schema', got type {fmt.type!r}; "
                       "drop json_schema or pass type 'json_schema'", param="response_format")
    if fmt is not None and fmt.type == "json_object":
        found.append(("json_object", None, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format of type 'json_schema' needs json_schema: {\"name\": ..., \"schema\": "
                           "{...}}", param="response_format")
        found.append(("schema", fmt.json_schema.schema_, "response_format"))
    outputs = request.structured_outputs
    if outputs is not None:
        for key in _VLLM_UNSUPPORTED:
            if getattr(outputs, key) is not None:
                raise APIError(f"structured_outputs.{key} is not supported by this server; pass "
                               "structured_outputs.regex or structured_outputs.json", param=f"structured_outputs.{key}")
        found += [(kind, value, f"structured_outputs.{name}") for kind, name, value in
                  (("regex", "regex", outputs.regex), ("schema", "json", outputs.json_)) if value is not None]
    found += [(kind, value, name) for kind, name, value in (("regex", "guided_regex", request.guided_regex),
                                                            ("schema", "guided_json", request.guided_json))
              if value is not None]
    if len(found) > 1:
        raise APIError(f"{found[0][2]} and {found[1][2]} both constrain the output; pass one of them",
                       param=found[1][2])
    return found[0] if found else None


def check_sampling_fields(request: _Sampling) -> None:
    """APIError (400) for a value the OpenAI API allows but this server cannot honour, or one out of range
    (every float first: it must survive float32). Chapter 11."""
    check_float_fields(request)
    for name, (neutral, fix) in _UNSUPPORTED_IF_SET.items():
        if name in type(request).model_fields:
            value = getattr(request, name)
            if name == "logit_bias" and value == {}:
                continue
            if value not in neutral:
                raise APIError(f"{name}={value!r} is not supported: {fix}", param=name)
    structure = output_structure(request)     # its shape; the pattern is compiled later, off the event loop
    if structure is not None and request.ignore_eos:
        raise APIError(f"ignore_eos=true cannot go with {structure[2]}: a structured output ends where its pattern "
                       "does, with the end-of-sequence token; drop ignore_eos", param="ignore_eos")
    if request.stream_options is not None and not request.stream:
        raise APIError("stream_options is only allowed when stream is true; drop it or pass stream=true",
                       param="stream_options")
    if isinstance(request, ChatCompletionRequest):
        if request.modalities is not None and request.modalities != ["text"]:
            raise APIError(f"modalities={request.modalities!r} is not supported: this server makes text only; pass "
                           "[\"text\"] or leave it unset", param="modalities")
        for name in ("max_tokens", "max_completion_tokens"):      # both checked, whichever one is used
            value = getattr(request, name)
            if value is not None and value < 1:
                raise APIError(f"{name}={value} is invalid: it must be at least 1", param=name)
    t = request.temperature
    if t is not None and (not math.isfinite(t) or not 0 <= t <= 2):
        raise APIError(f"temperature={t!r} is invalid: it must be a number from 0 to 2 (0: greedy)",
                       param="temperature")
    p = request.top_p
    if p is not None and (not math.isfinite(p) or not 0 < p <= 1):
        raise APIError(f"top_p={p!r} is invalid: it must lie in (0, 1] (1: no nucleus cut)", param="top_p")
    k = request.top_k
    if k is not None and k < -1:
        raise APIError(f"top_k={k!r} is invalid: it must be >= 1, or -1, 0 or unset for no cut", param="top_k")
    check_processor_fields(request)
    stops = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stops) > 4:
        raise APIError(f"stop holds {len(stops)} sequences; at most 4 are allowed", param="stop")
    if any(s == "" for s in stops):
        raise APIError("stop sequences must not be empty strings", param="stop")
