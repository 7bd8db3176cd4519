"""FLOP and byte counts against numbers worked out by hand."""
from types import SimpleNamespace

import pytest

import llminfer
from llminfer import costs
from small_models import SMALL_CONFIGS

# vocab 10, dim 4, 2 layers, 2 query heads and 1 K/V head of width 2, MLP width 8.
TINY = SimpleNamespace(vocab_size=10, dim=4, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=8,
                       head_dim=None, qkv_bias=False)


def test_layer_params_by_hand():
    # wq 4x4 + wk 4x2 + wv 4x2 + wo 4x4 = 48; gate/up/down 3 * 4 * 8 = 96
    assert costs.head_dim_of(TINY) == 2
    assert costs.layer_matmul_params(TINY) == 144
    assert costs.matmul_params(TINY) == 2 * 144 + 10 * 4
    assert costs.matmul_params(TINY, with_head=False) == 288


def test_attention_flops_are_causal():
    # 3 queries from position 0 see 1 + 2 + 3 = 6 keys; per key 2 (q.k) + 2 (p.v) FLOPs x 2 heads x 2 dims
    assert costs.attention_flops(TINY, 3) == 2 * 16 * 6
    # one query at position 3 sees 4 keys
    assert costs.attention_flops(TINY, 1, start_pos=3) == 2 * 16 * 4


def test_forward_and_prefill_flops_by_hand():
    assert costs.forward_flops(TINY, 3) == 1728 + 240 + 192          # layers + head x3 + attention
    assert costs.prefill_flops(TINY, 3) == 1728 + 80 + 192           # head on the last position only
    assert costs.prefill_flops(TINY, 3, batch_size=2) == 2 * 2000
    assert costs.decode_step_flops(TINY, cached_len=3) == 576 + 80 + 128   # the new token at position 3


def test_cache_vs_recompute_by_hand():
    prediction = costs.cache_vs_recompute_flops(TINY, prompt_len=3, new_tokens=2)
    assert prediction.cached_flops == 2000 + 784
    assert prediction.recompute_flops == 2000 + (2304 + 80 + 320)   # second token re-runs 4 positions
    assert prediction.speedup == pytest.approx(4704 / 2784)
    one = costs.cache_vs_recompute_flops(TINY, prompt_len=3, new_tokens=1)
    assert one.speedup == 1.0                                       # the first token is a prefill either way
    with pytest.raises(ValueError, match="new_tokens=0"):
        costs.cache_vs_recompute_flops(TINY, 3, 0)


def test_speedup_grows_with_context():
    short = costs.cache_vs_recompute_flops(TINY, 8, 16).speedup
    long = costs.cache_vs_recompute_flops(TINY, 64, 16).speedup
    assert 1 < short < long


def test_decode_bytes_by_hand():
    # 328 matmul weights + 2 layers x 2 norms x 4 + final norm 4 = 348 floats, all read by a decode step;
    # the model also holds its untied 10 x 4 embedding table, of which a step gathers one row
    assert costs.weight_bytes_read(TINY, 4) == 348 * 4
    assert costs.weight_bytes(TINY, 4) == (348 + 40) * 4
    assert costs.weight_bytes_read(SimpleNamespace(**{**vars(TINY), "tie_embeddings": True}), 4) == \
        costs.weight_bytes(SimpleNamespace(**{**vars(TINY), "tie_embeddings": True}), 4) == 348 * 4
    # K and V, 2 layers, 1 head of width 2, float32
    assert costs.kv_bytes_per_token(TINY, 4) == 32
    # after 4 cached positions a step reads the K/V of 5 (the new one included)
    assert costs.decode_step_bytes(TINY, cached_len=4, dtype_bytes=4, batch_size=2) == 1392 + 2 * 5 * 32
    assert costs.decode_bytes(TINY, 3, 2, 4) == (1392 + 4 * 32) + (1392 + 5 * 32)
    assert costs.kv_cache_bytes(TINY, 7, 4, batch_size=3) == 3 * 7 * 32
    with pytest.raises(ValueError, match="batch_size=0"):
        costs.decode_step_bytes(TINY, cached_len=4, dtype_bytes=4, batch_size=0)


def test_one_meaning_per_argument_and_the_old_names_warn():
    """cached_len means the same in FLOPs and bytes; the old context_len keeps each old meaning, with a warning."""
    with pytest.warns(DeprecationWarning):
        assert costs.decode_step_flops(TINY, 3) == costs.decode_step_flops(TINY, cached_len=3)
    with pytest.warns(DeprecationWarning):
        assert costs.decode_step_bytes(TINY, 5, 4) == costs.decode_step_bytes(TINY, cached_len=4, dtype_bytes=4)
    step = costs.decode_step_flops(TINY, cached_len=9) - costs.decode_step_flops(TINY, cached_len=8)
    assert step == 2 * 2 * TINY.n_layers * TINY.n_heads * costs.head_dim_of(TINY)   # one more key scored and mixed


def test_qkv_bias_counts_in_bytes():
    biased = SimpleNamespace(**{**vars(TINY), "qkv_bias": True})
    assert costs.weight_bytes(biased, 2) - costs.weight_bytes(TINY, 2) == 2 * 2 * (2 + 2 * 1) * 2


def test_roofline_takes_the_slower_limit():
    assert costs.roofline_seconds(100, 10, flops_per_s=10, bytes_per_s=100) == 10
    assert costs.roofline_seconds(100, 1000, flops_per_s=10, bytes_per_s=10) == 100


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.2-1b", "llama-3-8b", "llama-3-70b"])
def test_one_byte_count_for_a_model(name):
    """weight_bytes is the parameter count (chapter 04's plot, chapter 10's memory); a step reads less untied."""
    from llminfer.parallel import cost_model
    cfg = llminfer.get_preset(name)
    assert costs.weight_bytes(cfg, 2) == 2 * cfg.n_params()
    assert cost_model.device_memory(cfg, dtype_bytes=2).weight_bytes == costs.weight_bytes(cfg, 2)
    embedding = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    assert costs.weight_bytes_read(cfg, 2) == 2 * (cfg.n_params() - embedding)


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_weight_bytes_are_what_a_model_holds(name):
    model = llminfer.Transformer(SMALL_CONFIGS[name])                 # float32; a tied table is one parameter
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == costs.weight_bytes(model.config, 4)


def test_llama_3_8b_weighs_16_gb_in_bf16():
    cfg = llminfer.get_preset("llama-3-8b")
    assert round(costs.weight_bytes(cfg, 2) / 1e9, 1) == 16.1                   # embedding and head both held
    assert round(costs.weight_bytes_read(cfg, 2) / 1e9, 1) == 15.0            # the embedding table is gathered


def test_every_cache_size_is_one_formula():
    assert costs.kv_cache_bytes(costs.KVShape(n_layers=2, n_kv_heads=1, head_dim=2), 7, 4, 3) == \
        costs.kv_cache_bytes(TINY, 7, 4, batch_size=3) == 3 * 7 * 32
    # int8 codes, a 2-byte scale per position and head for V, one per channel per 4 positions for K
    int8 = costs.kv_cache_bytes(TINY, 8, 1, scale_bytes=2, scale_block=4)
    assert int8 == 2 * 1 * 8 * (2 * 2 * 1 + 2 + 2 * 2 / 4)
    with pytest.raises(ValueError, match="scale_block must be >= 1"):
        costs.kv_cache_bytes(TINY, 8, 1, scale_bytes=2, scale_block=0)
