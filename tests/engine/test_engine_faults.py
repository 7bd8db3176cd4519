"""Faults: after random workloads with preemptions and aborts, the pool's accounting holds and outputs are right."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import llminfer
from llminfer.engine import BlockManager, LLMEngine, SamplingParams, Sequence
from llminfer.engine import model_runner as model_runner_module
from small_models import random_model

MICRO = llminfer.ModelConfig(vocab_size=61, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32,
                             max_seq_len=96)


@pytest.fixture(scope="module")
def micro():
    return random_model(MICRO, seed=3, std=0.3)


def assert_pool_empty(engine) -> None:
    bm = engine.block_manager
    bm.check_consistency([])
    assert bm.num_free_blocks == bm.num_blocks
    assert all(block.ref_count == 0 for block in bm.blocks)
    assert engine.stats.blocks_used == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("seed", range(8))
def test_random_workload_with_aborts_keeps_the_pool_consistent(micro, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = 48
    engine = LLMEngine(micro, block_size=block_size, num_blocks=-(-max_model_len // block_size) + rng.randint(0, 6),
                       max_model_len=max_model_len, max_num_seqs=rng.randint(1, 6),
                       max_num_batched_tokens=rng.choice([8, 16, 48, 96]),
                       policy=rng.choice(["continuous", "continuous", "static", "sequential"]),
                       enable_prefix_caching=rng.random() < 0.7, chunked_prefill=True)
    shared = [rng.randrange(1, MICRO.vocab_size) for _ in range(24)]
    requests, aborted = {}, set()
    for _ in range(32):
        action = rng.random()
        if action < 0.35:
            n = rng.randint(1, 30)
            prompt = (shared[:rng.randint(0, 24)] + [rng.randrange(1, MICRO.vocab_size) for _ in range(n)])[:40]
            params = SamplingParams(max_new_tokens=rng.randint(1, min(12, max_model_len - len(prompt))))
            requests[engine.add_request(prompt, params)] = (prompt, params)
        elif action < 0.45 and requests:
            request_id = rng.choice(sorted(requests))
            if engine.abort(request_id):
                aborted.add(request_id)
        else:
            engine.step()
        engine.block_manager.check_consistency(engine.unfinished_sequences)
        assert all(not s.block_table for s in engine.scheduler.waiting)      # queued requests hold no blocks
    while engine.has_unfinished():
        engine.step()
        engine.block_manager.check_consistency(engine.unfinished_sequences)
    assert_pool_empty(engine)
    # every request that was not aborted made exactly generate()'s tokens, preempted or not
    for request_id, (prompt, params) in requests.items():
        output = engine.pop_output(request_id)
        if request_id in aborted:
            assert output.finish_reason == "abort"
            continue
        assert output.finish_reason == "length"
        assert output.token_ids == llminfer.generate(micro, prompt, max_new_tokens=params.max_new_tokens).token_ids


def test_a_tight_pool_preempts_and_recovers(micro):
    engine = LLMEngine(micro, block_size=2, num_blocks=16, max_model_len=32, max_num_seqs=8, max_num_batched_tokens=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 61) for _ in range(rng.randint(4, 12))] for _ in range(8)]
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16))
    assert engine.stats.preemptions >= 3
    assert [o.token_ids for o in outputs] == [llminfer.generate(micro, p, max_new_tokens=16).token_ids for p in prompts]
    assert_pool_empty(engine)


def test_abort_frees_blocks_shared_through_the_prefix_cache(micro):
    engine = LLMEngine(micro, block_size=4, num_blocks=12, max_model_len=48)
    prefix = list(range(1, 17))
    a = engine.add_request(prefix + [20], SamplingParams(max_new_tokens=10))
    b = engine.add_request(prefix + [21], SamplingParams(max_new_tokens=10))
    engine.step()
    shared = engine.requests.unfinished[a].block_table[:4]
    assert engine.requests.unfinished[b].block_table[:4] == shared
    assert [engine.block_manager.blocks[i].ref_count for i in shared] == [2] * 4
    engine.abort(a)
    assert [engine.block_manager.blocks[i].ref_count for i in shared] == [1] * 4
    engine.block_manager.check_consistency(engine.unfinished_sequences)
    engine.abort(b)
    assert_pool_empty(engine)
    assert engine.stats.blocks_cached_free >= 4                            # the prefix stays cached, unowned


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7), st.integers(1, 9)),
                max_size=40),
       st.sampled_from([1, 2, 4]), st.booleans())
def test_block_manager_bookkeeping_under_any_sequence_of_operations(operations, block_size, caching):
    """Allocation, growth and freeing in any order: ref counts equal the block tables that hold each block,
    exactly the unused blocks are in the free queue, and every cache entry names its block's hash."""
    bm = BlockManager(12, block_size, enable_prefix_caching=caching)
    live: dict[int, Sequence] = {}
    for op, slot, n in operations:
        if op == "add" and slot not in live:
            seq = Sequence(slot, [(slot * 7 + i) % 5 for i in range(n)], SamplingParams(), 0.0)  # repeats: hits
            hits = bm.get_computed_blocks(seq)
            if bm.allocate(seq, seq.num_tokens - len(hits) * block_size, hits):
                seq.num_computed_tokens = seq.num_tokens
                live[slot] = seq
        elif op == "grow" and slot in live:
            seq = live[slot]
            seq.token_ids.extend([n % 5] * n)
            if bm.allocate(seq, n):
                seq.num_computed_tokens += n
            else:
                del seq.token_ids[-n:]
        elif op == "free" and slot in live:
            bm.free(live.pop(slot))
        bm.check_consistency(live.values())
    for seq in live.values():
        bm.free(seq)
    bm.check_consistency([])
    assert bm.num_free_blocks == 12


