"""Bad input to the engine: a clear error, naming the value, the limit and the fix, before anything runs."""
from __future__ import annotations

import pytest
import torch

from llminfer import instrument
from llminfer.engine import LLMEngine, SamplingParams
from small_models import SMALL_CONFIGS, random_model


@pytest.fixture(scope="module")
def model():
    return random_model(SMALL_CONFIGS["llama-mha-untied"])      # max_seq_len 512, vocab 97


@pytest.fixture
def engine(model):
    return LLMEngine(model, block_size=16, num_blocks=40, max_num_seqs=4)


def nothing_ran(engine) -> bool:
    return engine.stats.steps == 0 and not engine.has_unfinished() and engine.stats.blocks_used == 0


def test_a_request_longer_than_the_context(engine, model):
    with pytest.raises(ValueError, match=r"500 tokens \+ max_new_tokens=20 = 520 positions exceed the model's "
                                         r"context \(max_seq_len=512\); pass max_new_tokens <= 12"):
        engine.add_request([5] * 500, SamplingParams(max_new_tokens=20))
    assert nothing_ran(engine)


def test_a_request_that_never_fits_in_the_pool(model):
    engine = LLMEngine(model, block_size=16, num_blocks=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"could never fit in the KV pool, even alone: 69 positions need 5 blocks "
                                         r"of 16 but the pool has 4; make the engine with num_blocks >= 5"):
        engine.add_request([5] * 60, SamplingParams(max_new_tokens=10))
    engine.add_request([5] * 54, SamplingParams(max_new_tokens=10))   # 63 positions (the last token is never run)
    assert engine.has_unfinished()


def test_a_request_longer_than_max_model_len(model):
    engine = LLMEngine(model, block_size=16, num_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds the engine's max_model_len=64"):
        engine.add_request([5] * 60, SamplingParams(max_new_tokens=10))


@pytest.mark.parametrize("prompt", [[], torch.tensor([], dtype=torch.long)])
def test_an_empty_prompt(engine, prompt):
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.add_request(prompt)
    assert nothing_ran(engine)


@pytest.mark.parametrize("prompt, message", [
    ("The capital of France", "encode text first with tokenizer.encode"),
    ([1, 2.5, 3], r"integer token ids, got 2\.5"),
    ([1, 97], r"token id 97 is outside the vocabulary of 97 ids \(valid ids are 0\.\.96\)"),
    ([-1], "token id -1 is outside the vocabulary"),
    (torch.ones(2, 3, dtype=torch.long), r"1-D list of token ids, got a tensor of shape \(2, 3\)"),
])
def test_bad_prompts(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt)


@pytest.mark.parametrize("settings, message", [
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(max_new_tokens=-3), "max_new_tokens must be an integer >= 0"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_k=0), "top_k must be a positive integer"),
    (dict(top_p=1.5), r"top_p must lie in \(0, 1\]"),
    (dict(top_p=0.0), r"top_p must lie in \(0, 1\]"),
    (dict(eos_token_id=-1), "eos_token_id must be a token id >= 0"),
    (dict(seed="x"), "seed must be an integer"),
    # float32's edges, where sampling computes: the value, the limit and the fix
    (dict(temperature=1e-45), r"temperature=1e-45 is below 1\.18e-38.*pass temperature=0"),
    (dict(temperature=1e39), r"temperature=1e\+39 is beyond 3\.403e\+38, the largest float32, where it becomes "
                             r"inf; pass a temperature of at most 3\.4e38"),
    (dict(temperature=1.0, top_p=1e-300), r"top_p=1e-300 is below 1\.18e-38, the smallest normal float32, where it "
                                          r"becomes 0; pass top_p >= 1\.18e-38"),
    (dict(temperature=1.0, top_p=1e-40), r"top_p=1e-40 is below 1\.18e-38.*becomes a subnormal number"),
])
def test_bad_sampling_parameters(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**settings)


@pytest.mark.parametrize("settings, message", [
    (dict(max_tokens=8), r"SamplingParams\(\) has no max_tokens: pass max_new_tokens="),
    (dict(do_sample=True), r"SamplingParams\(\) has no do_sample: sampling is on when temperature > 0"),
    (dict(colour="red"), r"SamplingParams\(\) has no colour: it takes max_new_tokens, temperature, top_k, top_p, "
                         r"eos_token_id, seed"),
])
def test_keywords_of_other_apis_name_this_ones_equivalent(settings, message):
    with pytest.raises(TypeError, match=message):
        SamplingParams(**settings)


