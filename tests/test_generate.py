"""Generation: cached and uncached agree, greedy matches transformers, sampling, and bad input."""
from __future__ import annotations

import pytest
import torch
import transformers

import llminfer
from small_models import SMALL_CONFIGS, random_model

PROMPT_LENGTHS = [1, 2, 5, 17, 64, 129, 200, 255]


@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
@pytest.mark.parametrize("name", ["llama-mha-untied", "llama3-rope-scaling", "qwen2-bias-gqa"])
def test_cached_and_uncached_generation_agree(name, prompt_len):
    config = SMALL_CONFIGS[name]
    model = random_model(config, seed=prompt_len)
    ids = torch.randint(0, config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
    cached = llminfer.generate(model, ids, max_new_tokens=12, use_cache=True, return_logits=True)
    uncached = llminfer.generate(model, ids, max_new_tokens=12, use_cache=False, return_logits=True)
    assert cached.token_ids == uncached.token_ids and len(cached.token_ids) == 12
    diff = max((a - b).abs().max().item() for a, b in zip(cached.logits, uncached.logits))
    assert diff <= 1e-4, f"last-step logits differ by {diff}"
    assert len(cached.token_latencies_s) == 11 and cached.ttft_s > 0


def test_greedy_tokens_match_transformers_generate(tmp_path):
    config = SMALL_CONFIGS["llama-gqa-tied"]
    model = random_model(config, seed=11)
    llminfer.save_pretrained(model, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, 23:].tolist()
    assert llminfer.generate(model, ids, max_new_tokens=20).token_ids == expected


def test_batched_generation_equals_one_by_one():
    config = SMALL_CONFIGS["qwen2-bias-gqa"]
    model = random_model(config, seed=2)
    ids = torch.randint(0, config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(9))
    batched = llminfer.generate(model, ids, max_new_tokens=6)
    assert batched.token_ids == [llminfer.generate(model, row, max_new_tokens=6).token_ids for row in ids]


def test_generation_stops_at_eos_and_includes_it():
    config = SMALL_CONFIGS["llama-mha-untied"]
    model = random_model(config, seed=1)
    ids = [5, 6, 7]
    free = llminfer.generate(model, ids, max_new_tokens=10).token_ids
    eos = free[3]
    stopped = llminfer.generate(model, ids, max_new_tokens=10, eos_token_id=eos)
    assert stopped.token_ids == free[: free.index(eos) + 1]
    assert len(stopped.token_latencies_s) == len(stopped.token_ids) - 1


def test_sampling_is_seeded_and_filters_reduce_to_greedy():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"], seed=4)
    ids = [1, 2, 3]
    a = llminfer.generate(model, ids, 15, temperature=1.0, seed=7).token_ids
    b = llminfer.generate(model, ids, 15, temperature=1.0, seed=7).token_ids
    c = llminfer.generate(model, ids, 15, temperature=1.0, seed=8).token_ids
    assert a == b and a != c
    greedy = llminfer.generate(model, ids, 15).token_ids
    assert llminfer.generate(model, ids, 15, temperature=0.7, top_k=1, seed=3).token_ids == greedy
    assert llminfer.generate(model, ids, 15, temperature=0.7, top_p=1e-6, seed=3).token_ids == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = {int(llminfer.sample_next(logits, 1.0, top_p=0.7, generator=torch.Generator().manual_seed(s)))
            for s in range(200)}
    assert seen == {0, 1}
    seen = {int(llminfer.sample_next(logits, 1.0, top_k=3, generator=torch.Generator().manual_seed(s)))
            for s in range(200)}
    assert seen == {0, 1, 2}


@pytest.fixture
def guarded_model(monkeypatch):
    """A model whose forward fails the test if it runs: errors must come before any compute."""
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])

    def no_compute(*args, **kwargs):
        raise AssertionError("the model ran before the bad input was refused")
    monkeypatch.setattr(model, "forward_unchecked", no_compute)
    return model


@pytest.mark.parametrize("kwargs,message", [
    ({"input_ids": []}, "at least one token"),
    ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "at least one token"),
    ({"input_ids": [1] * 500, "max_new_tokens": 20}, r"500 tokens \+ max_new_tokens=20 = 520 .*max_seq_len=512.*<= 12"),
    ({"input_ids": [1, 2], "max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1"),
    ({"input_ids": [1, 2], "temperature": -0.5}, "temperature must be >= 0.*-0.5"),
    ({"input_ids": [1, 2], "top_p": 0.0}, r"top_p must lie in \(0, 1\], got 0.0"),
    ({"input_ids": [1, 2], "top_p": 1.5}, r"top_p must lie in \(0, 1\], got 1.5"),
    ({"input_ids": [1, 2], "top_k": 0}, "top_k must be a positive integer"),
    ({"input_ids": [1, 97]}, "token id 97 is outside the vocabulary of 97 ids"),
    ({"input_ids": [-3, 1]}, "token id -3 is outside the vocabulary"),
    ({"input_ids": "The capital"}, "encode text first"),
])
def test_bad_input_is_refused_before_compute(guarded_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llminfer.generate(guarded_model, **kwargs)


def test_forward_refuses_bad_ids_and_lengths(guarded_model):
    with pytest.raises(ValueError, match="token id 200"):
        guarded_model(torch.tensor([[1, 200]]))
    with pytest.raises(ValueError, match="exceed the model's max_seq_len=512"):
        guarded_model(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, seq_len\)"):
        guarded_model(torch.zeros(5, dtype=torch.long))


def test_cuda_without_a_gpu_says_how_to_choose_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available.*device='cpu'"):
        llminfer.resolve_device("cuda")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        llminfer.load_random("smollm2-135m", device="cuda")
    assert llminfer.resolve_device(None).type == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_matches_cpu(dtype):
    config = SMALL_CONFIGS["qwen2-bias-gqa"]
    cpu = random_model(config, seed=1)
    gpu = random_model(config, seed=1).to("cuda", dtype)
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (cpu(ids) - gpu(ids.cuda()).float().cpu()).abs().max().item()
    assert diff <= (1e-4 if dtype == torch.float32 else 5e-2)
    cached = llminfer.generate(gpu, ids, 10)
    assert len(cached.token_ids) == 10 and cached.ttft_s > 0
