"""Prefix caching: the hash chain, shared prefixes computed once, and vLLM's worked example reproduced."""
from __future__ import annotations

import random

import pytest

import llminfer
from llminfer import instrument
from llminfer.engine import BlockManager, LLMEngine, SamplingParams, Sequence, hash_block_tokens
from small_models import SMALL_CONFIGS, random_model


def seq(request_id: int, tokens) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(), 0.0)


def test_hash_chain_names_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])                  # the same on every call and run
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    b = hash_block_tokens(a, [5, 6, 7, 8])
    assert b != hash_block_tokens(None, [5, 6, 7, 8])                  # the same tokens after another prefix
    assert b != hash_block_tokens(hash_block_tokens(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert 0 <= a < 2**64


def test_sixteen_requests_sharing_a_prefix_compute_it_once():
    """16 requests = one 128-token prefix + 8 tokens of their own: K/V rows are computed for the prefix once."""
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(128)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(8)] for _ in range(16)]
    params = SamplingParams(max_new_tokens=2)
    counted = {}
    for caching in (True, False):
        engine = LLMEngine(model, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                           enable_prefix_caching=caching)
        with instrument.count_kv(model) as counts:
            outputs = engine.generate(prompts, params)
        counted[caching] = (counts.total, [o.num_cached_tokens for o in outputs], [o.token_ids for o in outputs])
    total, cached, tokens = counted[True]
    # the prefix once, each request's own 8 tokens, and one decode step each (its second token)
    assert total == 128 + 16 * 8 + 16
    assert counted[False][0] == 16 * 136 + 16                          # without caching: every prompt in full
    assert cached == [0] + [128] * 15 and counted[False][1] == [0] * 16
    assert tokens == counted[False][2]                                 # caching changes no token


def test_prefix_caching_on_the_fast_path_changes_no_token():
    """optimize=True: requests sharing a cached prefix read its blocks in place (the native layer stack over the
    block tables) and make generate()'s tokens."""
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    rng = random.Random(1)
    vocab = model.config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))] for _ in range(8)]
    refs = [llminfer.generate(model, p, max_new_tokens=4).token_ids for p in prompts]
    hits = {}
    for optimize in (False, True):
        engine = LLMEngine(model, block_size=8, max_num_seqs=8, max_num_batched_tokens=128, optimize=optimize)
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=4))
        assert [o.token_ids for o in outputs] == refs
        hits[optimize] = [o.num_cached_tokens for o in outputs]
        again = engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))   # its prefix blocks, cached
        assert again[0].token_ids == refs[0] and again[0].num_cached_tokens >= 40
    assert hits[True] == hits[False] and sum(hits[True]) >= 40 * 4             # the same blocks were read


def test_a_prompt_shorter_than_one_block_gets_no_hit():
    """Only full blocks are cached, and the last prompt token is always recomputed (its logits are needed):
    a prompt must exceed one block by at least one token before a repeat of it hits the cache."""
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    engine = LLMEngine(model, block_size=16, max_num_seqs=4)
    for length, expected_hit in ((10, 0), (16, 0), (17, 16), (33, 32)):
        prompt = [random.Random(length).randrange(3, 97) for _ in range(length)]
        first, again = engine.generate([prompt, prompt], SamplingParams(max_new_tokens=1))
        assert (first.num_cached_tokens, again.num_cached_tokens) == (0, expected_hit), length
        engine.generate([[90, 91]], SamplingParams(max_new_tokens=1))   # unrelated traffic in between
    assert engine.stats.prefix_hit_tokens == 16 + 32