def test_an_eos_outside_the_vocabulary(engine):
    with pytest.raises(ValueError, match="eos_token_id=500 is outside the vocabulary of 97 ids"):
        engine.add_request([1, 2], SamplingParams(eos_token_id=500))


def test_params_of_the_wrong_type(engine):
    with pytest.raises(ValueError, match="params must be a SamplingParams, got dict"):
        engine.add_request([1, 2], {"max_new_tokens": 3})


@pytest.mark.parametrize("block_size", [0, -16, 12, 24, 2.0, True])
def test_block_size_not_a_power_of_two(model, block_size):
    with pytest.raises(ValueError, match="block_size must be a positive power of two"):
        LLMEngine(model, block_size=block_size, num_blocks=64)


def test_num_blocks_too_small_for_one_request(model):
    with pytest.raises(ValueError, match=r"num_blocks=4 × block_size=16 = 64 positions is too small for one request "
                                         r"of max_model_len=512; pass num_blocks >= 32, or max_model_len <= 64"):
        LLMEngine(model, block_size=16, num_blocks=4)
    for bad in (0, -1, 3.5):
        with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
            LLMEngine(model, num_blocks=bad)


def test_a_pool_sized_from_too_little_free_memory(model, monkeypatch):
    monkeypatch.setattr("llminfer.engine.llm_engine.free_memory_bytes", lambda device: 64 * 1024)
    with pytest.raises(MemoryError, match=r"too few for one request of max_model_len=512 \(32 blocks\)"):
        LLMEngine(model, block_size=16)


def test_pool_sized_from_free_memory_is_shown_and_capped(model, monkeypatch):
    monkeypatch.setattr("llminfer.engine.llm_engine.free_memory_bytes", lambda device: 1 << 30)
    engine = LLMEngine(model, block_size=16, max_num_seqs=2)
    assert engine.num_blocks == 2 * 32                  # never more than max_num_seqs full-length requests use
    assert "64 blocks: min(" in engine.pool_sizing and "50% of the 1.0 GiB free" in engine.pool_sizing


def test_aborting_an_unknown_id(engine):
    with pytest.raises(ValueError, match="unknown request id 0: no request has been added"):
        engine.abort(0)
    request_id = engine.add_request([1, 2, 3])
    with pytest.raises(ValueError, match=r"unknown request id 7: this engine has issued ids 0\.\.0"):
        engine.abort(7)
    with pytest.raises(ValueError, match="unknown request id 'a'"):
        engine.abort("a")
    assert engine.abort(request_id) is True
    assert engine.abort(request_id) is False             # already finished (aborted): not an error


@pytest.mark.parametrize("settings, message", [
    (dict(policy="fifo"), "policy must be one of continuous, static, sequential"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens must be a positive integer"),
    (dict(max_model_len=1000), r"max_model_len must lie in 1\.\.512"),
    (dict(kv_memory_fraction=1.5), r"kv_memory_fraction must lie in \(0, 1\]"),
    (dict(kernel="nope"), "unknown paged-attention kernel 'nope'"),
])
def test_bad_engine_settings(model, settings, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(model, num_blocks=64, **settings)


def test_without_chunking_a_request_must_fit_one_step(model):
    engine = LLMEngine(model, num_blocks=64, max_num_batched_tokens=32, chunked_prefill=False)
    with pytest.raises(ValueError, match="must fit in one step's budget, max_num_batched_tokens=32"):
        engine.add_request([5] * 30, SamplingParams(max_new_tokens=4))


def test_generate_checks_every_prompt_before_running_any(model, engine):
    with instrument.count_kv(model) as counts:
        with pytest.raises(ValueError, match="the prompt is empty"):
            engine.generate([[1, 2, 3], [4, 5], []])
        with pytest.raises(ValueError, match="wrap a single prompt"):
            engine.generate([1, 2, 3])
        with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
            engine.generate([[1], [2], [3]], [SamplingParams(), SamplingParams()])
    assert counts.total == 0 and nothing_ran(engine)


def test_bad_arrival_time(engine):
    with pytest.raises(ValueError, match="arrival_time must be a finite number"):
        engine.add_request([1, 2], arrival_time=float("inf"))
