"""LLMEngine.add_prefilled: a request whose prompt K/V were computed elsewhere decodes exactly like add_request."""
from __future__ import annotations

import random

import pytest
import torch

import llminfer
from llminfer.engine import LLMEngine, PagedKVCache, SamplingParams
from llminfer.generate import sample_next
from llminfer.kv_cache import KVCache


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained("tiny-capitals")


def prefilled_elsewhere(model, prompt, params=None):
    """The prompt run through the model on a contiguous KVCache (no engine): (first token, K/V per layer, state)."""
    cache = KVCache.for_config(model.config, max_seq_len=len(prompt))
    logits = llminfer.prefill(model, torch.tensor([prompt]), cache)                   # (1, vocab)
    generator = None
    if params is not None and not params.greedy:
        generator = torch.Generator().manual_seed(params.seed)
    first = int(sample_next(logits, 0.0 if params is None else params.temperature,
                            None if params is None else params.top_k, None if params is None else params.top_p,
                            generator)[0])
    kv = [tuple(t.clone() for t in cache.get(layer)) for layer in range(model.config.n_layers)]
    return first, kv, (generator.get_state() if generator is not None else None)


def prompts_for(tokenizer):
    rng = random.Random(3)
    texts = [tokenizer.encode(t) for t in ("The capital of France", "I love", "What is the capital of Peru?")]
    return texts + [[rng.randrange(3, tokenizer.vocab_size) for _ in range(n)] for n in (1, 15, 16, 17, 40)]


