"""Chapter 08: the fast decode path (fused projections, a compiled step), the int8 KV cache, number formats,
activation-aware scaling, the GGUF writer and the quantization widget."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import llminfer
from llminfer import quant
from llminfer.cuda_graphs import StaticDecoder
from llminfer.fast import FusedAttention, FusedMLP, compile_decode, fuse_projections, is_fused
from llminfer.quant import activation_aware, formats
from llminfer.quant.kv_cache import Int8KVCache, int8_roundtrip

from small_models import SMALL_CONFIGS, random_model


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained("tiny-capitals", device="cpu")      # compared with CPU tensors


# --- fused projections ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias-gqa", "llama3-rope-scaling"])
def test_fused_model_matches_unfused(name):
    model = random_model(SMALL_CONFIGS[name])
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(ids)
        fused = fuse_projections(copy.deepcopy(model))
        assert is_fused(fused) and not is_fused(model)
        assert all(isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedMLP)
                   for layer in fused.layers)
        torch.testing.assert_close(fused(ids), reference, atol=1e-5, rtol=1e-5)
        # with a cache: prefill then decode through cache.attend, as the unfused model does
        expected = llminfer.generate(model, ids, max_new_tokens=6, return_logits=True)
        got = llminfer.generate(fused, ids, max_new_tokens=6, return_logits=True)
    assert got.token_ids == expected.token_ids
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert fuse_projections(fused) is fused                         # a second fuse changes nothing


def test_fusing_quantized_layers_keeps_their_numbers():
    model = quant.quantize(random_model(SMALL_CONFIGS["llama-gqa-tied"]), "int4", 32)
    ids = torch.tensor([[5, 3, 8, 1, 9]])
    with torch.inference_mode():
        reference = model(ids)
        fused = fuse_projections(copy.deepcopy(model))
        assert isinstance(fused.layers[0].self_attn.qkv_proj, quant.QuantizedLinear)
        torch.testing.assert_close(fused(ids), reference, atol=1e-5, rtol=1e-5)


def test_static_decoder_uncompiled_matches_generate():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = llminfer.generate(model, ids, max_new_tokens=8)
    decoder = compile_decode(copy.deepcopy(model), max_seq_len=32, compile=False)
    got = decoder.generate(ids, max_new_tokens=8)
    assert got.token_ids == expected.token_ids and len(got.itl_s) == 7 and got.ttft_s > 0
    again = decoder.generate(ids, max_new_tokens=8)                 # the cache is reset between requests
    assert again.token_ids == expected.token_ids
    eos = expected.token_ids[2]
    stopped = decoder.generate(ids, max_new_tokens=8, eos_token_id=eos)
    assert stopped.token_ids == expected.token_ids[:expected.token_ids.index(eos) + 1]


def test_static_decoder_refuses_bad_requests_before_compute():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    decoder = StaticDecoder(model, batch_size=1, max_seq_len=16)
    with pytest.raises(ValueError, match=r"need 19 cache positions, the decoder's cache holds 16"):
        decoder.generate(list(range(10)), max_new_tokens=10)
    with pytest.raises(ValueError, match=r"built for batch_size=1, got 2"):
        decoder.generate([[1, 2], [3, 4]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"outside the vocabulary"):
        decoder.generate([1, 2, 10_000], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"temperature"):
        decoder.generate([1, 2], max_new_tokens=2, temperature=-1.0)


@pytest.mark.parametrize("scheme", [None, "int4"])
def test_compiled_step_traces_as_one_graph_and_matches_eager(scheme):
    # fullgraph=True: the step (the model's own forward over the static cache, the packed kernels included)
    # must trace as one graph. The 'eager' backend runs that graph without code generation, which keeps the
    # test to seconds; the benchmark compiles the published shape with inductor and checks its tokens.
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    if scheme:
        quant.quantize(model, scheme, 32 if scheme == "int4" else None)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = llminfer.generate(model, ids, max_new_tokens=6)
    torch._dynamo.reset()
    decoder = compile_decode(model, max_seq_len=16, backend="eager")
    assert decoder.compile_s > 0
    got = decoder.generate(ids, max_new_tokens=6)
    assert got.token_ids == expected.token_ids


# --- the int8 KV cache --------------------------------------------------------------------------------------

def test_int8_kv_cache_follows_the_float_cache(bundled):
    model, tokenizer = bundled
    ids = torch.tensor([tokenizer.encode("The capital of Japan is Tokyo. The capital of Peru is")])
    float_cache, int8_cache = model.new_cache(), Int8KVCache.for_model(model, block_size=8)
    with torch.inference_mode():
        a, b = model(ids, cache=float_cache)[:, -1], model(ids, cache=int8_cache)[:, -1]
        for _ in range(4):
            assert int(a.argmax()) == int(b.argmax())
            assert 0 < float((a - b).abs().max()) < 0.05 * float(a.abs().max())
            token = a.argmax(-1, keepdim=True)
            a, b = model(token, cache=float_cache)[:, -1], model(token, cache=int8_cache)[:, -1]
    assert int8_cache.length == float_cache.length == ids.shape[1] + 4
    # layer 0's keys depend on the tokens alone (later layers see the rounding of the layers before)
    k_float, v_float = float_cache.get(0)
    k_int8, v_int8 = int8_cache.get(0)
    assert k_int8.shape == k_float.shape
    assert float((k_int8 - k_float).abs().max()) <= float(k_float.abs().max()) / 127      # half a step or less
    # the residual block holds the keys not yet quantized: exactly the float ones
    held = int8_cache.length % 8
    assert held > 0
    torch.testing.assert_close(k_int8[:, :, -held:], k_float[:, :, -held:])


def test_int8_kv_cache_memory_and_refusals():
    config = llminfer.get_preset("smollm2-135m")
    cache = Int8KVCache(config.n_layers, 1, config.n_kv_heads, 1024, config.head_dim, dtype=torch.bfloat16)
    bf16_bytes = llminfer.kv_cache_bytes(config, 1024, 2)
    assert 0.5 < cache.nbytes / bf16_bytes < 0.56                   # codes + scales + the residual block
    assert 1.9 < costs_ratio(config) < 2.0
    with pytest.raises(ValueError, match=r"block_size must be a positive integer"):
        Int8KVCache(1, 1, 1, 8, 4, block_size=0)
    small = Int8KVCache(1, 1, 1, 4, 4)
    small.begin(4, 1)
    small.end()
    with pytest.raises(ValueError, match=r"needs 5 positions but the cache holds max_seq_len=4"):
        small.begin(1, 1)


def costs_ratio(config) -> float:
    from llminfer import costs
    return costs.kv_bytes_per_token(config, 2) / costs.kv_cache_bytes(config, 1, 1, scale_bytes=2, scale_block=32)


def test_keys_prefer_per_channel_scales(bundled):
    model, tokenizer = bundled
    cache = model.new_cache()
    with torch.inference_mode():
        model(torch.tensor([tokenizer.encode("The capital of Kenya is Nairobi. The capital of Chile is")]),
              cache=cache)
    per_token, per_channel = [], []
    for layer in range(model.config.n_layers):
        k, _ = cache.get(layer)
        per_token.append(float((int8_roundtrip(k, -1) - k).norm() / k.norm()))
        per_channel.append(float((int8_roundtrip(k, -2) - k).norm() / k.norm()))
    assert np.mean(per_channel) < np.mean(per_token)


# --- formats and activation-aware scaling -------------------------------------------------------------------

def test_bit_layouts_and_format_errors(bundled):
    assert formats.bit_layout(1.0, "fp32") == "0 01111111 " + "0" * 23
    assert formats.bit_layout(-2.0, "bf16") == "1 10000000 0000000"
    assert formats.bit_layout(1.5, "fp16") == "0 01111 1000000000"
    assert formats.bit_layout(448.0, "fp8 e4m3") == "0 1111 110"
    assert formats.bit_layout(0.5, "fp8 e5m2") == "0 01110 00"
    with pytest.raises(ValueError, match=r"unknown format 'fp4'"):
        formats.bit_layout(1.0, "fp4")
    model, _ = bundled
    rows = {r["format"]: r for r in formats.format_table(model.layers[0].mlp.up_proj.weight)}
    assert rows["fp32"]["rms_relative_error"] == 0
    assert 0 < rows["bf16"]["rms_relative_error"] < rows["fp8 e4m3"]["rms_relative_error"] \
        < rows["fp8 e5m2"]["rms_relative_error"]
    assert rows["int8"]["rms_relative_error"] < rows["int4"]["rms_relative_error"]
    assert rows["bf16"]["rms_relative_error"] < 2 ** -8                 # half bf16's relative step, about


def test_scaling_salient_channels_lowers_the_error(bundled):
    model, tokenizer = bundled
    from llminfer.quant import accuracy
    batches = [torch.tensor([tokenizer.encode(s)]) for s in accuracy.load_held_out()[:30]]
    inputs = activation_aware.collect_inputs(model, "layers.1.mlp.down_proj", batches)
    weight = model.layers[1].mlp.down_proj.weight
    salient = activation_aware.salient_channels(inputs, 0.01)
    scale = torch.ones(inputs.shape[1])
    scale[salient] = 2.0
    plain = activation_aware.weight_only_error(inputs, weight, 3, None)
    assert activation_aware.weight_only_error(inputs, weight, 3, None, scale) < plain
    search = activation_aware.awq_search(inputs, weight, 3, None, grid=5)
    assert search[0][1] == pytest.approx(plain) and min(e for _, e in search) < plain
    assert activation_aware.smoothquant_error(inputs, weight, 0.5) < activation_aware.smoothquant_error(
        inputs, weight, None)
    with pytest.raises(ValueError, match=r"fraction=0"):
        activation_aware.salient_channels(inputs, 0)


# --- GGUF: the same weights for llama.cpp ---------------------------------------------------------------------

def test_gguf_holds_the_same_weights(tmp_path, bundled):
    import gguf
    from llminfer.quant.gguf_export import _permute_rope, write_gguf

    model, _ = bundled
    path = write_gguf(model, tmp_path / "m.gguf", "F32")
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    np.testing.assert_array_equal(tensors["blk.1.ffn_up.weight"], model.layers[1].mlp.up_proj.weight.detach().numpy())
    q = model.layers[0].self_attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(tensors["blk.0.attn_q.weight"], _permute_rope(q, model.config.n_heads))
    assert not np.array_equal(tensors["blk.0.attn_q.weight"], q)            # really permuted
    assert len(tensors) == 2 + 9 * model.config.n_layers + 1
    q8 = write_gguf(model, tmp_path / "q8.gguf", "Q8_0")
    assert 0.25 < q8.stat().st_size / path.stat().st_size < 0.3
    with pytest.raises(ValueError, match=r"weight_type='Q3' is not one of"):
        write_gguf(model, tmp_path / "x.gguf", "Q3")
    with pytest.raises(ValueError, match=r"float, unfused model"):
        write_gguf(quant.quantize(copy.deepcopy(model), "int8"), tmp_path / "x.gguf", "F32")


# --- the widget -----------------------------------------------------------------------------------------------

def test_quantization_widget_run_and_refusals(bundled):
    from llminfer.widgets import quantization as widget

    model, tokenizer = bundled
    run = widget.quantization_run(model, tokenizer, 4, 32, "layers.0.mlp.gate_proj", n_countries=20, new_tokens=4)
    assert float(run.error_in_steps.abs().max()) <= 0.5 + 1e-4
    assert run.correct >= 18 and run.total == 20
    assert run.weight_bytes < run.float_bytes / 4 and run.tokens_per_s > 0
    low = widget.quantization_run(model, tokenizer, 2, None, "layers.0.mlp.gate_proj", n_countries=5, new_tokens=2)
    assert low.relative_error > run.relative_error
    with pytest.raises(ValueError, match=r"int8 uses one scale per output channel"):
        widget.quantization_run(model, tokenizer, 8, 32, "layers.0.mlp.gate_proj")
    with pytest.raises(ValueError, match=r"not a linear layer"):
        widget.quantization_run(model, tokenizer, 4, 32, "layers.0.mlp")
    box = widget.build_quantization_widget(model, tokenizer)
    html = widget.summary_html(run)
    assert "capitals right" in html and "tokens/s" in html
    assert box.children and widget.draw(run) is not None
