"""Floats at the edges of float64 and float32 in a request: a 400 naming the field, the limit and the fix, before the
engine runs anything, on every route that takes sampling fields; the server answers the next request. Over real
HTTP on 127.0.0.1."""
from __future__ import annotations

import json
import time

import httpx
import pytest

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"
ROUTES = {"/v1/completions": {"prompt": "The capital of France"},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "The capital of France"}]}}


@pytest.fixture(scope="module")
def server():
    model, tokenizer = llminfer.load_pretrained(MODEL)
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL),
                         engine=LLMEngine(model, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256))
    with ServerThread(build_app(server=state), drain_timeout_s=2.0) as thread:
        yield thread, state


# (JSON text of the field's value, the field, words of the message); the literal text is sent as is, so 5e-324
# (float64's smallest subnormal), 1e400 (inf once parsed) and NaN reach the server as a client would send them.
EDGES = [
    ("1e-45", "temperature", "below 1.18e-38, the smallest normal float32, where it becomes a subnormal number; "
                             "pass temperature=0 for greedy decoding"),
    ("1e-300", "temperature", "below 1.18e-38, the smallest normal float32, where it becomes 0"),
    ("5e-324", "temperature", "below 1.18e-38"),
    ("1e39", "temperature", "beyond 3.403e+38, the largest float32, where it becomes inf"),
    ("1e400", "temperature", "is not finite"),
    ("1e-300", "top_p", "below 1.18e-38, the smallest normal float32, where it becomes 0; pass top_p from 1.18e-38 "
                        "to 1"),
    ("1e-40", "top_p", "where it becomes a subnormal number"),
    ("NaN", "top_p", "is not a number"),
    ("1e-300", "frequency_penalty", "where it becomes 0; pass frequency_penalty from -2 to 2 (0: none)"),
    ("-1e39", "presence_penalty", "where it becomes inf; pass presence_penalty from -2 to 2 (0: none)"),
    ("1e-300", "min_p", "where it becomes 0; pass min_p from 1.18e-38 to 1, or 0 for no min-p cut"),
    ("1e39", "repetition_penalty", "where it becomes inf; pass a repetition_penalty > 0 (1: none)"),
    ('{"5": 1e-320}', "logit_bias.5", "where it becomes 0; logit_bias is not supported"),
]


def idle_steps(state: OpenAIServer, timeout_s: float = 10.0) -> int:
    """The engine loop's step count once the last request's final step has been counted (its pool is empty)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = state.loop.stats
        if stats.blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return stats.steps
        time.sleep(0.005)
    raise AssertionError("the engine did not go idle")


def post(thread, route: str, fields: str) -> httpx.Response:
    """POST a body whose sampling fields are spliced in as raw JSON text."""
    body = json.dumps({"model": MODEL, "max_tokens": 4, **ROUTES[route]})
    return httpx.post(thread.url + route, content=body[:-1] + ", " + fields + "}",
                      headers={"Content-Type": "application/json"}, timeout=30)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("text,field,words", EDGES, ids=[f"{f}={t}" for t, f, _ in EDGES])
def test_a_float_that_float32_cannot_hold_gets_400_before_compute(server, route, text, field, words):
    thread, state = server
    steps = idle_steps(state)
    name = field.split(".")[0]
    response = post(thread, route, f'"{name}": {text}')
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field, error
    assert words in error["message"] and error["message"].startswith(f"{field}="), error["message"]
    assert state.loop.stats.steps == steps                    # refused before the engine ran anything
    good = post(thread, route, '"temperature": 0')            # and the server answers the next request
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("route", list(ROUTES))
def test_floats_just_inside_float32_are_served(server, route):
    """The limits are float32's: its smallest normal number as top_p and as temperature are honoured (both amount
    to greedy decoding, so the text is the greedy one)."""
    thread, _ = server
    greedy = post(thread, route, '"temperature": 0').json()["choices"][0]
    for fields in ('"temperature": 1.1754943508222875e-38', '"temperature": 1.0, "top_p": 1.1754943508222875e-38'):
        response = post(thread, route, fields)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0] == greedy