def test_greedy_prefilled_requests_equal_add_request(bundled):
    model, tokenizer = bundled
    params = SamplingParams(max_new_tokens=12)                   # no eos: every request makes all 12 tokens
    prompts = prompts_for(tokenizer)
    expected = LLMEngine(model, num_blocks=64).generate(prompts, params)
    engine = LLMEngine(model, num_blocks=64)
    ids = []
    for i, prompt in enumerate(prompts):                         # half prefilled elsewhere, half here, one batch
        if i % 2:
            ids.append(engine.add_request(prompt, params))
            continue
        first, kv, _ = prefilled_elsewhere(model, prompt)
        ids.append(engine.add_prefilled(prompt, params, first, kv))
    assert all(request_id is not None for request_id in ids)
    assert ids == list(range(len(prompts)))                      # one id sequence for both ways in
    stats = engine.stats
    assert stats.num_running == len(prompts) // 2 and stats.num_waiting == len(prompts) - len(prompts) // 2
    assert stats.blocks_used == sum(-(-len(p) // 16) for p in prompts[::2])   # the prefilled prompts' blocks
    while engine.has_unfinished():
        engine.step()
    outputs = [engine.pop_output(i) for i in ids]
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert all(o.finish_reason == "length" and len(o.itl_s) == len(o.token_ids) - 1 for o in outputs)
    prefilled_ids = set(ids[::2])
    for record in engine.trace:                                  # a prefilled request only ever decoded here
        assert all(kind == "decode" for request_id, kind, _ in record.entries if request_id in prefilled_ids)
    assert engine.stats.blocks_used == 0 and engine.stats.num_finished == len(prompts)
    engine.block_manager.check_consistency([])


def test_a_seeded_sample_continues_with_the_generator_state(bundled):
    model, tokenizer = bundled
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    prompt = tokenizer.encode("The capital of France")
    expected = LLMEngine(model, num_blocks=16).generate([prompt], params)[0].token_ids
    first, kv, state = prefilled_elsewhere(model, prompt, params)
    engine = LLMEngine(model, num_blocks=16)
    request_id = engine.add_prefilled(prompt, params, first, kv, generator_state=state)
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output(request_id).token_ids == expected
    assert len(set(expected)) > 3                                # sampled, not a greedy repetition


def test_prefilled_blocks_serve_a_later_prompt_from_the_prefix_cache(bundled):
    model, _ = bundled
    prompt = list(range(3, 3 + 40))                              # two full blocks of 16, and 8 more
    params = SamplingParams(max_new_tokens=4)
    engine = LLMEngine(model, num_blocks=32)
    first, kv, _ = prefilled_elsewhere(model, prompt)
    engine.add_prefilled(prompt, params, first, kv)
    later = engine.add_request(prompt[:33] + [99, 100], params)
    while engine.has_unfinished():
        engine.step()
    output = engine.pop_output(later)
    assert output.num_cached_tokens == 32                        # the installed K/V were reused, block for block
    assert output.token_ids == LLMEngine(model, num_blocks=32).generate([prompt[:33] + [99, 100]], params)[0].token_ids


def test_no_room_returns_none_and_changes_nothing(bundled):
    model, _ = bundled
    params = SamplingParams(max_new_tokens=4)
    prompt = list(range(3, 40))                                  # 37 positions + 1: 3 blocks of 16
    first, kv, _ = prefilled_elsewhere(model, prompt)
    full_batch = LLMEngine(model, num_blocks=8, max_num_seqs=1)
    assert full_batch.add_prefilled(prompt, params, first, kv) == 0
    before = full_batch.stats
    assert full_batch.add_prefilled(prompt, params, first, kv) is None        # max_num_seqs reached
    assert full_batch.stats == before
    assert full_batch.add_request(prompt, params) == 1                        # no id was spent on the refusal
    small_pool = LLMEngine(model, num_blocks=4, max_model_len=64)
    assert small_pool.add_prefilled(prompt, params, first, kv) == 0           # 3 of the 4 blocks
    assert small_pool.add_prefilled(prompt, params, first, kv) is None        # 3 more do not fit
    assert small_pool.stats.blocks_used == 3 and small_pool.stats.num_running == 1
    while small_pool.has_unfinished():
        small_pool.step()
    assert small_pool.add_prefilled(prompt, params, first, kv) is not None    # room again after it finished


@pytest.mark.parametrize("change,words", [
    (lambda kv, first: (kv[:-1], first), "one (k, v) pair per layer"),
    (lambda kv, first: ([(k[:, :, :-1], v[:, :, :-1]) for k, v in kv], first), "expected (1, 2, 20, 32)"),
    (lambda kv, first: ([(k, v[:, :1]) for k, v in kv], first), "expected (1, 2, 20, 32)"),
    (lambda kv, first: (kv, 10 ** 6), "first_token=1000000"),
    (lambda kv, first: (kv, -1), "first_token=-1"),
])
def test_bad_prefilled_requests_are_refused_before_anything_changes(bundled, change, words):
    model, _ = bundled
    prompt = list(range(3, 23))
    first, kv, _ = prefilled_elsewhere(model, prompt)
    engine = LLMEngine(model, num_blocks=16)
    kv, first = change(kv, first)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        engine.add_prefilled(prompt, SamplingParams(max_new_tokens=4), first, kv)
    assert engine.stats.blocks_used == 0 and not engine.has_unfinished()


def test_prefilled_requests_get_the_engines_own_checks(bundled):
    model, tokenizer = bundled
    prompt = list(range(3, 23))
    first, kv, _ = prefilled_elsewhere(model, prompt)
    engine = LLMEngine(model, num_blocks=16)
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add_prefilled(prompt, SamplingParams(max_new_tokens=model.config.max_seq_len), first, kv)
    with pytest.raises(ValueError, match="nothing to decode"):
        engine.add_prefilled(prompt, SamplingParams(max_new_tokens=1), first, kv)
    with pytest.raises(ValueError, match="nothing to decode"):
        engine.add_prefilled(prompt, SamplingParams(max_new_tokens=4, eos_token_id=first), first, kv)
    with pytest.raises(ValueError, match="first_token_time"):
        engine.add_prefilled(prompt, SamplingParams(max_new_tokens=4), first, kv, first_token_time=float("nan"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_prefilled([tokenizer.vocab_size] + prompt[1:], SamplingParams(max_new_tokens=4), first, kv)
    assert not engine.has_unfinished()


def test_the_timings_run_from_the_given_arrival(bundled):
    model, _ = bundled
    prompt = list(range(3, 23))
    first, kv, _ = prefilled_elsewhere(model, prompt)
    engine = LLMEngine(model, num_blocks=16)
    now = engine.clock()
    request_id = engine.add_prefilled(prompt, SamplingParams(max_new_tokens=3), first, kv, arrival_time=now - 0.5,
                                      first_token_time=now - 0.25)
    while engine.has_unfinished():
        engine.step()
    output = engine.pop_output(request_id)
    assert output.token_ids[0] == first and len(output.token_ids) == 3
    assert output.ttft_s == pytest.approx(0.25) and output.e2e_s > 0.5 and output.itl_s[0] > 0.25


def test_the_paged_cache_writes_what_gather_reads(bundled):
    model, _ = bundled
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    k, v = torch.randn(1, 2, 10, 32), torch.randn(1, 2, 10, 32)
    table = [5, 2, 7]                                            # 12 positions, out of order
    cache.write(1, table, k, v)
    got_k, got_v = cache.gather(1, table, 10)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    assert cache.k[0].abs().sum() == 0                           # other layers untouched
    cache.write(1, table, k[:, :, :2], v[:, :, :2], start_pos=10)  # the last two positions of block 7
    assert torch.equal(cache.k[1][7, 2:], k[0, :, :2].transpose(0, 1))
    with pytest.raises(ValueError, match="do not fit in 3 blocks"):
        cache.write(1, table, k, v, start_pos=4)
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        cache.write(1, table, k[:, :1], v[:, :1])