# --- a failed batch step leaves the other requests' samples as they are alone -----------------------------

SEEDED = [SamplingParams(max_new_tokens=12, temperature=1.0, seed=42),
          SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=7),
          SamplingParams(max_new_tokens=12),                                        # greedy
          SamplingParams(max_new_tokens=12, temperature=1.3, top_p=0.9, seed=1234)]
FAULTY_TOP_K = 13                  # the fault hook fails a request's sampling when its top_k is this


def sampling_fault(monkeypatch, fail_at: int) -> list[int]:
    """Sampling a batch that holds a row at top_k=FAULTY_TOP_K raises from its fail_at-th call on, after every row
    of the batch drew; returns the list of calls it saw."""
    real, calls = model_runner_module.sample, []

    def sample(logits, params, *args, **kwargs):
        tokens = real(logits, params, *args, **kwargs)
        if any(p.top_k == FAULTY_TOP_K for p in params):
            calls.append(1)
            if len(calls) >= fail_at:
                raise FloatingPointError("injected sampling fault")
        return tokens

    monkeypatch.setattr(model_runner_module, "sample", sample)
    return calls


@pytest.mark.parametrize("fail_at", [1, 4])
def test_a_failed_batch_step_leaves_seeded_samples_as_they_are_alone(micro, monkeypatch, fail_at):
    rng = random.Random(fail_at)
    prompts = [[rng.randrange(1, MICRO.vocab_size) for _ in range(rng.randint(3, 9))] for _ in SEEDED]
    alone = []
    for prompt, params in zip(prompts, SEEDED):                   # each request alone, no fault anywhere
        engine = LLMEngine(micro, block_size=4, num_blocks=64, max_model_len=48)
        alone.append(engine.generate([prompt], params)[0].token_ids)
    calls = sampling_fault(monkeypatch, fail_at)
    engine = LLMEngine(micro, block_size=4, num_blocks=64, max_model_len=48, max_num_seqs=8)
    faulty = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=FAULTY_TOP_K, seed=5)
    ids = [engine.add_request(p, params) for p, params in zip(prompts, SEEDED)]
    bad = engine.add_request([3, 4, 5], faulty)                   # last in the batch: the others sample first
    while engine.has_unfinished():
        engine.step()
    assert len(calls) >= fail_at and any(len(r.entries) > 1 for r in engine.trace)   # it failed inside a batch
    failed = engine.pop_output(bad)
    assert failed.finish_reason == "error" and "injected sampling fault" in failed.error
    assert len(failed.token_ids) == fail_at - 1
    outputs = [engine.pop_output(i) for i in ids]
    assert [o.finish_reason for o in outputs] == ["length"] * len(SEEDED)
    assert [o.token_ids for o in outputs] == alone
    assert_pool_empty(engine)


def test_seeded_samples_alone_are_generates(micro):
    """The reference above is itself right: a seeded request alone in the engine draws generate's tokens."""
    prompt = [5, 9, 11, 2]
    engine = LLMEngine(micro, block_size=4, num_blocks=64, max_model_len=48)
    for params in SEEDED:
        out = engine.generate([prompt], params)[0].token_ids
        assert out == llminfer.generate(micro, prompt, max_new_tokens=12, temperature=params.temperature,
                                        top_k=params.top_k, top_p=params.top_p, seed=params.seed).token_ids
