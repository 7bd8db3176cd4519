"""The radix tree of chapter 13: hand-worked cases of insert, match, split, locks and LRU eviction; its block
pool's invariants; and the engine with prefix_cache="radix" making the same greedy tokens as with block hashes
or no cache, under pool pressure too."""
from __future__ import annotations

import random

import pytest

import llminfer
from llminfer.engine import LLMEngine, SamplingParams, Sequence
from llminfer.engine.radix_cache import RadixBlockManager, RadixCache
from small_models import SMALL_CONFIGS, random_model


def seq(request_id: int, tokens) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(), 0.0)


# --- the tree alone (block_size 2: every pair of tokens is one block) -------------------------------------------

def test_insert_and_match_share_a_prefix_and_split_an_edge():
    tree = RadixCache(block_size=2)
    leaf, cached = tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    assert cached == 0 and tree.num_blocks == 3 and leaf.tokens == (1, 2, 3, 4, 5, 6)
    assert tree.match_prefix([1, 2, 3, 4, 9, 9])[:2] == (4, [10, 11])      # parts ways inside the edge
    assert tree.match_prefix([1, 2, 3])[:2] == (2, [10])                   # whole blocks only
    assert tree.match_prefix([1, 9])[:2] == (0, [])
    assert tree.match_prefix([2, 1, 3, 4]).node is tree.root

    # a second path that parts ways after two blocks: the edge splits there, only block 22 is new
    other, cached = tree.insert([1, 2, 3, 4, 7, 8], [20, 21, 22])
    assert cached == 2 and tree.num_blocks == 4 and other.blocks == [22]
    (upper,) = tree.root.children.values()
    assert upper.tokens == (1, 2, 3, 4) and upper.blocks == [10, 11]
    assert sorted(upper.children) == [(5, 6), (7, 8)] and other.parent is upper
    assert tree.match_prefix([1, 2, 3, 4, 7, 8, 0]) == (6, [10, 11, 22], other)
    assert tree.match_prefix([1, 2, 3, 4, 5, 6]).blocks == [10, 11, 12]

    # a prefix of what is there adds nothing, but splits the edge so that its path ends at a node
    node, cached = tree.insert([1, 2], [30])
    assert cached == 1 and node.tokens == (1, 2) and node.blocks == [10] and tree.num_blocks == 4
    assert sorted(n.tokens for n in tree.nodes()) == [(1, 2), (3, 4), (5, 6), (7, 8)]
    with pytest.raises(ValueError, match="whole blocks"):
        tree.insert([1, 2, 3], [40, 41])


def test_locks_keep_a_path_and_eviction_exposes_the_parent_as_a_leaf():
    tree = RadixCache(block_size=2)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    leaf78, _ = tree.insert([1, 2, 3, 4, 7, 8], [20, 21, 22])
    leaf56 = tree.match_prefix([1, 2, 3, 4, 5, 6]).node
    tree.lock(leaf56)                                             # a request runs on 1 2 3 4 5 6
    assert leaf56.lock_ref == leaf56.parent.lock_ref == 1 and leaf78.lock_ref == 0
    assert tree.num_evictable_blocks == 1
    assert tree.evict(10) == [22]                                 # only the unlocked leaf can go
    assert tree.num_blocks == 3 and tree.match_prefix([1, 2, 3, 4, 7, 8]).num_tokens == 4
    tree.unlock(leaf56)
    # now 5 6 goes, which leaves 1 2 3 4 a leaf, which goes next, last block first
    assert tree.evict(10) == [12, 11, 10]
    assert tree.num_blocks == 0 and not tree.root.children and tree.evict(1) == []
    with pytest.raises(RuntimeError):
        tree.unlock(leaf56)                                       # unlocked twice


