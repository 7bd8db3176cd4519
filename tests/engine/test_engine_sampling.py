"""The sampling pipeline in the engine: a request's min-p and penalties draw what generate draws with the same
keywords and seed, a batch of mixed requests draws what each draws alone, and bad values are refused when the
params are made."""
from __future__ import annotations

import random

import pytest

import llminfer
from llminfer.engine import LLMEngine, SamplingParams

PROCESSED = [SamplingParams(max_new_tokens=10, temperature=1.0, top_k=40, min_p=0.05, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.3, seed=3),
             SamplingParams(max_new_tokens=10),                                               # greedy
             SamplingParams(max_new_tokens=10, repetition_penalty=2.5, frequency_penalty=1.0),  # greedy, penalised
             SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, presence_penalty=-0.5, seed=11),
             SamplingParams(max_new_tokens=10, temperature=1.3, min_p=0.2, seed=12)]


@pytest.fixture(scope="module")
def capitals():
    return llminfer.load_pretrained("tiny-capitals")


def engine_for(model, **kwargs) -> LLMEngine:
    return LLMEngine(model, block_size=4, num_blocks=96, max_model_len=64, **kwargs)


def prompts(tokenizer) -> list[list[int]]:
    texts = ["The capital of France", "I love", "The capital of Japan is", "The sky", "What is the capital of Peru?"]
    return [tokenizer.encode(text) for text in texts]


def test_a_request_draws_what_generate_draws_with_the_same_settings(capitals):
    model, tokenizer = capitals
    engine = engine_for(model)
    for prompt, params in zip(prompts(tokenizer), PROCESSED):
        out = engine.generate([prompt], params)[0].token_ids
        expected = llminfer.generate(model, prompt, params.max_new_tokens, ignore_eos=True,
                                     temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                                     seed=params.seed, **params.processors).token_ids
        assert out == expected, params


def test_a_mixed_batch_draws_what_each_request_draws_alone(capitals):
    model, tokenizer = capitals
    rng = random.Random(0)
    batch_prompts = prompts(tokenizer)
    alone = [engine_for(model).generate([p], params)[0].token_ids for p, params in zip(batch_prompts, PROCESSED)]
    engine = engine_for(model, max_num_seqs=8)
    order = list(range(len(PROCESSED)))
    rng.shuffle(order)                                   # arrival order differs from the reference's
    ids = {i: engine.add_request(batch_prompts[i], PROCESSED[i]) for i in order}
    while engine.has_unfinished():
        engine.step()
    assert any(len(record.entries) > 2 for record in engine.trace)           # they did share steps
    assert [engine.pop_output(ids[i]).token_ids for i in range(len(PROCESSED))] == alone
    # and the penalties did act: the penalised greedy request differs from the plain greedy one on its prompt
    plain = engine_for(model).generate([batch_prompts[2]], PROCESSED[1])[0].token_ids
    assert alone[2] != plain


@pytest.mark.parametrize("settings, message", [
    (dict(min_p=1.5), "min_p must lie in 0..1"),
    (dict(min_p=float("nan")), "min_p=nan is not a number"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(repetition_penalty=1e39), "repetition_penalty=1e\\+39 is beyond 3.403e\\+38"),
    (dict(presence_penalty=-2.01), "presence_penalty must lie in -2.0..2.0"),
    (dict(frequency_penalty=7), "frequency_penalty must lie in -2.0..2.0"),
])
def test_bad_processor_values_are_refused_when_the_params_are_made(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)
