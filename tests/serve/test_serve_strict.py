"""Strict where OpenAI is strict: unknown values of the enumerated chat fields, a response_format without its type,
stream_options without streaming and a bad max_tokens beside max_completion_tokens are 400s naming the field sent;
over real HTTP on 127.0.0.1 (httpx and the openai client)."""
from __future__ import annotations

import httpx
import openai
import pytest

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "The capital of France"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "The capital of France", "max_tokens": 2}


@pytest.fixture(scope="module")
def server():
    model, tokenizer = llminfer.load_pretrained(MODEL)
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL),
                         engine=LLMEngine(model, num_blocks=32, max_num_seqs=4))
    with ServerThread(build_app(server=state)) as thread:
        yield thread


def error_of(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


REFUSED = [  # (extra chat fields, the param named, words the message holds)
    ({"modalities": ["audio"]}, "modalities", "text"),
    ({"modalities": ["text", "audio"]}, "modalities", "text"),
    ({"modalities": ["video"]}, "modalities.0", "'text'"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "'medium'"),
    ({"service_tier": "platinum"}, "service_tier", "'auto'"),
    ({"verbosity": "1"}, "verbosity", "'high'"),
    ({"response_format": {}}, "response_format.type", "response_format.type"),
    ({"response_format": {"type": "text", "strict": True}}, "response_format.strict", "Unrecognized"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_object'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format", "not supported"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options", "stream"),
    ({"max_tokens": -1, "max_completion_tokens": 4}, "max_tokens", "at least 1"),
    ({"max_tokens": 10**30, "max_completion_tokens": 4}, "max_tokens", "integer at max_tokens"),
    ({"max_tokens": 4, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens=0"),
    ({"max_completion_tokens": 10_000}, "max_completion_tokens", "max_completion_tokens <="),
    ({"top_k": 2**63}, "top_k", "less than or equal"),
]


@pytest.mark.parametrize("extra, param, words", REFUSED, ids=[p for _, p, _ in REFUSED])
def test_wrong_values_are_refused_naming_the_field(server, extra, param, words):
    error = error_of(httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60))
    assert error["param"] == param and words in error["message"], error


def test_the_openai_client_sees_the_400(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**CHAT, reasoning_effort="extreme")
    assert refused.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**COMPLETION, stream_options={"include_usage": True})
    assert refused.value.body["param"] == "stream_options"


def test_the_accepted_values_still_work(server):
    for extra in ({"modalities": ["text"]}, {"reasoning_effort": "low"}, {"service_tier": "auto"},
                  {"verbosity": "medium"}, {"response_format": {"type": "text"}}, {"max_completion_tokens": 3},
                  {"max_tokens": 5, "max_completion_tokens": 3}):
        response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, **extra}, timeout=60)
        assert response.status_code == 200, (extra, response.text)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    chunks = list(client.completions.create(**COMPLETION, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None