def test_vllm_design_document_example_block_manager():
    """The example of vLLM's prefix-caching design document: block size 4, 10 blocks, three requests.
    Block allocation and the free queue's order after each event are the document's, exactly."""
    bm = BlockManager(num_blocks=10, block_size=4)
    tokens0 = list(range(100, 115))                                   # request 0: 15 prompt tokens
    r0 = seq(0, tokens0)
    # time 1: 4 blocks, the first 3 full and cached, the fourth holding 3 of 4 tokens
    assert bm.allocate(r0, 15, bm.get_computed_blocks(r0))
    assert r0.block_table == [0, 1, 2, 3]
    assert [b.block_hash is not None for b in bm.blocks[:4]] == [True, True, True, False]
    r0.num_computed_tokens = 15                                       # (the step ran)
    # time 2: the first output token goes through the model: block 3 is full, so it is cached
    r0.token_ids.append(115)
    assert bm.allocate(r0, 1) and r0.block_table == [0, 1, 2, 3]
    r0.num_computed_tokens = 16
    # time 3: the next token needs a new block: block 4
    r0.token_ids.append(116)
    assert bm.allocate(r0, 1)
    r0.num_computed_tokens = 17
    assert r0.block_table == [0, 1, 2, 3, 4] and bm.blocks[3].block_hash is not None
    assert list(bm.free_queue) == [5, 6, 7, 8, 9]
    # time 4: request 1, 14 prompt tokens, the first 10 equal to request 0's: only 2 blocks (8 tokens) hit
    r1 = seq(1, tokens0[:10] + list(range(200, 204)))
    hits = bm.get_computed_blocks(r1)
    assert [b.block_id for b in hits] == [0, 1]
    assert bm.allocate(r1, 14 - 8, hits)
    assert r1.block_table == [0, 1, 5, 6] and [bm.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    # time 5: request 0 finishes: blocks 4, 3, 2 join the free queue in reverse order (2 and 3 still cached)
    bm.free(r0)
    assert list(bm.free_queue) == [7, 8, 9, 4, 3, 2]
    assert bm.blocks[2].block_hash is not None and bm.blocks[3].block_hash is not None
    # time 6: request 1 finishes
    bm.free(r1)
    assert list(bm.free_queue) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    # time 7: request 2, 29 prompt tokens, the first 12 equal to request 0's: blocks 0, 1, 2 hit and are
    # touched out of the queue; new blocks come from its head, and block 3 is evicted on the way
    r2 = seq(2, tokens0[:12] + list(range(300, 317)))
    hits = bm.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0, 1, 2]
    cached_before = set(bm.cached)
    assert bm.allocate(r2, 29 - 12, hits)
    assert r2.block_table == [0, 1, 2, 7, 8, 9, 4, 3]
    assert list(bm.free_queue) == [6, 5]
    evicted = cached_before - set(bm.cached)
    assert len(evicted) == 1 and bm.evictions == 1                    # block 3's old prefix is gone
    # its 29 positions fill seven blocks (cached as they fill); the eighth, block 3, holds one
    assert [bm.blocks[i].block_hash is not None for i in r2.block_table] == [True] * 7 + [False]
    bm.free(r2)
    bm.check_consistency([])


def test_vllm_design_document_example_engine():
    """The same example driven through the engine's step API on the bundled model."""
    model, _ = llminfer.load_pretrained("tiny-capitals")
    engine = LLMEngine(model, block_size=4, num_blocks=10, max_model_len=40, max_num_seqs=4)
    bm = engine.block_manager
    tokens0 = list(range(100, 115))
    r0 = engine.add_request(tokens0, SamplingParams(max_new_tokens=4))
    engine.step()                                                       # time 1: prefill
    assert engine.requests.unfinished[r0].block_table == [0, 1, 2, 3]
    engine.step()                                                       # time 2: block 3 full
    engine.step()                                                       # time 3: block 4 for the next position
    assert engine.requests.unfinished[r0].block_table == [0, 1, 2, 3, 4]
    r1 = engine.add_request(tokens0[:10] + list(range(200, 204)), SamplingParams(max_new_tokens=2))
    events = engine.step()                                              # time 4-5: r1 admitted, r0 finishes
    assert (r0, events[0].token_id, True) == tuple(events[0])
    assert engine.output(r1).num_cached_tokens == 8
    assert list(bm.free_queue) == [7, 8, 9, 4, 3, 2]
    engine.step()                                                       # time 6: r1 finishes
    assert not engine.has_unfinished()
    assert list(bm.free_queue) == [7, 8, 9, 4, 3, 2, 6, 5, 1, 0]
    r2 = engine.add_request(tokens0[:12] + list(range(300, 317)), SamplingParams(max_new_tokens=2))
    engine.step()                                                       # time 7
    assert engine.requests.unfinished[r2].block_table == [0, 1, 2, 7, 8, 9, 4, 3]
    assert engine.output(r2).num_cached_tokens == 12
    assert bm.evictions == 1
    stats = engine.stats
    assert (stats.prefix_hit_tokens, stats.prefix_query_tokens) == (8 + 12, 15 + 14 + 29)
    assert stats.prefix_hit_rate == pytest.approx(20 / 58)


def test_caching_off_keeps_no_hashes():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    r = seq(0, range(9))
    assert bm.get_computed_blocks(r) == [] and bm.allocate(r, 9)
    assert all(b.block_hash is None for b in bm.blocks) and not bm.cached
    bm.free(r)
    assert list(bm.free_queue) == [3, 2, 1, 0] and bm.prefix_hit_rate == 0.0
