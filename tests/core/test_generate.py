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
    assert len(cached.itl_s) == 11 and cached.ttft_s > 0


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
    assert len(stopped.itl_s) == len(stopped.token_ids) - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_greedy_over_half_precision_logits_is_torchs_argmax_of_them(dtype):
    from llminfer.generate import sample_next

    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, 7] = logits[1, 30000] = logits[1].max() + 1      # a tie: the first index wins
    logits[2, 123] = float("inf")
    logits[3, 5000] = float("nan")                              # a NaN counts as the largest
    picked = sample_next(logits)
    assert picked.tolist() == logits.argmax(dim=-1).tolist() == [int(logits[0].float().argmax()), 7, 123, 5000]


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
    """A model that fails the test if it computes or allocates a cache: errors must come first."""
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])

    def no_compute(*args, **kwargs):
        raise AssertionError("the model ran before the bad input was refused")

    def no_cache(*args, **kwargs):
        raise AssertionError("a KV cache was allocated before the bad input was refused")
    monkeypatch.setattr(model.embed_tokens, "forward", no_compute)
    monkeypatch.setattr(model, "new_cache", no_cache)
    return model


@pytest.mark.parametrize("kwargs,message", [
    ({"input_ids": []}, "at least one token"),
    ({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, "at least one token"),
    ({"input_ids": [1] * 500, "max_new_tokens": 20}, r"500 tokens \+ max_new_tokens=20 = 520 .*max_seq_len=512.*<= 12"),
    ({"input_ids": [1, 2], "max_new_tokens": -1}, "max_new_tokens must be an integer >= 0, got -1"),
    ({"input_ids": [1, 2], "temperature": -0.5}, "temperature must be >= 0.*-0.5"),
    ({"input_ids": [1, 2], "temperature": float("nan")}, "temperature must be a finite number.*nan"),
    ({"input_ids": [1, 2], "temperature": float("inf")}, "temperature must be a finite number.*inf"),
    ({"input_ids": [1, 2], "temperature": "0.7"}, "temperature must be a finite number.*'0.7'"),
    ({"input_ids": [1, 2], "temperature": None}, "temperature must be a finite number.*None"),
    ({"input_ids": [1, 2], "top_p": 0.0}, r"top_p must lie in \(0, 1\], got 0.0"),
    ({"input_ids": [1, 2], "top_p": 1.5}, r"top_p must lie in \(0, 1\], got 1.5"),
    ({"input_ids": [1, 2], "top_k": 0}, "top_k must be a positive integer"),
    ({"input_ids": [1, 2], "top_k": True}, "top_k must be a positive integer.*True"),
    ({"input_ids": [1, 97]}, "token id 97 is outside the vocabulary of 97 ids"),
    ({"input_ids": [-3, 1]}, "token id -3 is outside the vocabulary"),
    ({"input_ids": "The capital"}, "encode text first"),
    ({"input_ids": [1.0, 2.0]}, "integer token ids, got 1.0"),
    ({"input_ids": [True, False]}, "integer token ids, got True"),
    ({"input_ids": [1 + 2j]}, "integer token ids"),
    ({"input_ids": torch.tensor([[1.0, 2.0]])}, "integer token ids, got a torch.float32"),
    ({"input_ids": torch.tensor([[True, False]])}, "integer token ids, got a torch.bool"),
    ({"input_ids": torch.tensor([[1 + 0j]])}, "integer token ids, got a torch.complex64"),
    ({"input_ids": [1, 2], "eos_token_id": 97}, "eos_token_id=97 is outside the vocabulary of 97"),
    ({"input_ids": [1, 2], "eos_token_id": -1}, "eos_token_id=-1 is outside the vocabulary"),
    ({"input_ids": [1, 2], "eos_token_id": 2.0}, "eos_token_id must be an integer.*2.0"),
    ({"input_ids": [1, 2], "eos_token_id": "<eos>"}, "eos_token_id must be an integer.*'<eos>'"),
])
def test_bad_input_is_refused_before_compute(guarded_model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        llminfer.generate(guarded_model, **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": float("nan")}, "finite number"), ({"temperature": None}, "finite number"),
    ({"temperature": 1.0, "top_k": True}, "top_k"), ({"temperature": 1.0, "top_p": float("nan")}, "top_p"),
])
def test_sample_next_validates_its_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        llminfer.sample_next(torch.zeros(1, 5), **kwargs)


def test_a_vanishing_temperature_is_refused_or_sampled_safely():
    """1e-300 becomes 0 in float32 (logits / 0 = inf, softmax nan): refused up front, naming value, limit and fix.
    Down to the limit, sampling stays finite and picks the argmax."""
    from llminfer.generate import MIN_TEMPERATURE, probabilities
    logits = torch.tensor([[3.0, 90.0, -7.0, 89.5]])
    with pytest.raises(ValueError, match=r"temperature=1e-300 is below 1\.18e-38.*pass temperature=0"):
        llminfer.sample_next(logits, temperature=1e-300)
    for tiny in (MIN_TEMPERATURE, 1e-37, 1e-20):
        probs = probabilities(logits, tiny)
        assert torch.isfinite(probs).all() and probs.argmax() == 1 and float(probs.max()) == 1.0
        assert int(llminfer.sample_next(logits, tiny, generator=torch.Generator().manual_seed(0))) == 1
    # the unshifted division that the probabilities avoid overflows at 1e-37
    assert torch.isnan((logits / 1e-37).softmax(-1)).any()


def test_generate_refuses_a_vanishing_temperature_before_compute(guarded_model):
    with pytest.raises(ValueError, match=r"temperature=1e-300 is below"):
        llminfer.generate(guarded_model, [1, 2], temperature=1e-300)


def test_the_one_request_check_serves_every_caller():
    """check_request returns the checked (B, T) ids, and names the first bad value; single=True refuses a batch,
    capacity= measures the request against a fixed cache instead of the model's context."""
    from llminfer.generate import check_request
    config = SMALL_CONFIGS["llama-mha-untied"]
    ids = check_request(config, [[1, 2, 3], [4, 5, 6]], 4)
    assert ids.dtype == torch.long and ids.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert check_request(config, torch.tensor([7, 8]), 1, single=True).tolist() == [[7, 8]]
    with pytest.raises(ValueError, match=r"a request is one sequence.*got a batch of 2"):
        check_request(config, [[1, 2], [3, 4]], 1, single=True)
    with pytest.raises(ValueError, match=r"1-D list of token ids, got a tensor of shape \(2, 3\)"):
        check_request(config, torch.ones(2, 3, dtype=torch.long), 1, single=True)
    with pytest.raises(ValueError, match=r"3 prompt tokens \+ 7 new need 9 cache positions, the decoder's cache "
                                         r"holds 8"):
        check_request(config, [1, 2, 3], 7, capacity=8)
    assert check_request(config, [1, 2, 3], 6, capacity=8).shape == (1, 3)
    with pytest.raises(ValueError, match="seed must be an integer"):
        check_request(config, [1, 2], 1, seed=1.5)
    with pytest.raises(ValueError, match="top_k"):
        check_request(config, [1, 2], 1, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"eos_token_id=97 is outside the vocabulary of 97"):
        check_request(config, [1, 2], 1, eos_token_id=97)
    with pytest.raises(ValueError, match="token id 97 is outside the vocabulary"):
        check_request(config, [1, 97], 1)


def test_a_cache_that_cannot_fit_is_refused_before_allocating(monkeypatch):
    """The refusal depends on the reported free memory, not on the test machine's RAM."""
    monkeypatch.setattr(llminfer.device, "free_memory_bytes", lambda device: 8 * 2**30)   # an 8 GiB machine
    model = llminfer.load_random("smollm2-135m", max_seq_len=10**6)
    with pytest.raises(MemoryError, match=r"KV cache .* needs 42\.92 GiB but only 8\.00 GiB is free"):
        model.new_cache()
    # generate on a (2048, 128) batch with 64 new tokens: ids checked, then the memory, then nothing allocated
    ids = torch.zeros(2048, 128, dtype=torch.long)
    with pytest.raises(MemoryError, match=r"generating 64 tokens after a \(2048, 128\) prompt .* GiB of KV cache"):
        llminfer.generate(model, ids, max_new_tokens=64)
    with pytest.raises(ValueError, match="token id 49152"):
        llminfer.generate(model, torch.full((2048, 128), 49152), max_new_tokens=64)


def test_forward_refuses_bad_ids_and_lengths(guarded_model):
    with pytest.raises(ValueError, match="token id 200"):
        llminfer.prefill(guarded_model, torch.tensor([[1, 200]]), llminfer.KVCache.for_config(guarded_model.config))
    with pytest.raises(ValueError, match="exceed the model's max_seq_len=512"):
        guarded_model(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(batch, seq_len\)"):
        guarded_model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="integer token ids"):
        guarded_model(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="position 512 is outside 0..511"):
        guarded_model(torch.zeros(1, 2, dtype=torch.long), positions=torch.tensor([511, 512]))


def test_forward_does_not_sync_with_the_host(monkeypatch):
    """The decode hot path reads no tensor value back to Python (no .item(), int(), tolist())."""
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=8)
    llminfer.prefill(model, torch.tensor([[1, 2, 3]]), cache)

    def sync(*args, **kwargs):
        raise AssertionError("the forward read a tensor value back to the host")
    token = torch.tensor([[4]])
    with torch.inference_mode():
        for name in ("item", "tolist", "__int__", "__bool__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, sync)
        logits = model(token, cache=cache)
        monkeypatch.undo()
    assert logits.shape == (1, 1, 97) and cache.length == 4


def test_prefill_and_decode_run_without_autograd():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=8)
    logits = llminfer.prefill(model, torch.tensor([[1, 2, 3]]), cache)   # called outside torch.no_grad()
    assert not logits.requires_grad and not cache.k[0].requires_grad
    logits = llminfer.decode_step(model, logits.argmax(-1), cache)
    assert not logits.requires_grad and logits.grad_fn is None and cache.length == 4


