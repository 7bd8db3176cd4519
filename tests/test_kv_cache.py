"""The KV cache: its size in bytes, its bounds, and writing in place."""
from __future__ import annotations

import pytest
import torch

import llminfer
from small_models import SMALL_CONFIGS, random_model


def test_llama3_8b_needs_128_kib_per_token_in_fp16():
    config = llminfer.get_preset("llama-3-8b")
    assert (config.n_layers, config.n_kv_heads, config.head_dim) == (32, 8, 128)
    per_token = llminfer.kv_cache_bytes(config, seq_len=1, dtype=torch.float16)
    assert per_token == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert llminfer.kv_cache_bytes(config, 8192, batch_size=4, dtype=torch.float16) == 4 * 8192 * 128 * 1024
    assert llminfer.kv_cache_bytes(config, 1, dtype=torch.float32) == 256 * 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_formula_matches_an_allocated_cache(dtype):
    config = SMALL_CONFIGS["llama-gqa-tied"]
    model = llminfer.Transformer(config).to(dtype)
    cache = model.new_cache(batch_size=3, max_seq_len=77)
    assert cache.k[0].shape == (3, config.n_kv_heads, 77, config.head_dim)
    assert cache.k[0].dtype == dtype
    assert cache.nbytes == llminfer.kv_cache_bytes(config, 77, batch_size=3, dtype=dtype)


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