def test_eviction_is_least_recently_used_first_and_takes_a_leafs_last_blocks_first():
    tree = RadixCache(block_size=2)
    tree.insert([1, 1], [1])
    tree.insert([2, 2], [2])
    tree.insert([3, 3, 4, 4, 5, 5], [3, 4, 5])
    tree.match_prefix([1, 1, 9])                                  # 1 1 is used again: now the most recent
    assert tree.evict(1) == [2]                                   # the oldest
    assert tree.evict(2) == [5, 4]                                # the next oldest, from its end
    assert tree.match_prefix([3, 3, 4, 4, 5, 5]).num_tokens == 2  # its first block is still there (and now recent)
    assert tree.evict(5) == [1, 3]


def test_the_tree_matches_what_a_list_of_inserted_prefixes_says():
    """Random paths over a 3-token alphabet (many shared prefixes, many splits): match_prefix gives the longest
    common whole-block prefix with any inserted path, and the blocks are the ones first inserted for it."""
    rng = random.Random(0)
    tree, size = RadixCache(block_size=2), 2
    owner: dict[tuple, int] = {}                                  # a whole-block prefix -> the block at its end
    next_block = 0
    for _ in range(200):
        tokens = [rng.randrange(3) for _ in range(2 * rng.randint(1, 6))]
        blocks = list(range(next_block, next_block + len(tokens) // size))
        next_block += len(blocks)
        _, cached = tree.insert(tokens, blocks)
        for i in range(len(blocks)):
            key = tuple(tokens[:(i + 1) * size])
            assert (key in owner) == (i < cached)
            owner.setdefault(key, blocks[i])
        query = [rng.randrange(3) for _ in range(rng.randint(0, 12))]
        n = 0
        while n + size <= len(query) and tuple(query[:n + size]) in owner:
            n += size
        match = tree.match_prefix(query)
        assert match.num_tokens == n
        assert match.blocks == [owner[tuple(query[:(i + 1) * size])] for i in range(n // size)]
    assert tree.num_blocks == len(owner)


# --- the tree in front of the block pool ---------------------------------------------------------------------------

def test_blocks_come_back_to_the_pool_exactly_once():
    """Worked by hand with 6 blocks of 2: a finished request's blocks stay cached, a second request shares its
    first two and splits the edge, an allocation that cannot fit changes nothing, and eviction feeds the free
    queue, least recently used leaf first."""
    bm = RadixBlockManager(num_blocks=6, block_size=2)
    a = seq(0, [1, 2, 3, 4, 5, 6, 7])
    assert bm.get_computed_blocks(a) == [] and bm.allocate(a, 7)
    assert a.block_table == [0, 1, 2, 3] and [b.ref_count for b in bm.blocks] == [2, 2, 2, 1, 0, 0]
    a.num_computed_tokens = 7
    bm.check_consistency([a])
    bm.free(a)                                                    # 0 1 2 stay in the tree, 3 (half full) is free
    assert list(bm.free_queue) == [4, 5, 3] and bm.tree.num_blocks == 3
    assert (bm.num_free_blocks, bm.num_cached_free_blocks, bm.num_used_blocks) == (6, 3, 0)
    bm.check_consistency([])

    b = seq(1, [1, 2, 3, 4, 9, 9, 9])
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    assert bm.allocate(b, 3, hits) and b.block_table == [0, 1, 4, 5] and b.num_computed_tokens == 4
    assert bm.tree.match_prefix([1, 2, 3, 4, 9, 9]).blocks == [0, 1, 4]
    bm.check_consistency([b])

    c = seq(2, [30] * 8)                                          # 4 blocks; free: 3, evictable: 2 (for 5 6)
    assert bm.num_free_blocks == 2 and not bm.allocate(c, 8)
    assert c.block_table == [] and list(bm.free_queue) == [3] and bm.evictions == 0
    bm.check_consistency([b])
    b.num_computed_tokens = 7
    bm.free(b)
    assert list(bm.free_queue) == [3, 5] and bm.num_free_blocks == 6
    assert bm.allocate(c, 8)                                      # evicts 5 6 (block 2), then 9 9 (block 4)
    assert c.block_table == [3, 5, 2, 4] and bm.evictions == 2 and not bm.free_queue
    assert bm.tree.match_prefix([1, 2, 3, 4, 5, 6]).blocks == [0, 1]
    bm.check_consistency([c])
    c.num_computed_tokens = 8
    bm.free(c)
    bm.check_consistency([])
    assert len(bm.free_queue) + bm.tree.num_blocks == 6 and bm.num_free_blocks == 6
    bm._evict_blocks(6)                                           # the whole tree back to the pool, once each
    assert sorted(bm.free_queue) == list(range(6)) and bm.tree.num_blocks == 0 and bm.evictions == 8
    bm.check_consistency([])
    with pytest.raises(RuntimeError):
        bm._release(3)                                            # released once already: no double free


def test_random_traffic_keeps_the_pool_consistent():
    """Allocations, decodes, frees and failures in random order over a small pool: after every operation each
    block is free, cached or held, ref counts match, and every block is in exactly one of those places."""
    rng = random.Random(1)
    bm = RadixBlockManager(num_blocks=12, block_size=2)
    running: list[Sequence] = []
    for request_id in range(300):
        if running and rng.random() < 0.4:
            s = running.pop(rng.randrange(len(running)))
            if rng.random() < 0.1:
                bm.discard(s)
            bm.free(s)
        elif running and rng.random() < 0.5:
            s = rng.choice(running)                               # one decode step
            s.token_ids.append(rng.randrange(3))
            if bm.allocate(s, 1):
                s.num_computed_tokens += 1
            else:
                s.token_ids.pop()
        else:
            s = seq(request_id, [rng.randrange(3) for _ in range(rng.randint(1, 9))])
            hits = bm.get_computed_blocks(s)
            if bm.allocate(s, s.num_tokens - len(hits) * 2, hits):
                s.num_computed_tokens = s.num_tokens
                running.append(s)
        bm.check_consistency(running)
        held = {b for s in running for b in s.block_table}
        cached = {b for node in bm.tree.nodes() for b in node.blocks}
        assert held | cached | set(bm.free_queue) == set(range(12))
        assert not set(bm.free_queue) & (held | cached)
    assert bm.evictions > 0 and bm.hit_tokens == 0                # record_lookup is the scheduler's


# --- the engine ----------------------------------------------------------------------------------------------------

def run(model, prompts, kind, max_new_tokens=6, **settings):
    engine = LLMEngine(model, enable_prefix_caching=kind is not None, prefix_cache=kind or "hash", **settings)
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    engine.block_manager.check_consistency([])
    return [o.token_ids for o in outputs], engine.stats


def shared_prompts(rng, vocab, n, prefix_len, first=3):
    prefix = [rng.randrange(first, vocab) for _ in range(prefix_len)]
    stems = [prefix + [rng.randrange(first, vocab) for _ in range(rng.randint(2, 12))] for _ in range(3)]
    return [rng.choice(stems) + [rng.randrange(first, vocab) for _ in range(rng.randint(1, 10))] for _ in range(n)]


@pytest.mark.parametrize("num_blocks", [None, 24])
def test_greedy_tokens_are_the_same_with_either_cache_or_none(num_blocks):
    """A random GQA Llama; 24 blocks of 4 is pool pressure: eviction and preemption both happen."""
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    prompts = shared_prompts(random.Random(2), model.config.vocab_size, 10, 30)
    settings = dict(block_size=4, num_blocks=num_blocks, max_num_seqs=6, max_num_batched_tokens=64,
                    max_model_len=80)
    tokens = {kind: run(model, prompts, kind, 8, **settings) for kind in ("hash", "radix", None)}
    assert tokens["radix"][0] == tokens["hash"][0] == tokens[None][0]
    radix, hashed = tokens["radix"][1], tokens["hash"][1]
    assert radix.prefix_hit_tokens > 0 and hashed.prefix_hit_tokens > 0
    if num_blocks:
        assert radix.evictions > 0 and radix.preemptions > 0
    else:                                       # nothing evicted: both find every whole cached block
        assert radix.prefix_hit_tokens == hashed.prefix_hit_tokens


def test_greedy_tokens_are_the_same_on_the_bundled_model():
    model, tokenizer = llminfer.load_pretrained("tiny-capitals")
    prompts = [tokenizer.encode(f"The capital of {c} is") for c in ("France", "Spain", "Italy", "Japan")]
    prompts += [p + p for p in prompts]                           # the second copies share the first ones
    settings = dict(block_size=4, num_blocks=12, max_num_seqs=3, max_model_len=48)
    results = {kind: run(model, prompts, kind, 8, **settings) for kind in ("hash", "radix", None)}
    assert results["radix"][0] == results["hash"][0] == results[None][0]
    assert results["radix"][1].evictions > 0


def test_an_unknown_prefix_cache_is_refused_before_anything_is_allocated():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    with pytest.raises(ValueError, match="prefix_cache must be one of hash, radix.*'trie'"):
        LLMEngine(model, num_blocks=8, max_model_len=64, prefix_cache="trie")
    engine = LLMEngine(model, num_blocks=8, max_model_len=64, prefix_cache="radix")
    assert isinstance(engine.block_manager, RadixBlockManager) and "prefix_cache='radix'" in repr(engine)
    assert LLMEngine(model, num_blocks=8, max_model_len=64).prefix_cache == "hash"   # the default is unchanged


# --- the two workloads of chapter 13 -------------------------------------------------------------------------------

def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from llminfer.checkpoint import load_tokenizer
    return load_tokenizer("smollm2-135m-instruct")


@pytest.mark.parametrize("with_tokenizer", [True, False])
def test_the_tree_saves_at_least_what_the_hashes_save_on_both_workloads(smollm2_tokenizer, with_tokenizer):
    """Few-shot and multi-turn chat, through SmolLM2's chat template (a random model with its vocabulary) or as
    random ids: the same tokens with either cache or none, and every whole cached block is found. Few-shot: each
    request after the first reuses the shared prefix's whole blocks. Multi-turn: each later turn reuses the
    whole blocks of the previous turn's prompt and answer that its own prompt repeats."""
    from llminfer.engine.workload import few_shot_workload, measure_prefix_cache, multi_turn_workload
    tokenizer = smollm2_tokenizer if with_tokenizer else None
    vocab = 49152 if with_tokenizer else 512
    model = random_model(llminfer.ModelConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                              hidden_dim=64, max_seq_len=1024, tie_embeddings=True))
    eos = tokenizer.eos_token_id if tokenizer else None
    size = 16
    workloads = {"few-shot": few_shot_workload(5, tokenizer, shots=6, max_new_tokens=2, vocab_size=vocab),
                 "chat": multi_turn_workload(3, 3, tokenizer, max_new_tokens=6, vocab_size=vocab)}
    for name, workload in workloads.items():
        runs = {kind: measure_prefix_cache(model, workload, kind, eos_token_id=eos, block_size=size, max_num_seqs=8)
                for kind in ("hash", "radix", None)}
        assert [o.token_ids for o in runs["radix"].outputs] == [o.token_ids for o in runs["hash"].outputs] \
            == [o.token_ids for o in runs[None].outputs], name
        radix, hashed = runs["radix"], runs["hash"]
        assert radix.saved_tokens >= hashed.saved_tokens > 0 and runs[None].saved_tokens == 0, name
        assert radix.computed_tokens + radix.saved_tokens == runs[None].computed_tokens
        assert radix.hit_rate == pytest.approx(radix.stats.prefix_hit_rate)
        prompts = [o.prompt_token_ids for o in radix.outputs]
        cached = [o.num_cached_tokens for o in radix.outputs]
        if name == "few-shot":
            shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
            assert shared >= 6 * 10 and cached == [0] + [shared // size * size] * 4
        else:                                       # turn by turn: conversation c's turn t is output t * 3 + c
            for i in range(3, 9):
                before = radix.outputs[i - 3]
                repeated = common_prefix(prompts[i], before.prompt_token_ids + before.token_ids[:-1])
                assert cached[i] >= repeated // size * size, i
        tree = radix.engine.block_manager.tree
        assert tree.num_blocks == radix.stats.blocks_cached_free > 0 and radix.stats.blocks_used == 0
