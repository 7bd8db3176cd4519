"""Structured output through the server, with the official openai client over real HTTP on 127.0.0.1 (chapter 13):
response_format json_schema and json_object on the chat route, client.chat.completions.parse with a pydantic model,
vLLM's structured_outputs / guided_regex regex on /v1/completions; max_tokens inside the structure is "length"; a
constrained request beside a free one gets what each gets alone; bad patterns get a 400 before any compute, and the
disaggregated pair refuses structured output with a 400. Also the server's --prefix-cache radix answers as hash does."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
import torch
from test_serve import MODEL, bundled, client, make_server, server  # noqa: F401  (fixtures: a server of this module's own)
from test_serve_floats import idle_steps

from llminfer.serve.__main__ import build_server, parse_args
from llminfer.serve.disagg import DisaggregatedEngine, ModelSpec
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(180)

# Finite languages (bounded strings, enums), so a greedy answer always closes its document.
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                      "country": {"enum": ["France", "Peru", "Japan"]}},
     "required": ["city", "country"]},
    {"type": "object", "properties": {"capital": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"enum": ["big", "old", "cold"]},
                                               "maxItems": 3}},
     "required": ["capital"]},
    {"type": "object", "properties": {"answer": {"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8}, "rank": {"enum": [1, 2, 3]}},
        "required": ["name", "rank"]}}, "required": ["answer"]},
]
ASK = [{"role": "user", "content": "Give me the capital of France as JSON"}]
REGEX = r"(Paris|Rome|Lima) is [a-z]{1,8}\."


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "array", "nested"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_parse_and_validate(client, schema, temperature):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=90, temperature=temperature,
                                           seed=3, response_format=schema_format(schema))
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_parses(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give me the capital "
                                                                  "of Peru as JSON"}], max_tokens=90,
                                           temperature=0.0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


class Capital(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    country: Literal["France", "Peru"]
    big: bool


def test_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(model=MODEL, messages=ASK, max_tokens=90, temperature=0.0,
                                          response_format=Capital)
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed == Capital.model_validate_json(reply.choices[0].message.content)


@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}])
def test_a_regex_completion_matches_it(client, extra):
    reply = client.completions.create(model=MODEL, prompt=["The capital of France", "The capital of France"],
                                      max_tokens=30, temperature=0.0, extra_body=extra)
    texts = [c.text for c in reply.choices]
    assert texts[0] == texts[1] and re.fullmatch(REGEX, texts[0]), texts     # a fresh Constraint per prompt
    assert {c.finish_reason for c in reply.choices} == {"stop"}


@pytest.mark.parametrize("extra", [{"structured_outputs": {"json": json.dumps(SCHEMAS[0])}},
                                   {"guided_json": SCHEMAS[0]}])
def test_a_json_schema_completion_validates(client, extra):
    reply = client.completions.create(model=MODEL, prompt="The capital of Japan", max_tokens=60, temperature=0.0,
                                      extra_body=extra)
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMAS[0])


def test_a_streamed_structured_answer_is_the_whole_one(client):
    fields = dict(model=MODEL, messages=ASK, max_tokens=90, temperature=0.0, response_format=schema_format(SCHEMAS[1]))
    whole = client.chat.completions.create(**fields).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **fields))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_inside_the_structure_is_length(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, temperature=0.0,
                                           response_format=schema_format(SCHEMAS[0]))
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.content.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)


def test_a_constrained_and_a_free_request_together_get_what_they_get_alone(client):
    def constrained():
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60, temperature=0.0,
                                              response_format=schema_format(SCHEMAS[2])).choices[0].message.content

    def free():
        return client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=60,
                                              temperature=0.0).choices[0].message.content
    alone = (constrained(), free())
    assert alone[0] != alone[1]
    for _ in range(2):
        with ThreadPoolExecutor(4) as pool:
            together = [pool.submit(f) for f in (constrained, free, constrained, free)]
            assert [t.result() for t in together] == [*alone, *alone]


@pytest.mark.parametrize("extra,param,words", [
    ({"response_format": schema_format({"type": "object", "patternProperties": {"^a": {"type": "string"}}})},
     "response_format", "'patternProperties'"),
    ({"response_format": schema_format({"type": "strin"})}, "response_format", "'strin'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex", "both"),
    ({"extra_body": {"structured_outputs": {"choice": ["a", "b"]}}}, "structured_outputs.choice", "not supported"),
    ({"extra_body": {"structured_outputs": {"regex": "ab(c"}}}, "structured_outputs.regex", "at position 4"),
    ({"extra_body": {"guided_regex": "a{3,1}"}}, "guided_regex", "position"),
    ({"extra_body": {"guided_regex": "a", "ignore_eos": True}}, "ignore_eos", "guided_regex"),
])
def test_a_bad_structure_gets_400_naming_it_before_compute(client, server, extra, param, words):
    steps = idle_steps(server[1])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **extra)
    error = caught.value.response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert idle_steps(server[1]) == steps


def test_an_automaton_over_the_state_limit_gets_400_before_compute(bundled):  # noqa: F811
    thread, state = make_server(bundled, max_structured_states=20)
    with thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=60)
        steps = idle_steps(state)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="I love", max_tokens=4,
                                      extra_body={"structured_outputs": {"regex": "[a-z]{30}"}})
        error = caught.value.response.json()["error"]
        assert error["param"] == "structured_outputs.regex" and "max_states=20" in error["message"], error
        assert "--max-structured-states is 20" in error["message"]
        assert idle_steps(state) == steps
        ok = client.completions.create(model=MODEL, prompt="I love", max_tokens=8, temperature=0.0,
                                       extra_body={"structured_outputs": {"regex": "(Paris|Rome)"}})
        assert ok.choices[0].text in ("Paris", "Rome")


def test_the_limits_are_checked_where_they_are_set():
    with pytest.raises(ValueError, match="max_structured_states"):
        ServeConfig(max_structured_states=0)
    with pytest.raises(SystemExit):
        parse_args(["--max-structured-states", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--prefix-cache", "tree"])


def test_prefix_cache_flag_reaches_the_engine():
    for name in ("hash", "radix"):
        with torch.set_grad_enabled(torch.is_grad_enabled()):        # build_server turns autograd off: restore it
            app = build_server(parse_args(["--model", MODEL, "--prefix-cache", name, "--num-blocks", "64",
                                           "--max-structured-states", "5000"]))
        state = app.state.server
        assert state.engine.prefix_cache == name and state.config.max_structured_states == 5000


def test_a_radix_server_answers_as_a_hash_server(bundled, client):  # noqa: F811
    shared = "The capital of France is Paris. The capital of Peru is Lima. The capital of Japan is Tokyo. "
    prompts = [shared + "The capital of Spain", shared + "I love", shared + "The capital of Spain"]   # cache hits
    thread, state = make_server(bundled, engine_kwargs=dict(prefix_cache="radix"))
    with thread:
        radix = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for prompt in prompts:
            got = [c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0).choices[0].text
                   for c in (client, radix)]
            assert got[0] == got[1], (prompt, got)
        assert state.engine.prefix_cache == "radix" and state.engine.stats.prefix_hit_tokens > 0


def test_the_disaggregated_pair_refuses_structured_output_with_400(bundled):  # noqa: F811
    """Its workers take no constraint (a Constraint's state would have to cross from the prefill worker to the
    decode worker): a structured request is refused by name; a free one is served."""
    _, tokenizer = bundled
    pair = DisaggregatedEngine(ModelSpec(name=MODEL), dict(num_blocks=48)).start()
    state = OpenAIServer(None, tokenizer, ServeConfig(model_name=MODEL), engine=pair, close_engine=True)
    with ServerThread(build_app(server=state)) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           response_format={"type": "json_object"})
        error = caught.value.response.json()["error"]
        assert error["param"] == "response_format" and "DisaggregatedEngine" in error["message"], error
        assert client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4).choices[0].message.content
