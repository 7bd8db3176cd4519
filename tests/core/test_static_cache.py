"""The static mode of the KV cache (what CUDA graphs and compiled steps replay), checked against KVCache."""
from __future__ import annotations

import pytest
import torch

import llminfer
from llminfer.static_cache import StaticKVCache
from small_models import SMALL_CONFIGS, random_model


def test_a_static_step_writes_where_it_is_told_and_leaves_the_length_to_the_caller():
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    static, reference = StaticKVCache.for_model(model, 2, 16), model.new_cache(2, max_seq_len=16)
    assert isinstance(static, llminfer.Cache) and static.k[0].shape == reference.k[0].shape
    with torch.inference_mode():
        llminfer.prefill(model, ids[:, :6], reference)
        llminfer.prefill(model, ids[:, :6], static)              # positions=None: an ordinary forward
        assert static.length == 6
        for step in range(6, 9):
            expected = llminfer.decode_step(model, ids[:, step], reference)
            position = torch.tensor([step])                       # a device tensor: no host read of it
            got = model(ids[:, step:step + 1], positions=position, cache=static)[:, -1]
            assert static.length == step                          # not advanced: the caller knows it
            static.length = step + 1
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for layer in range(model.config.n_layers):
        for mine, theirs in zip(static.get(layer), reference.get(layer)):
            torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)


def test_slots_past_the_position_are_masked_and_the_length_is_checked():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    static, reference = StaticKVCache.for_model(model, 1, 8), model.new_cache(max_seq_len=8)
    with torch.inference_mode():
        llminfer.prefill(model, ids[:, :4], reference)
        model(ids[:, :4], positions=torch.arange(4), cache=static)   # a static prefill, as FastDecoder runs it
        static.length = 4
        for layer in range(model.config.n_layers):
            static.k[layer][:, :, 5:] = 1e3                         # stale slots must not count
        expected = llminfer.decode_step(model, ids[:, 4], reference)
        got = model(ids[:, 4:], positions=torch.tensor([4]), cache=static)[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"a cache length must be an integer in 0..8, got 9"):
        static.length = 9
