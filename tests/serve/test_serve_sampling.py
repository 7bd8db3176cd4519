"""The sampling pipeline through the server, with the official openai client over real HTTP on 127.0.0.1: the OpenAI
fields presence_penalty, frequency_penalty and seed, vLLM's extra top_k, min_p and repetition_penalty; a seeded
request repeats and draws what generate draws; bad values get a 400 naming the field before any compute."""
from __future__ import annotations

import openai
import pytest
from test_serve import MODEL, bundled, client, make_server, server  # noqa: F401  (fixtures: a server of this module's own)
from test_serve_floats import idle_steps

import llminfer
from llminfer.engine import LLMEngine, SamplingParams
from llminfer.serve.disagg import DisaggregatedEngine, ModelSpec
from llminfer.serve.protocol import ChatCompletionRequest

pytestmark = pytest.mark.timeout(120)

PENALTIES = dict(presence_penalty=0.5, frequency_penalty=0.3)
EXTRA = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.3}
KEYWORDS = dict(temperature=1.0, seed=7, **PENALTIES, **EXTRA)          # the same settings as generate's keywords


def generated(bundled, prompt_ids: list[int], max_tokens: int, **settings) -> str:  # noqa: F811
    model, tokenizer = bundled
    result = llminfer.generate(model, prompt_ids, max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id,
                               **settings)
    return tokenizer.decode(result.token_ids)


@pytest.mark.parametrize("prompt", ["The capital of France", "I love", "The sky is"])
def test_a_seeded_completion_repeats_and_is_generates(bundled, client, prompt):  # noqa: F811
    _, tokenizer = bundled
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=7,
                                       **PENALTIES, extra_body=EXTRA).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]
    assert texts[0] == generated(bundled, tokenizer.encode(prompt), 12, **KEYWORDS)


def test_a_seeded_chat_completion_is_generates(bundled, client, server):  # noqa: F811
    messages = [{"role": "user", "content": "What is the capital of Peru?"}]
    ids = server[1].chat_prompt(ChatCompletionRequest(model=MODEL, messages=messages))
    for settings, extra in ((KEYWORDS, EXTRA), (dict(repetition_penalty=3.0, frequency_penalty=1.0),
                                               {"repetition_penalty": 3.0})):
        fields = {k: v for k, v in settings.items() if k not in extra}
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, extra_body=extra,
                                               **({"temperature": 0.0} | fields))
        expected = generated(bundled, ids, 12, **({"temperature": 0.0} | settings))
        assert reply.choices[0].message.content == expected


def test_top_k_minus_one_and_zero_are_no_cut(client):
    texts = {k: client.completions.create(model=MODEL, prompt="I love", max_tokens=8, temperature=1.3, seed=5,
                                          extra_body={} if k is None else {"top_k": k}).choices[0].text
             for k in (None, -1, 0)}
    assert len(set(texts.values())) == 1, texts


@pytest.mark.parametrize("field,value,words", [
    ("presence_penalty", 2.5, "presence_penalty must lie in -2.0..2.0"),
    ("frequency_penalty", -3.0, "frequency_penalty must lie in -2.0..2.0"),
    ("min_p", 1.5, "min_p must lie in 0..1"),
    ("min_p", -0.5, "min_p must lie in 0..1"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", -1.0, "repetition_penalty must be > 0"),
    ("top_k", -2, "top_k=-2 is invalid: it must be >= 1, or -1, 0 or unset for no cut"),
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_bad_value_gets_400_naming_it_before_compute(client, server, route, field, value, words):
    steps = idle_steps(server[1])
    official = field in ("presence_penalty", "frequency_penalty")
    fields = {field: value} if official else {"extra_body": {field: value}}
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "completions":
            client.completions.create(model=MODEL, prompt="I love", max_tokens=4, **fields)
        else:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           **fields)
    error = caught.value.response.json()["error"]
    assert error["param"] == field and words in error["message"] and str(value) in error["message"], error
    assert idle_steps(server[1]) == steps                     # refused before the engine ran anything


def test_the_disaggregated_pair_draws_the_colocated_engines_tokens(bundled):  # noqa: F811
    """The prefill worker samples the first token through the same pipeline (the prompt is the repetition
    penalty's history there), the decode worker the rest: seeded and penalised requests match one engine."""
    model, tokenizer = bundled
    repeats = "The capital of France is Paris. The capital of"          # the penalty changes the first token
    prompts = [tokenizer.encode(t) for t in ("The capital of France", repeats, "The sky is")]
    params = [SamplingParams(max_new_tokens=10, temperature=1.0, seed=3, min_p=0.05, repetition_penalty=1.3,
                             **PENALTIES),
              SamplingParams(max_new_tokens=10, repetition_penalty=3.0, frequency_penalty=1.0),
              SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, seed=9)]
    colocated = LLMEngine(model, num_blocks=96).generate(prompts, params)
    assert colocated[1].token_ids[0] != llminfer.generate(model, prompts[1], 1).token_ids[0]
    with DisaggregatedEngine(ModelSpec(name=MODEL), dict(num_blocks=96)) as engine:
        assert [o.token_ids for o in engine.generate(prompts, params)] == [c.token_ids for c in colocated]
