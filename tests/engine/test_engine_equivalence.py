"""The engine's batched tokens equal llminfer.generate on each prompt alone, under every policy and setting."""
from __future__ import annotations

import random

import pytest
import torch

import llminfer
from llminfer.engine import LLMEngine, SamplingParams
from small_models import SMALL_CONFIGS, random_model

N_PROMPTS = 20


def _prompts(vocab_size: int, max_len: int, seed: int) -> list[list[int]]:
    """20 prompts of lengths 1 .. max_len (both ends included), some sharing a long prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab_size) for _ in range(max_len)]
    lengths = [1, max_len] + [rng.randint(1, max_len) for _ in range(N_PROMPTS - 2)]
    prompts = []
    for i, n in enumerate(lengths):
        own = [rng.randrange(3, vocab_size) for _ in range(n)]
        prompts.append(shared[: n - n // 3] + own[n - n // 3:] if i % 3 == 2 else own)
    return prompts


@pytest.fixture(scope="module")
def cases():
    """Per model: the model, its prompts and sampling settings, and generate()'s tokens for each prompt alone."""
    bundled, tokenizer = llminfer.load_pretrained("tiny-capitals")
    gqa = random_model(SMALL_CONFIGS["llama-gqa-tied"])                # 8 query heads share 2 K/V heads
    out = {}
    for name, model, max_len, seed in (("bundled", bundled, 110, 0), ("gqa", gqa, 200, 1)):
        rng = random.Random(seed)
        prompts = _prompts(model.config.vocab_size, max_len, seed)
        if name == "bundled":   # real text too, stopping at the tokenizer's EOS
            prompts[3] = tokenizer.encode("The capital of France is")
            prompts[4] = tokenizer.encode("The capital of Japan is")
        eos = tokenizer.eos_token_id if name == "bundled" else None
        params = [SamplingParams(max_new_tokens=rng.randint(1, 4), eos_token_id=eos) for _ in prompts]
        refs = [llminfer.generate(model, p, max_new_tokens=sp.max_new_tokens, eos_token_id=eos).token_ids
                for p, sp in zip(prompts, params)]
        out[name] = (model, prompts, params, refs)
    return out


# every policy with both switches on and both off, and the two mixed settings under the continuous policy
SETTINGS = [(policy, on, on) for policy in ("continuous", "static", "sequential") for on in (True, False)] + \
    [("continuous", True, False), ("continuous", False, True)]
SETTING_IDS = [f"{p}-{'prefix' if c else 'noprefix'}-{'chunked' if k else 'whole'}" for p, c, k in SETTINGS]


@pytest.mark.parametrize("model_name", ["bundled", "gqa"])
@pytest.mark.parametrize("policy, prefix_caching, chunked", SETTINGS,
                         ids=SETTING_IDS)
def test_greedy_equals_generate(cases, model_name, policy, prefix_caching, chunked):
    model, prompts, params, refs = cases[model_name]
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=256 if chunked else 512,
                       policy=policy, enable_prefix_caching=prefix_caching, chunked_prefill=chunked)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == refs
    assert [o.request_id for o in outputs] == sorted(o.request_id for o in outputs)   # in prompt order
    stats = engine.stats
    assert stats.blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    if prefix_caching and policy != "sequential":
        assert stats.prefix_hit_tokens > 0            # prompts 2, 5, 8, ... share a prefix with prompt 0 or each other
    if not prefix_caching:
        assert all(o.num_cached_tokens == 0 for o in outputs)


@pytest.mark.parametrize("model_name", ["bundled", "gqa"])
@pytest.mark.parametrize("policy, prefix_caching, chunked", SETTINGS,
                         ids=SETTING_IDS)
def test_the_fast_path_equals_generate(cases, model_name, policy, prefix_caching, chunked):
    """optimize=True: every step one native call over the block tables, the same greedy tokens."""
    model, prompts, params, refs = cases[model_name]
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=256 if chunked else 512,
                       policy=policy, enable_prefix_caching=prefix_caching, chunked_prefill=chunked, optimize=True)
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == refs
    assert engine.stats.blocks_used == 0
    if prefix_caching and policy != "sequential":
        assert engine.stats.prefix_hit_tokens > 0