def test_decode_step_takes_its_position_from_the_cache():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=8)
    token = llminfer.prefill(model, torch.tensor([[1, 2, 3]]), cache).argmax(-1)
    with pytest.raises(TypeError):
        llminfer.decode_step(model, token, cache, start_pos=3)     # the deprecated argument is gone
    assert cache.length == 3
    with pytest.raises(ValueError, match="token id 97"):
        llminfer.decode_step(model, torch.tensor([97]), cache)
    llminfer.decode_step(model, token, cache)
    assert cache.length == 4


def test_timing_fields_follow_the_vllm_definitions():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    result = llminfer.generate(model, [1, 2, 3], max_new_tokens=6)
    assert len(result.itl_s) == 5 and all(gap > 0 for gap in result.itl_s)
    assert result.e2e_s == pytest.approx(result.ttft_s + sum(result.itl_s))
    assert result.tpot_s == pytest.approx((result.e2e_s - result.ttft_s) / 5)
    assert result.num_prompt_tokens == 3
    assert not any(hasattr(result, name) for name in ("token_latencies_s", "total_s", "prompt_len"))  # gone
    one = llminfer.generate(model, [1, 2, 3], max_new_tokens=1)
    assert one.itl_s == [] and one.e2e_s == one.ttft_s and one.tpot_s != one.tpot_s   # nan


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


