"""Paged attention equals contiguous attention: logits through block tables match the model's own forward."""
from __future__ import annotations

import random
import warnings

import pytest
import torch

import llminfer
from llminfer.engine import (AttentionMetadata, BlockManager, ModelRunner, PagedKVCache, SamplingParams, Sequence,
                             get_paged_kernel, paged_kernels, register_paged_kernel)
from small_models import SMALL_CONFIGS, random_model


@pytest.fixture(scope="module")
def model():
    return random_model(SMALL_CONFIGS["llama-gqa-tied"])


def _shuffled_pool(num_blocks: int, block_size: int, seed: int = 0) -> BlockManager:
    """A block manager whose free queue is shuffled, so block tables are scattered over the pool."""
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    order = list(manager.free_queue.items())
    random.Random(seed).shuffle(order)
    manager.free_queue.clear()
    manager.free_queue.update(order)
    return manager


def _step(runner: ModelRunner, seqs, query_lens, block_size):
    """Runs one flattened step over seqs (each chunk ends at its last token); returns logits (S, vocab)."""
    metadata = AttentionMetadata(seqs=seqs, query_lens=query_lens, context_lens=[s.num_computed_tokens for s in seqs],
                                 block_tables=[list(s.block_table) for s in seqs], block_size=block_size)
    logits = runner.logits(metadata)
    for seq, n in zip(seqs, query_lens):
        seq.num_computed_tokens += n
    return logits