@pytest.mark.parametrize("model_name", ["bundled", "gqa"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("optimize", [False, True], ids=["modules", "fast"])
def test_preemption_changes_no_output(cases, model_name, policy, optimize):
    model, prompts, _, _ = cases[model_name]
    prompts = [p[:12] for p in prompts[:6]]
    params = [SamplingParams(max_new_tokens=6 + i) for i in range(len(prompts))]
    refs = [llminfer.generate(model, p, max_new_tokens=sp.max_new_tokens, ignore_eos=True).token_ids
            for p, sp in zip(prompts, params)]
    # 8 blocks of 4 positions: each request alone fits, the six together do not
    engine = LLMEngine(model, block_size=4, num_blocks=8, max_model_len=32, max_num_seqs=8,
                       max_num_batched_tokens=64, policy=policy, optimize=optimize)
    outputs = engine.generate(prompts, params)
    assert engine.stats.preemptions > 0 and sum(o.preemptions for o in outputs) == engine.stats.preemptions
    assert [o.token_ids for o in outputs] == refs
    assert engine.stats.blocks_used == 0


def test_sampling_with_a_seed_matches_generate(cases):
    model, prompts, _, _ = cases["gqa"]
    prompts = prompts[:4]
    settings = dict(temperature=0.8, top_k=20, top_p=0.9)
    params = [SamplingParams(max_new_tokens=6, seed=100 + i, **settings) for i in range(len(prompts))]
    refs = [llminfer.generate(model, p, max_new_tokens=6, seed=100 + i, **settings).token_ids
            for i, p in enumerate(prompts)]
    engine = LLMEngine(model, block_size=16, max_num_seqs=4)
    assert [o.token_ids for o in engine.generate(prompts, params)] == refs
    other_seed = [SamplingParams(max_new_tokens=6, seed=200 + i, **settings) for i in range(len(prompts))]
    assert [o.token_ids for o in engine.generate(prompts, other_seed)] != refs   # the sampling really sampled


def test_mixed_greedy_and_sampled_requests_in_one_batch(cases):
    model, prompts, _, _ = cases["gqa"]
    params = [SamplingParams(max_new_tokens=5, temperature=1.0, seed=7) if i % 2 else SamplingParams(max_new_tokens=5)
              for i in range(6)]
    refs = [llminfer.generate(model, p, max_new_tokens=5, temperature=sp.temperature, seed=sp.seed).token_ids
            for p, sp in zip(prompts[:6], params)]
    engine = LLMEngine(model, block_size=8, max_num_seqs=6)
    assert [o.token_ids for o in engine.generate(prompts[:6], params)] == refs


def test_explicit_attention_backend_gives_the_same_tokens(cases):
    model, prompts, params, refs = cases["gqa"]
    model.set_attention_backend("explicit")
    try:
        engine = LLMEngine(model, block_size=16, max_num_seqs=8)
        assert [o.token_ids for o in engine.generate(prompts[:8], params[:8])] == refs[:8]
    finally:
        model.set_attention_backend("sdpa")


def test_bfloat16_engine_stays_close_to_generate():
    """In bfloat16 a batch rounds differently from a single sequence; the first token still agrees."""
    model, tokenizer = llminfer.load_pretrained("tiny-capitals", dtype=torch.bfloat16)
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "The capital of Peru is",
                                             "The capital of Japan is")]
    refs = [llminfer.generate(model, p, max_new_tokens=1).token_ids for p in prompts]
    engine = LLMEngine(model, block_size=16, max_num_seqs=4)
    assert [o.token_ids for o in engine.generate(prompts, SamplingParams(max_new_tokens=1))] == refs
    assert engine.cache.k[0].dtype == torch.bfloat16


@pytest.mark.parametrize("model_name", ["bundled", "gqa"])
def test_the_optimized_engine_gives_the_same_tokens(cases, model_name):
    """optimize=True (fused projections, native CPU decode kernels) changes the speed, not the answers."""
    from llminfer import fast
    model, prompts, params, refs = cases[model_name]
    engine = LLMEngine(model, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, optimize=True)
    assert fast.is_fused(engine.model) and fast.uses_native_kernels(engine.model) == llminfer.cpu.available()
    assert not fast.is_fused(model)                   # the engine optimised a copy
    assert [o.token_ids for o in engine.generate(prompts, params)] == refs
    with pytest.raises(ValueError, match=r"optimize must be True or False, got 'yes'"):
        LLMEngine(model, block_size=16, optimize="yes")
