"""The KV cache: its size in bytes, its bounds, and writing in place."""
from __future__ import annotations

import pytest
import torch

import llminfer
from small_models import SMALL_CONFIGS, random_model


def test_llama3_8b_needs_128_kib_per_token_in_fp16():
    config = llminfer.get_preset("llama-3-8b")
    assert (config.n_layers, config.n_kv_heads, config.head_dim) == (32, 8, 128)
    per_token = llminfer.kv_cache_bytes(config, seq_len=1, dtype_bytes=2)
    assert per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert llminfer.kv_cache_bytes(config, 8192, 2, batch_size=4) == 4 * 8192 * 128 * 1024
    assert llminfer.kv_cache_bytes(config, 1, torch.float32.itemsize) == 256 * 1024
    assert llminfer.kv_cache_bytes is llminfer.costs.kv_cache_bytes           # one function, one signature


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_formula_matches_an_allocated_cache(dtype):
    config = SMALL_CONFIGS["llama-gqa-tied"]
    model = llminfer.Transformer(config).to(dtype)
    cache = model.new_cache(batch_size=3, max_seq_len=77)
    assert cache.k[0].shape == (3, config.n_kv_heads, 77, config.head_dim)
    assert cache.k[0].dtype == dtype
    assert cache.nbytes == llminfer.kv_cache_bytes(config, 77, dtype.itemsize, batch_size=3)


def test_the_cache_owns_its_length_and_writes_in_place():
    config = SMALL_CONFIGS["llama-mha-untied"]
    model = random_model(config)
    cache = model.new_cache(max_seq_len=16)
    assert isinstance(cache, llminfer.Cache)
    buffer_address = cache.k[0].data_ptr()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    llminfer.prefill(model, ids[:, :4], cache)
    assert cache.length == 4 and cache.k[0][:, :, 4:].abs().max() == 0
    llminfer.prefill(model, ids[:, 4:], cache)             # continues at position 4: chunked prefill
    assert cache.length == 6 and cache.k[0].data_ptr() == buffer_address
    # the stored keys equal those a fresh full pass computes
    fresh = model.new_cache(max_seq_len=16)
    llminfer.prefill(model, ids, fresh)
    for layer in range(config.n_layers):
        for mine, theirs in zip(cache.get(layer), fresh.get(layer)):
            assert mine.shape == (1, config.n_kv_heads, 6, config.head_dim)
            torch.testing.assert_close(mine, theirs)


def test_explicit_positions_equal_the_cache_s_own():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    a, b = model.new_cache(max_seq_len=8), model.new_cache(max_seq_len=8)
    with torch.inference_mode():
        model(ids[:, :4], cache=a)
        model(ids[:, :4], positions=torch.arange(4), cache=b)
        torch.testing.assert_close(model(ids[:, 4:], cache=a), model(ids[:, 4:], positions=torch.tensor([4, 5]), cache=b))
        with pytest.raises(ValueError, match="start at position 1 but the cache holds 6.*truncate"):
            model(ids[:, :1], positions=torch.tensor([1]), cache=b)
        with pytest.raises(ValueError, match="not consecutive"):
            model(ids[:, :2], positions=torch.tensor([6, 8]), cache=b)
    assert b.length == 6


def test_truncate_rolls_back_and_rewrites():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=10)
    llminfer.prefill(model, torch.tensor([[3, 1, 4, 1, 5]]), cache)
    wrong = llminfer.prefill(model, torch.tensor([[7, 7]]), cache)         # two guessed tokens, then rejected
    cache.truncate(5)
    right = llminfer.prefill(model, torch.tensor([[9]]), cache)
    fresh = model.new_cache(max_seq_len=10)
    expected = llminfer.prefill(model, torch.tensor([[3, 1, 4, 1, 5, 9]]), fresh)
    torch.testing.assert_close(right, expected)
    assert not torch.allclose(wrong, expected) and cache.length == 6
    with pytest.raises(ValueError, match=r"truncate takes a length in 0..6"):
        cache.truncate(7)


def test_an_interrupted_prefill_leaves_the_cache_consistent():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=16)
    llminfer.prefill(model, torch.tensor([[3, 1, 4]]), cache)
    cache.truncate(0)                                                       # overwrite from the start ...

    def stop(module, args):
        raise KeyboardInterrupt
    handle = model.layers[1].register_forward_pre_hook(stop)
    with pytest.raises(KeyboardInterrupt):
        llminfer.prefill(model, torch.tensor([[8, 8, 8, 8, 8]]), cache)   # ... interrupted after layer 0
    handle.remove()
    assert cache.length == 0                                                # nothing half-written counts
    token = llminfer.prefill(model, torch.tensor([[2, 7]]), cache)
    fresh = model.new_cache(max_seq_len=16)
    torch.testing.assert_close(token, llminfer.prefill(model, torch.tensor([[2, 7]]), fresh))


def test_writing_past_capacity_is_refused_before_compute():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=8)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"needs 9 positions.*max_seq_len=8"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    assert cache.length == 6
    with pytest.raises(ValueError, match="batch_size=1"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="longer than the model's max_seq_len"):
        model.new_cache(max_seq_len=10_000)
    assert cache.length == 6


def test_reset_starts_a_new_request():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=8)
    first = llminfer.prefill(model, torch.tensor([[1, 2, 3]]), cache)
    cache.reset()
    assert cache.length == 0 and cache.get(0)[0].shape[2] == 0
    torch.testing.assert_close(llminfer.prefill(model, torch.tensor([[1, 2, 3]]), cache), first)


# --- one bookkeeping, one protocol, every cache ------------------------------------------------------------