def test_the_vocabulary_is_checked_once_per_request_and_not_inside_the_timed_loop(monkeypatch):
    """check_request reads the ids back once (a host sync); the prefill inside TTFT does not read them again."""
    import importlib

    generate_module = importlib.import_module("llminfer.generate")     # (llminfer.generate is the function)
    model_module = importlib.import_module("llminfer.model")

    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    calls = []

    def counting(real, where):
        def check(ids, vocab_size):
            calls.append(where)
            return real(ids, vocab_size)
        return check
    monkeypatch.setattr(generate_module, "check_token_ids", counting(generate_module.check_token_ids, "request"))
    monkeypatch.setattr(model_module, "check_token_ids", counting(model_module.check_token_ids, "forward"))
    llminfer.generate(model, [1, 2, 3], max_new_tokens=3)
    assert calls == ["request"]
    with pytest.raises(ValueError, match="token id 97"):           # a direct prefill still checks its ids
        llminfer.prefill(model, torch.tensor([[1, 97]]), model.new_cache(max_seq_len=8))
    assert calls == ["request", "forward"]


# --- stopping at the model's end-of-sequence token, and keywords of other APIs ------------------------------------

@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained("tiny-capitals")


def test_generate_stops_at_the_models_end_of_sequence_token_by_default(bundled):
    """Without eos_token_id the bundled model's answer ends at <eos> (the tokenizer's id, read from the folder's
    generation_config.json); ignore_eos=True runs on to exactly max_new_tokens."""
    model, tokenizer = bundled
    ids = tokenizer.encode("The capital of France")
    stopped = llminfer.generate(model, ids, max_new_tokens=8)
    assert tokenizer.tokens(stopped.token_ids) == [" is", " Paris", ".", "<eos>"]
    assert stopped.token_ids[-1] == tokenizer.eos_token_id and len(stopped.itl_s) == 3
    assert stopped.token_ids == llminfer.generate(model, ids, max_new_tokens=8,
                                                  eos_token_id=tokenizer.eos_token_id).token_ids
    run_on = llminfer.generate(model, ids, max_new_tokens=8, ignore_eos=True).token_ids
    assert len(run_on) == 8 and run_on[:4] == stopped.token_ids and tokenizer.eos_token_id in run_on[4:]
    batch = llminfer.generate(model, [ids, ids], max_new_tokens=8).token_ids       # a batch stops the same way
    assert batch == [stopped.token_ids, stopped.token_ids]


