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


def test_forward_writes_in_place_at_start_pos():
    config = SMALL_CONFIGS["llama-mha-untied"]
    model = random_model(config)
    cache = model.new_cache(max_seq_len=16)
    buffer_address = cache.k[0].data_ptr()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    with torch.no_grad():
        model(ids[:, :4], cache=cache, start_pos=0)
        assert cache.length == 4 and cache.k[0][:, :, 4:].abs().max() == 0
        model(ids[:, 4:], cache=cache, start_pos=4)
    assert cache.length == 6 and cache.k[0].data_ptr() == buffer_address
    # the stored keys equal those a fresh full pass computes
    fresh = model.new_cache(max_seq_len=16)
    with torch.no_grad():
        model(ids, cache=fresh)
    for layer in range(config.n_layers):
        torch.testing.assert_close(cache.k[layer][:, :, :6], fresh.k[layer][:, :, :6])
        torch.testing.assert_close(cache.v[layer][:, :, :6], fresh.v[layer][:, :, :6])


def test_writing_past_capacity_is_refused_before_compute():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    cache = model.new_cache(max_seq_len=8)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=r"needs 9 positions.*max_seq_len=8"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache, start_pos=6)
    assert cache.length == 6
    with pytest.raises(ValueError, match="skips past"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache, start_pos=7)
    with pytest.raises(ValueError, match="batch_size=1"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache, start_pos=6)
    with pytest.raises(ValueError, match="longer than the model's max_seq_len"):
        model.new_cache(max_seq_len=10_000)
