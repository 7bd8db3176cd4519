"""The FlexAttention paged kernel: its block mask is built from the block tables (equal to the pool-wide mask,
sized by the sequences' blocks), its automatic choice falls back visibly, and its shapes are warmed up."""
from __future__ import annotations

import random

import pytest
import torch

from llminfer.engine import AttentionMetadata, LLMEngine, PagedKVCache, SamplingParams, Sequence
from llminfer.engine import paged_attention
from llminfer.engine.paged_attention import FLEX_BLOCK, flex_block_mask, gather_attention
from llminfer.attention import fast_attention
from small_models import SMALL_CONFIGS, random_model

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")


def _metadata(num_blocks: int, block_size: int = 16, seed: int = 0) -> AttentionMetadata:
    """A mixed step over a shuffled pool: a 150-token prefill, a 60-token chunk after 40 cached positions, three
    decodes, two of them sharing a cached prefix of two blocks (the same blocks at the same columns)."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shared = [free.pop(), free.pop()]
    specs = [(0, 150, []), (40, 60, []), (70, 1, shared), (45, 1, shared), (9, 1, [])]   # (context, new, prefix)
    tables = []
    for context, new, prefix in specs:
        need = -(-(context + new) // block_size)
        tables.append(prefix + [free.pop() for _ in range(need - len(prefix))])
    seqs = [Sequence(i, [0] * (c + n), SamplingParams(), 0.0) for i, (c, n, _) in enumerate(specs)]
    return AttentionMetadata(seqs=seqs, query_lens=[n for _, n, _ in specs], context_lens=[c for c, _, _ in specs],
                             block_tables=tables, block_size=block_size).prepare("cpu")


def _pool_wide_mask(meta: AttentionMetadata, num_blocks: int) -> torch.Tensor:
    """The rule over every (token, pool slot), as the kernel's first version evaluated it: (N, slots) bool."""
    size = meta.block_size
    logical = torch.full((meta.num_seqs, num_blocks), -1, dtype=torch.long)
    for s, table in enumerate(meta.block_tables):
        logical[s, torch.tensor(table)] = torch.arange(len(table))
    kv = torch.arange(num_blocks * size)[None, :]
    slot_logical = logical[meta.token_seq[:, None], kv // size]
    return (slot_logical >= 0) & (slot_logical * size + kv % size <= meta.positions[:, None])


def _dense(mask, n_tokens: int, n_slots: int) -> torch.Tensor:
    """What a BlockMask lets through, element by element: its listed tiles, then its mask_mod inside them."""
    tiles = torch.zeros(mask.kv_num_blocks.shape[-1], -(-n_slots // FLEX_BLOCK), dtype=torch.bool)
    for row in range(tiles.shape[0]):
        count = int(mask.kv_num_blocks[0, 0, row])
        tiles[row, mask.kv_indices[0, 0, row, :count].long()] = True
    q, kv = torch.arange(n_tokens)[:, None], torch.arange(n_slots)[None, :]
    inside = tiles[q // FLEX_BLOCK, kv // FLEX_BLOCK]
    return inside & mask.mask_mod(0, 0, q, kv)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_the_block_mask_from_the_tables_equals_the_pool_wide_mask(block_size):
    num_blocks = 4096 // block_size + 8
    meta = _metadata(num_blocks, block_size)
    mask = flex_block_mask(meta, num_blocks, "cpu")
    want = _pool_wide_mask(meta, num_blocks)
    got = _dense(mask, meta.num_tokens, num_blocks * block_size)
    assert meta.num_tokens > FLEX_BLOCK                      # several query tiles
    assert torch.equal(got, want)
    assert mask.seq_lengths == (meta.num_tokens, num_blocks * block_size)
    assert flex_block_mask(meta, num_blocks, "cpu") is mask     # once per step, shared by every layer


def test_a_wrong_table_changes_the_mask():
    """The comparison above can fail: a sequence that loses a block stops seeing its slots."""
    meta = _metadata(264)
    want = _pool_wide_mask(meta, 264)
    meta2 = _metadata(264)
    meta2.block_tables[0] = meta2.block_tables[0][:-1] + [meta2.block_tables[4][0]]
    meta2.prepared = False
    with pytest.raises(AssertionError):
        assert torch.equal(_dense(flex_block_mask(meta2.prepare("cpu"), 264, "cpu"), meta2.num_tokens, 264 * 16), want)


def test_the_block_mask_grows_with_the_sequences_blocks_not_the_pool():
    small, large = _metadata(300), _metadata(300 * 64)
    masks = [flex_block_mask(meta, n, "cpu") for meta, n in ((small, 300), (large, 300 * 64))]
    n_tiles = -(-small.num_tokens // FLEX_BLOCK)
    for mask, meta in zip(masks, (small, large)):
        assert mask.kv_num_blocks.shape == (1, 1, n_tiles)
        held = len({b * 16 // FLEX_BLOCK for table in meta.block_tables for b in table})
        assert mask.kv_indices.shape[-1] <= held              # at most the key tiles the step's blocks lie in
        assert mask.q_indices is None                        # no transposed (backward) index for inference
    # a pool 64 times larger adds no (tokens × slots) work: the index width stays within the step's blocks
    assert masks[1].kv_indices.numel() <= n_tiles * sum(len(t) for t in large.block_tables)
    assert masks[1].kv_indices.numel() < 300 * 64 * 16 // FLEX_BLOCK


def test_flex_equals_gather_over_several_query_tiles():
    """Outputs, head_dim 16, GQA: FlexAttention over the pool (eager here) against gathering each sequence."""
    torch.manual_seed(0)
    num_blocks, size, n_heads, n_kv_heads, head_dim = 40, 16, 4, 2, 16
    meta = _metadata(num_blocks, size)
    k_pool, v_pool = torch.randn(2, num_blocks, size, n_kv_heads, head_dim)
    q = torch.randn(1, n_heads, meta.num_tokens, head_dim)
    flex = paged_attention.flex_attention_paged(q, k_pool, v_pool, meta)
    gather = gather_attention(q, k_pool, v_pool, meta, fast_attention)
    torch.testing.assert_close(flex, gather, atol=1e-5, rtol=1e-5)


# --- the automatic choice, visible; the warm-up ------------------------------------------------------------

def test_a_failing_automatic_kernel_falls_back_visibly_in_the_engines_stats(monkeypatch):
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])           # head_dim 16

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler for this kernel here")
    paged_attention.register_paged_kernel("broken-for-test", broken, replace=True)
    monkeypatch.setattr("llminfer.engine.paged_cache.default_paged_kernel", lambda device: "broken-for-test")
    engine = LLMEngine(model, block_size=16, num_blocks=16, max_num_seqs=2, max_model_len=64)
    assert engine.stats.paged_kernel == "broken-for-test" and engine.stats.kernel_fallbacks == 0
    with pytest.warns(UserWarning, match="'broken-for-test' failed.*kernel_fallbacks"):
        (out,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert len(out.token_ids) == 3
    stats = engine.stats
    assert stats.paged_kernel == "gather" and stats.kernel_fallbacks == 1
    assert stats.kernel_fallback.startswith("broken-for-test -> gather") and "no compiler" in stats.kernel_fallback
    chosen = LLMEngine(model, block_size=16, num_blocks=16, max_num_seqs=2, max_model_len=64,
                        kernel="broken-for-test")
    (failed,) = chosen.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
    assert failed.finish_reason == "error" and "RuntimeError" in failed.error   # the request fails alone ...
    assert chosen.stats.paged_kernel == "broken-for-test" and chosen.stats.kernel_fallbacks == 0   # ... not replaced


def test_the_warm_up_runs_both_query_regimes_and_leaves_the_pool_alone():
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    cache = PagedKVCache.for_model(model, num_blocks=24, block_size=16, kernel="flex")
    for pool in cache.k + cache.v:
        pool.normal_()
    before = [p.clone() for p in cache.k + cache.v]
    counts = cache.warm_up(model.config.n_heads)
    assert cache.kernel_name == "flex" and cache.kernel_fallbacks == 0          # no fallback
    assert counts == [1, 1, 1, 2, 2, 2, FLEX_BLOCK, FLEX_BLOCK + 1, FLEX_BLOCK + 1]   # decode; prefill (>= 128)
    assert min(counts) < FLEX_BLOCK <= max(counts)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.k + cache.v))
    small = PagedKVCache.for_model(model, num_blocks=4, block_size=16, kernel="flex")
    assert small.warm_up(model.config.n_heads) == [1, 1, 2, 2]       # too small a pool for 128 positions


def test_engines_warm_flex_up_at_init_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(PagedKVCache, "warm_up", lambda self, n_heads: calls.append((self.kernel_name, n_heads)))
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    PagedKVCache.for_model(model, num_blocks=8, block_size=16, kernel="flex")   # CPU: eager, nothing to compile
    assert calls == []
    monkeypatch.setattr(PagedKVCache, "__init__", _fake_cuda_init(PagedKVCache.__init__))
    PagedKVCache.for_model(model, num_blocks=8, block_size=16, kernel="flex")
    assert calls == [("flex", model.config.n_heads)]


def _fake_cuda_init(real):
    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        self.device = torch.device("cuda")                         # as if on a GPU (nothing runs on it here)
    return init