def test_ignore_eos_is_a_checked_flag_that_contradicts_an_explicit_eos(guarded_model):
    with pytest.raises(ValueError, match=r"ignore_eos must be True or False, got 'yes'"):
        llminfer.generate(guarded_model, [1, 2], ignore_eos="yes")
    with pytest.raises(ValueError, match=r"ignore_eos=True runs past every end-of-sequence token, so "
                                         r"eos_token_id=5 would never be used; pass one of them"):
        llminfer.generate(guarded_model, [1, 2], eos_token_id=5, ignore_eos=True)


@pytest.mark.parametrize("kwargs,message", [
    ({"do_sample": True}, r"generate\(\) has no do_sample: sampling is on when temperature > 0 .*pass temperature="),
    ({"max_tokens": 5}, r"generate\(\) has no max_tokens: pass max_new_tokens="),
    ({"max_length": 20}, r"generate\(\) has no max_length: .*pass max_new_tokens="),
    ({"colour": "red"}, r"generate\(\) has no colour: it takes model, input_ids, max_new_tokens, .*ignore_eos"),
])
def test_keywords_of_other_apis_name_this_ones_equivalent(guarded_model, kwargs, message):
    with pytest.raises(TypeError, match=message):
        llminfer.generate(guarded_model, [1, 2], **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"top_p": 1e-300}, r"top_p=1e-300 is below 1\.18e-38, the smallest normal float32, where it becomes 0; "
                        r"pass top_p >= 1\.18e-38"),
    ({"top_p": 1e-40}, r"top_p=1e-40 is below 1\.18e-38.*where it becomes a subnormal number"),
    ({"top_p": 5e-324}, r"top_p=5e-324 is below 1\.18e-38"),
    ({"temperature": 1e-45}, r"temperature=1e-45 is below 1\.18e-38.*pass temperature=0"),
    ({"temperature": 5e-324}, r"temperature=5e-324 is below 1\.18e-38.*pass temperature=0"),
    ({"temperature": 1e39}, r"temperature=1e\+39 is beyond 3\.403e\+38, the largest float32, where it becomes inf; "
                            r"pass a temperature of at most 3\.4e38"),
    ({"temperature": 10**400}, r"temperature=1000000000000000000000000000000000000\.\.\. is beyond 3\.403e\+38"),
])
def test_sampling_settings_at_float32s_edges_are_refused_before_compute(guarded_model, kwargs, message):
    """Sampling computes in float32: a setting that becomes 0, inf or a subnormal there is refused, naming the
    value, float32's limit and the fix."""
    with pytest.raises(ValueError, match=message):
        llminfer.generate(guarded_model, [1, 2], **{"temperature": 1.0, **kwargs})


def test_sampling_settings_just_inside_float32_work():
    """The limits are where float32 stops holding the value, not further in: the smallest normal float32 as top_p
    is greedy, the largest float32 as temperature samples without inf or nan."""
    from llminfer.checks import FLOAT32_MAX, FLOAT32_TINY
    model = random_model(SMALL_CONFIGS["llama-mha-untied"], seed=4)
    greedy = llminfer.generate(model, [1, 2, 3], 6).token_ids
    assert llminfer.generate(model, [1, 2, 3], 6, temperature=1.0, top_p=FLOAT32_TINY, seed=1).token_ids == greedy
    assert len(llminfer.generate(model, [1, 2, 3], 6, temperature=FLOAT32_MAX, seed=1).token_ids) == 6