@pytest.mark.parametrize("kernel, block_size", [("gather", 1), ("gather", 16), ("gather", 64), ("flex", 16)])
def test_paged_logits_equal_contiguous(model, block_size, kernel):
    """Three sequences in one pool, their blocks interleaved: a prefill, a chunked prefill and decode steps,
    side by side in one flattened batch, give the logits each sequence gets alone (within 1e-5). FlexAttention
    runs unfused on a CPU (slow), so it is checked at one block size."""
    vocab = model.config.vocab_size
    rng = random.Random(block_size)
    lengths = [5, 37, 70]                              # each ends mid-block for block sizes 16 and 64
    tokens = [[rng.randrange(vocab) for _ in range(n + 3)] for n in lengths]
    manager = _shuffled_pool(64 * 4 // block_size + 8, block_size)
    cache = PagedKVCache.for_model(model, manager.num_blocks, block_size, kernel=kernel)
    runner = ModelRunner(model, cache)
    seqs = [Sequence(i, t[:n], SamplingParams(), 0.0) for i, (t, n) in enumerate(zip(tokens, lengths))]

    def expected(i):
        return model(torch.tensor([seqs[i].token_ids]))[0, -1]

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        # step 1: sequence 0 whole, sequence 2's first chunk of 30 positions (its logits are not wanted yet)
        for seq, n in ((seqs[0], 5), (seqs[2], 30)):
            assert manager.allocate(seq, n)
        metadata = AttentionMetadata(seqs=[seqs[0], seqs[2]], query_lens=[5, 30], context_lens=[0, 0],
                                     block_tables=[seqs[0].block_table, seqs[2].block_table], block_size=block_size,
                                     sample=[True, False])
        logits = runner.logits(metadata)
        assert logits.shape == (1, vocab)
        torch.testing.assert_close(logits[0], expected(0), rtol=1e-5, atol=1e-5)
        seqs[0].num_computed_tokens, seqs[2].num_computed_tokens = 5, 30
        # step 2: sequence 1 whole, sequence 2's remaining 40 positions
        assert manager.allocate(seqs[1], 37) and manager.allocate(seqs[2], 40)
        logits = _step(runner, [seqs[1], seqs[2]], [37, 40], block_size)
        torch.testing.assert_close(logits[0], expected(1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[1], expected(2), rtol=1e-5, atol=1e-5)
        # steps 3-5: every sequence decodes one token (a new block now and then), all three at once
        for step in range(3 if kernel == "gather" else 1):     # (unfused FlexAttention is slow on a CPU)
            for seq, t in zip(seqs, tokens):
                seq.token_ids.append(t[len(seq.token_ids)])
                assert manager.allocate(seq, 1)
            logits = _step(runner, seqs, [1, 1, 1], block_size)
            for i in range(3):
                torch.testing.assert_close(logits[i], expected(i), rtol=1e-5, atol=1e-5)
    tables = [s.block_table for s in seqs]
    assert len({b for t in tables for b in t}) == sum(len(t) for t in tables)   # no block shared
    if block_size == 1:
        assert tables[2] != sorted(tables[2])                                   # scattered over the pool


def test_gathered_kv_equal_the_contiguous_cache(model):
    ids = torch.randint(0, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(0))
    contiguous = model.new_cache(1, max_seq_len=32)
    llminfer.prefill(model, ids, contiguous)
    paged = PagedKVCache.for_model(model, num_blocks=4, block_size=8)
    llminfer.prefill(model, ids, paged)
    assert paged.block_tables == [[0, 1, 2]] and paged.length == 23
    for layer in range(model.config.n_layers):
        k, v = paged.gather(layer, paged.block_tables[0], 23)
        ref_k, ref_v = contiguous.get(layer)
        torch.testing.assert_close(k, ref_k, rtol=0, atol=0)      # the same numbers, stored elsewhere
        torch.testing.assert_close(v, ref_v, rtol=0, atol=0)


def test_standalone_paged_cache_runs_prefill_and_decode_like_kvcache(model):
    """Without an engine the paged cache keeps its own block tables: prefill and decode_step work on it."""
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    contiguous = model.new_cache(2, max_seq_len=40)
    paged = PagedKVCache.for_model(model, num_blocks=10, block_size=4)
    assert isinstance(paged, llminfer.Cache)
    a, b = llminfer.prefill(model, ids, contiguous), llminfer.prefill(model, ids, paged)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    token = a.argmax(-1)
    for _ in range(6):
        a = llminfer.decode_step(model, token, contiguous)
        b = llminfer.decode_step(model, token, paged)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        token = a.argmax(-1)
    assert paged.length == contiguous.length == 19
    assert [len(t) for t in paged.block_tables] == [5, 5]              # ceil(19 / 4) blocks each
    with pytest.raises(ValueError, match="need 12 blocks of 4 but the pool has 10"):
        llminfer.prefill(model, torch.zeros(2, 3, dtype=torch.long), paged)   # 22 positions each: too many
    paged.reset()
    assert paged.length == 0 and paged.block_tables == []


def test_a_bound_step_refuses_a_foreign_input(model):
    manager = BlockManager(4, 16)
    cache = PagedKVCache.for_model(model, 4, 16)
    seq = Sequence(0, [1, 2, 3], SamplingParams(), 0.0)
    manager.allocate(seq, 3)
    cache.bind(AttentionMetadata([seq], [3], [0], [seq.block_table], 16))
    with pytest.raises(ValueError, match=r"runs 3 tokens as input_ids of shape \(1, 3\), got \(1, 4\)"):
        model(torch.tensor([[1, 2, 3, 4]]), torch.arange(4), cache)
    with pytest.raises(ValueError, match="positions disagree"):
        model(torch.tensor([[1, 2, 3]]), torch.tensor([1, 2, 3]), cache)


def test_copy_on_write_gives_a_forked_sequence_its_own_last_block(model):
    """Parallel sampling shares the prompt's blocks; the first write into a shared block copies it."""
    block_size = 4
    manager = BlockManager(8, block_size, enable_prefix_caching=False)
    cache = PagedKVCache.for_model(model, 8, block_size)
    runner = ModelRunner(model, cache)
    prompt = [5, 6, 7, 8, 9, 10]                                     # 1.5 blocks
    parent = Sequence(0, prompt, SamplingParams(), 0.0)
    manager.allocate(parent, len(prompt))
    _step(runner, [parent], [len(prompt)], block_size)
    child = Sequence(1, prompt, SamplingParams(), 0.0)
    manager.fork(parent, child)
    assert child.block_table == parent.block_table and manager.blocks[parent.block_table[1]].ref_count == 2
    shared_last = parent.block_table[1]
    before = cache.k[0][shared_last].clone()
    # the two continue with different tokens: each first write into the half-full shared block copies it
    for seq, token in ((parent, 11), (child, 12)):
        seq.token_ids.append(token)
        pair = manager.copy_on_write(seq)
        if pair:
            cache.copy_blocks([pair])
        assert manager.allocate(seq, 1)
    assert parent.block_table[0] == child.block_table[0]              # the full block stays shared
    assert parent.block_table[1] != child.block_table[1]              # the partial one was copied once
    assert manager.blocks[parent.block_table[0]].ref_count == 2
    logits = _step(runner, [parent, child], [1, 1], block_size)
    torch.testing.assert_close(cache.k[0][shared_last][:2], before[:2])  # the copy's source kept its rows
    for i, seq in enumerate((parent, child)):
        torch.testing.assert_close(logits[i], model(torch.tensor([seq.token_ids]))[0, -1], rtol=1e-5, atol=1e-5)
    manager.free(parent)
    manager.free(child)
    manager.check_consistency([])


def test_paged_kernel_registry():
    assert {"gather", "flex"} <= set(paged_kernels())
    calls = []

    def kernel(q, k_pool, v_pool, metadata, backend):
        calls.append(metadata.num_tokens)
        return get_paged_kernel("gather")(q, k_pool, v_pool, metadata, backend)

    register_paged_kernel("test-counting", kernel)
    with pytest.raises(ValueError, match="already registered"):
        register_paged_kernel("test-counting", lambda *a: None)
    with pytest.raises(ValueError, match="unknown paged-attention kernel 'nope'"):
        PagedKVCache(1, 1, 8, 4, 4, kernel="nope")
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = PagedKVCache.for_model(model, 4, 4, kernel="test-counting")
    llminfer.prefill(model, torch.tensor([[1, 2, 3]]), cache)
    assert calls == [3] * model.config.n_layers


def test_pool_bytes_and_refusals(model, monkeypatch):
    cfg = model.config
    cache = PagedKVCache.for_model(model, num_blocks=6, block_size=8)
    assert cache.nbytes == llminfer.kv_cache_bytes(cfg, 48, 4) == 2 * cfg.n_layers * 48 * cfg.n_kv_heads * \
        cfg.head_dim * 4                                                          # 48 positions, stored as blocks
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache.for_model(model, num_blocks=4, block_size=12)
    monkeypatch.setattr("llminfer.device.free_memory_bytes", lambda device: 1 << 20)
    with pytest.raises(MemoryError, match="pass a smaller num_blocks"):
        PagedKVCache.for_model(model, num_blocks=1 << 16, block_size=16)


@pytest.mark.gpu
def test_flex_kernel_on_cuda_equals_gather():
    """On CUDA the default kernel is FlexAttention (compiled); its tokens equal the gather kernel's. head_dim 16:
    inductor refuses FlexAttention below 16 on CUDA, and the engine would fall back to gather."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from llminfer.engine import LLMEngine

    config = SMALL_CONFIGS["llama-gqa-tied"].replace(dim=128)            # 8 heads of 16
    assert config.head_dim >= 16
    model = random_model(config).to("cuda")
    prompts = [[(7 * i + j) % 100 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    params = SamplingParams(max_new_tokens=8)
    flex = LLMEngine(model, block_size=16, max_num_seqs=4)
    assert flex.cache.kernel_name == "flex"
    gather = LLMEngine(model, block_size=16, max_num_seqs=4, kernel="gather")
    assert [o.token_ids for o in flex.generate(prompts, params)] == [o.token_ids for o in gather.generate(prompts, params)]
    assert flex.cache.kernel_name == "flex"             # no fallback
    assert flex.stats.paged_kernel == "flex" and flex.stats.kernel_fallbacks == 0, flex.stats.kernel_fallback