def _caches(model):
    """Each cache class, made for `model` with room for 32 positions of one sequence."""
    from llminfer.engine import PagedKVCache
    from llminfer.quant import Int8KVCache
    from llminfer.static_cache import StaticKVCache
    return {"KVCache": model.new_cache(max_seq_len=32), "StaticKVCache": StaticKVCache.for_model(model, 1, 32),
            "Int8KVCache": Int8KVCache.for_model(model, max_seq_len=32, block_size=8),
            "PagedKVCache": PagedKVCache.for_model(model, num_blocks=8, block_size=4)}


@pytest.mark.parametrize("kind", ["KVCache", "StaticKVCache", "Int8KVCache", "PagedKVCache"])
def test_truncate_then_decode_equals_never_writing_the_dropped_tokens(kind):
    from llminfer.kv_cache import CacheBase
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    rolled, fresh = _caches(model)[kind], _caches(model)[kind]
    assert isinstance(rolled, llminfer.Cache) and isinstance(rolled, CacheBase)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.inference_mode():
        llminfer.prefill(model, prompt, rolled)
        llminfer.prefill(model, torch.tensor([[7, 7]]), rolled)            # two guesses, rejected: positions 5, 6
        rolled.truncate(5)
        assert rolled.length == 5
        got = [llminfer.prefill(model, torch.tensor([[9]]), rolled)]
        got.append(llminfer.decode_step(model, got[-1].argmax(-1), rolled))
        expected = [llminfer.prefill(model, prompt, fresh), llminfer.prefill(model, torch.tensor([[9]]), fresh)]
        expected.append(llminfer.decode_step(model, expected[-1].argmax(-1), fresh))
    for mine, theirs in zip(got, expected[1:]):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    assert rolled.length == fresh.length == 7
    with pytest.raises(ValueError, match=r"truncate takes a length in 0..7"):
        rolled.truncate(8)


def test_the_paged_cache_gives_truncated_blocks_back():
    from llminfer.engine import PagedKVCache
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        llminfer.prefill(model, ids, cache)                                 # 2 blocks each
        llminfer.prefill(model, ids[:, :5], cache)                          # 11 positions: 3 blocks each
        assert [len(t) for t in cache.block_tables] == [3, 3]
        with pytest.raises(ValueError, match="need 10 blocks of 4 but the pool has 8"):
            llminfer.prefill(model, ids[:, :6], cache)                      # 17 positions: 5 blocks each
        cache.truncate(6)
        assert [len(t) for t in cache.block_tables] == [2, 2]
        llminfer.prefill(model, ids, cache)                                 # 12 positions: fits again
    assert cache.length == 12 and [len(t) for t in cache.block_tables] == [3, 3]


def test_int8_truncation_into_a_quantized_block_keeps_what_attention_saw():
    """Within the block still filling, truncation is exact (above); into a block already quantized, the kept
    keys reopen from their int8 codes: what attention reads for them does not change."""
    from llminfer.quant import Int8KVCache
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    cache, fresh = Int8KVCache.for_model(model, max_seq_len=32, block_size=4), model.new_cache(max_seq_len=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        llminfer.prefill(model, ids[:, :10], cache)                         # blocks 0, 1 quantized; 2 keys open
        before = [cache.get(layer) for layer in range(cache.n_layers)]
        cache.truncate(6)                                                   # back into block 1
        for layer, (k, v) in enumerate(before):
            for mine, theirs in zip(cache.get(layer), (k[:, :, :6], v[:, :, :6])):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        got = llminfer.prefill(model, ids[:, 6:8], cache)                   # refills block 1, quantized again
        expected = llminfer.prefill(model, ids[:, :8], fresh)
    assert cache.length == 8
    assert int(got.argmax()) == int(expected.argmax())
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * float(expected.abs().max()))


def test_the_prefill_worker_s_cache_keeps_nothing():
    from llminfer.serve.disagg import ShippingCache
    from llminfer.kv_cache import CacheBase
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    sent = []
    cache = ShippingCache(model.config.n_layers, 16, send=sent.append)
    assert isinstance(cache, CacheBase) and isinstance(cache, llminfer.Cache)
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        assert cache.length == 0 and len(sent) == 2 * model.config.n_layers
        with pytest.raises(ValueError, match="needs 17 positions but the cache holds max_seq_len=16"):
            model(torch.zeros(1, 17, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="one request at a time"):
            model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    cache.truncate(0)
    with pytest.raises(ValueError, match=r"truncate takes a length in 0..0"):
        cache.truncate(1)


# --- a split model's cache: sized from what it holds, no hook on the model ----------------------------------

def test_a_split_model_s_cache_holds_its_own_part():
    from llminfer.parallel.pipeline import pipeline_stage
    from llminfer.parallel.tensor import tensor_parallel
    config = SMALL_CONFIGS["llama-mha-untied"].replace(vocab_size=96)        # each rank: half the vocabulary
    rank = tensor_parallel(random_model(config), rank=1, world_size=2)
    stage = pipeline_stage(random_model(config), 0, 2)
    for split in (rank, stage):
        assert "new_cache" not in vars(split)                  # the model's own method, no per-instance swap
    cache = rank.new_cache(2, max_seq_len=8)
    assert (cache.n_layers, cache.k[0].shape) == (2, (2, config.n_kv_heads // 2, 8, config.head_dim))
    cache = stage.new_cache(1, max_seq_len=8)
    assert (cache.n_layers, cache.k[0].shape) == (1, (1, config.n_kv_heads, 8, config.head_dim))
    with pytest.raises(ValueError, match="longer than the model's max_seq_len"):
        rank.new_cache(1, max_seq_len=config.max_seq_len + 1)
