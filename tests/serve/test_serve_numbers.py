"""Numbers and sizes: integers too long to parse or out of range, and huge prompt lists, refused with a 400 naming the
field before any work, over real HTTP on 127.0.0.1."""
from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
HUGE = "9" * 5000                  # beyond Python's 4,300-digit limit for converting text to an int


@pytest.fixture(scope="module")
def server():
    model, tokenizer = llminfer.load_pretrained(MODEL)
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL),
                         engine=LLMEngine(model, num_blocks=64, max_num_seqs=8))
    with ServerThread(build_app(server=state)) as thread:
        yield thread, state


def post(thread, path: str, body: str | dict) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    return httpx.post(thread.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60)


def clean_400(response: httpx.Response) -> dict:
    """The response is a 400 with an OpenAI error body and no traceback, file path or echo of the huge number."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "Traceback" not in response.text and ".py" not in response.text and HUGE[:300] not in response.text
    return error


COMPLETION = '{"model":"tiny-capitals","prompt":"The capital of France","max_tokens":4,%s}'
CHAT = '{"model":"tiny-capitals","messages":[{"role":"user","content":"hi"}],"max_tokens":4,%s}'
TOO_LONG = [  # (route, body, the field the 400 must name)
    ("/v1/completions", COMPLETION % f'"seed":{HUGE}', "seed"),
    ("/v1/completions", COMPLETION % f'"top_k":-{HUGE}', "top_k"),
    ("/v1/completions", COMPLETION % f'"n":{HUGE}', "n"),
    ("/v1/completions", COMPLETION % f'"temperature":{HUGE}', "temperature"),
    ("/v1/completions", COMPLETION % f'"logit_bias":{{"5":{HUGE}}}', "logit_bias.5"),
    ("/v1/completions", '{"model":"tiny-capitals","prompt":"hi","max_tokens":%s}' % HUGE, "max_tokens"),
    ("/v1/completions", '{"model":"tiny-capitals","prompt":[5,%s],"max_tokens":2}' % HUGE, "prompt.1"),
    ("/v1/completions", '{"model":"tiny-capitals","prompt":[[5],[6,%s]],"max_tokens":2}' % HUGE, "prompt.1.1"),
    ("/v1/completions", COMPLETION % f'"stream":true,"stream_options":{{"include_usage":{HUGE}}}',
     "stream_options.include_usage"),
    ("/v1/chat/completions", CHAT % f'"max_completion_tokens":{HUGE}', "max_completion_tokens"),
    ("/v1/chat/completions", CHAT % f'"response_format":{{"type":"text","x":{{"y":{HUGE}}}}}', "response_format.x.y"),
    ("/v1/chat/completions", '{"model":"tiny-capitals","messages":[{"role":"user","content":[{"type":"text",'
                             '"text":"hi","n":%s}]}]}' % HUGE, "messages.0.content.0.n"),
]


@pytest.mark.parametrize("route, body, field", TOO_LONG, ids=[f for _, _, f in TOO_LONG])
def test_integers_too_long_to_parse_get_400_naming_the_field(server, caplog, route, body, field):
    thread, state = server
    caplog.set_level(logging.INFO)
    error = clean_400(post(thread, route, body))
    assert error["param"] == field and field in error["message"] and "5000 digits" in error["message"]
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 1 and field in refused[0].getMessage()         # one line for the refused request
    assert not any(r.exc_info for r in caplog.records)                     # and no traceback anywhere
    assert httpx.get(thread.url + "/health").status_code == 200


BOUNDED = [  # (route, field, value): one past the field's limit (2**63 - 1; the seed's is 2**64 - 1)
    ("/v1/completions", "max_tokens", 2**63), ("/v1/completions", "top_k", 2**64), ("/v1/completions", "n", 2**63),
    ("/v1/completions", "best_of", 2**63), ("/v1/completions", "logprobs", 2**63), ("/v1/completions", "seed", 2**64),
    ("/v1/completions", "seed", -2**63 - 1), ("/v1/completions", "top_k", -2**63 - 1),
    ("/v1/chat/completions", "max_completion_tokens", 2**63), ("/v1/chat/completions", "top_logprobs", 2**63),
]


@pytest.mark.parametrize("route, field, value", BOUNDED, ids=[f"{f}={v}" for _, f, v in BOUNDED])
def test_every_integer_field_is_bounded(server, route, field, value):
    thread, _ = server
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if "chat" not in route else {"messages": [{"role": "user", "content": "hi"}]})
    error = clean_400(post(thread, route, body))
    assert error["param"] == field and field in error["message"]


def test_integers_inside_the_limits_still_work(server):
    thread, _ = server
    for extra in ({"seed": 2**64 - 1, "temperature": 1.0}, {"seed": -2**63, "temperature": 1.0},
                  {"top_k": 2**63 - 1, "temperature": 1.0}):
        response = post(thread, "/v1/completions", {"model": MODEL, "prompt": "The capital of France",
                                                    "max_tokens": 2, **extra})
        assert response.status_code == 200, (extra, response.text)
    ids = post(thread, "/v1/completions", {"model": MODEL, "prompt": [[5, 6], [7]], "max_tokens": 2})
    assert ids.status_code == 200 and len(ids.json()["choices"]) == 2


@pytest.fixture
def no_work(server, monkeypatch):
    """Records every tokenization and every schema validation on the server (there must be none), and the threads
    that parse bodies."""
    thread, state = server
    calls, parsers = [], []
    encode, parse = state.tokenizer.encode, state.parse_body
    monkeypatch.setattr(state.tokenizer, "encode", lambda *a, **k: calls.append("encode") or encode(*a, **k))
    monkeypatch.setattr(state, "parse_body",
                        lambda *a, **k: parsers.append(threading.current_thread().name) or parse(*a, **k))
    return calls, parsers


def test_huge_prompt_lists_are_refused_before_any_per_prompt_work(server, no_work):
    thread, state = server
    calls, parsers = no_work
    lists = clean_400(post(thread, "/v1/completions", {"model": MODEL, "prompt": [[5]] * 900_000}))
    assert lists["code"] == "too_many_values" and str(state.max_json_containers) in lists["message"]
    assert lists["param"] == "prompt"                           # counted as the body arrived, before parsing
    strings = clean_400(post(thread, "/v1/completions", {"model": MODEL, "prompt": ["a"] * 900_000}))
    assert strings["code"] == "too_many_prompts" and f"at most {state.loop.max_queued_requests}" in strings["message"]
    ids = clean_400(post(thread, "/v1/completions", {"model": MODEL, "prompt": [5] * 1_300_000}))
    assert ids["code"] == "too_many_values" and str(state.max_json_values) in ids["message"]
    over = state.loop.max_queued_requests + 1
    texts = clean_400(post(thread, "/v1/completions", {"model": MODEL, "prompt": ["The capital"] * over}))
    assert texts["code"] == "too_many_prompts" and f"at most {over - 1}" in texts["message"]
    long_ids = clean_400(post(thread, "/v1/completions",
                              {"model": MODEL, "prompt": [[5], [5] * (state.max_model_len + 1)]}))
    assert long_ids["code"] == "context_length_exceeded" and "prompt[1]" in long_ids["message"]
    long_text = clean_400(post(thread, "/v1/completions",
                               {"model": MODEL, "prompt": ["hi", "a" * (state.max_prompt_chars + 1)]}))
    assert long_text["code"] == "context_length_exceeded" and "prompt[1]" in long_text["message"]
    messages = clean_400(post(thread, "/v1/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "a" * 1000}] * 3000}))
    assert messages["param"] == "messages" and "3000 messages" in messages["message"]
    assert calls == []                                          # nothing was tokenized
    assert parsers and all(name != "llminfer-http" for name in parsers)   # bodies parse off the event loop
    # brackets inside strings are text, not lists
    quoted = post(thread, "/v1/completions", {"model": MODEL, "prompt": ["[[{" * 20, "{]" * 30], "max_tokens": 1})
    assert quoted.status_code == 200 and calls


def test_a_token_list_as_long_as_the_context_leaves_no_room(server):
    thread, state = server
    error = clean_400(post(thread, "/v1/completions", {"model": MODEL, "prompt": [5] * state.max_model_len}))
    assert error["code"] == "context_length_exceeded"
