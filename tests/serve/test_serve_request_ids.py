"""A request's token ids are checked once on their way from the server to the scheduler; a library caller of
LLMEngine.add_request still gets the whole check, with the same messages."""
from __future__ import annotations

import dataclasses
import pickle
import sys

import httpx
import pytest

import llminfer
from llminfer.engine import LLMEngine, PromptIds, SamplingParams
from llminfer.engine import requests as engine_requests
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny-capitals"


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained(MODEL)


@pytest.fixture
def vocabulary_checks(monkeypatch):
    """The shapes of every id tensor that the one request check reads against the vocabulary, in call order."""
    module = sys.modules[engine_requests.check_request.__module__]        # where the one request check lives
    real = module.check_token_ids
    seen = []

    def counted(ids, vocab_size):
        seen.append(tuple(ids.shape))
        return real(ids, vocab_size)

    monkeypatch.setattr(module, "check_token_ids", counted)
    return seen


@pytest.mark.parametrize("bad", [[3, 1024], [3, -1], [3, 2.5], "The capital of France", [[3, 4], [5, 6]], []])
def test_a_library_caller_still_gets_the_whole_check_with_the_same_message(bundled, bad):
    model, _ = bundled
    engine = LLMEngine(model, num_blocks=16)
    with pytest.raises(ValueError) as direct:                            # the one request check, called directly
        engine_requests.check_request(model.config, bad, 4, single=True)
    callers = [lambda: engine.add_request(bad, SamplingParams(max_new_tokens=4)), lambda: PromptIds(model.config, bad)]
    if bad != [[3, 4], [5, 6]]:                                          # to generate, that is two prompts
        callers.append(lambda: engine.generate([bad], SamplingParams(max_new_tokens=4)))
    for caller in callers:
        with pytest.raises(ValueError) as refused:
            caller()
        assert str(refused.value) == str(direct.value)
    assert not engine.has_unfinished() and engine.stats.steps == 0


def test_the_messages_name_the_id_and_the_vocabulary(bundled):
    model, _ = bundled
    engine = LLMEngine(model, num_blocks=16)
    with pytest.raises(ValueError, match=r"token id 1024 is outside the vocabulary of 1024 ids \(valid ids are "
                                         r"0\.\.1023\)"):
        engine.add_request([3, 1024])
    small = llminfer.load_random(dataclasses.replace(model.config, vocab_size=500), device="cpu")
    checked_for_the_larger = PromptIds(model.config, [3, 700])
    with pytest.raises(ValueError, match="token id 700 is outside the vocabulary of 500 ids"):
        LLMEngine(small, num_blocks=16).add_request(checked_for_the_larger)    # checked again for another model


def test_a_library_caller_is_checked_once(bundled, vocabulary_checks):
    model, tokenizer = bundled
    engine = LLMEngine(model, num_blocks=16)
    prompt = tokenizer.encode("The capital of France")
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens=3))
    assert vocabulary_checks == [(1, len(prompt))]
    checked = PromptIds(model.config, prompt)
    assert vocabulary_checks == [(1, len(prompt))] * 2 and list(checked) == prompt
    assert PromptIds(model.config, checked) is checked                         # not checked again
    assert type(pickle.loads(pickle.dumps(checked))) is list                   # another process checks again
    second = engine.add_request(checked, SamplingParams(max_new_tokens=3))
    assert vocabulary_checks == [(1, len(prompt))] * 2                         # taken as checked
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output(request_id).token_ids == engine.pop_output(second).token_ids


def test_the_server_checks_a_requests_ids_once(bundled, vocabulary_checks):
    model, tokenizer = bundled
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL), engine=LLMEngine(model, num_blocks=64))
    prompt = tokenizer.encode("The capital of France")
    expected = LLMEngine(model, num_blocks=16).generate([prompt], SamplingParams(max_new_tokens=4))[0].token_ids
    vocabulary_checks.clear()                                                # the reference's own check
    with ServerThread(build_app(server=state)) as server:
        def complete(path, **body):
            return httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True, **body}, timeout=60)

        response = complete("/v1/completions", prompt=prompt)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == tokenizer.decode(expected)
        assert vocabulary_checks == [(1, len(prompt))]                       # once, from the server to the scheduler
        vocabulary_checks.clear()
        assert complete("/v1/completions", prompt="The capital of France").status_code == 200
        assert complete("/v1/completions", prompt=[prompt, prompt[:2]]).status_code == 200
        assert complete("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}]).status_code == 200
        assert [shape[0] for shape in vocabulary_checks] == [1] * 4          # one check per prompt
        assert vocabulary_checks[1:3] == [(1, len(prompt)), (1, 2)]
        vocabulary_checks.clear()
        refused = complete("/v1/completions", prompt=[prompt, [3, tokenizer.vocab_size]])
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["param"] == "prompt" and error["message"].startswith(
            f"prompt[1]: token id {tokenizer.vocab_size} is outside the vocabulary of {tokenizer.vocab_size} ids")
        assert vocabulary_checks == [(1, len(prompt)), (1, 2)]
        assert state.engine.stats.num_finished == 5 and not state.engine.has_unfinished()  # nothing of it queued
