"""Chapter 08: weight-only quantization — error bounds, kernels against the fallback, the module transform,
refusals before any work, quantized checkpoints, and accuracy on the bundled model's capitals."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import llminfer
from llminfer import quant
from llminfer.quant import QuantizedLinear, quantize, quantize_tensor
from llminfer.quant.weights import dequantize
from llminfer.quant import accuracy
from llminfer.quant import linear as quant_linear
from llminfer.quant.weights import dequantize

from small_models import SMALL_CONFIGS, random_model, word_tokenizer


@pytest.fixture(scope="module")
def bundled():
    return llminfer.load_pretrained("tiny-capitals", device="cpu")      # compared with CPU tensors


# --- rounding: at most half a step ------------------------------------------------------------------------

@pytest.mark.parametrize("bits,granularity,group", [(8, "tensor", None), (8, "channel", None), (4, "tensor", None),
                                                    (4, "channel", None), (4, "group", 32), (3, "group", 64),
                                                    (2, "group", 128), (2, "channel", None)])
def test_rounding_error_is_at_most_half_a_step(bits, granularity, group):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(bits)) * 0.05
    weight[3, 17] = 1.5                                            # an outlier
    qt = quantize_tensor(weight, bits, granularity, group)
    error = (dequantize(qt) - weight).abs()
    assert bool((error <= qt.step / 2 * (1 + 1e-5) + 1e-7).all())
    lo, hi = quant.qrange(bits, symmetric=bits == 8)
    codes = qt.codes.to(torch.int32)
    assert int(codes.min()) >= lo and int(codes.max()) <= hi
    # the error is not zero: the codes really are rounded
    assert float(error.max()) > 0.1 * float(qt.step.min())


def test_outlier_ruins_a_per_tensor_scale_but_not_a_per_group_one():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    weight[5, 9] = 2.0
    errors = {g: float((dequantize(quantize_tensor(weight, 4, g, 32 if g == "group" else None)) - weight)
                       .pow(2).mean().sqrt()) for g in ("tensor", "channel", "group")}
    assert errors["tensor"] > 5 * errors["channel"] > 5 * 0.9 * errors["group"]


# --- the layer: packed kernels against the dequantizing fallback ------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 64), (4, None), (3, 32), (2, None)])
def test_quantized_linear_kernel_matches_fallback_and_reference(dtype, bits, group):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True).to(dtype)
    auto = QuantizedLinear.from_linear(linear, bits, group, kernel="auto")
    fallback = QuantizedLinear.from_linear(linear, bits, group, kernel="dequantize")
    layers = [auto, fallback]
    if bits in (8, 4):                               # the native kernel (built here) and torch's packed one
        assert auto.kernel == "native" and fallback.kernel == "dequantize"
        packed = QuantizedLinear.from_linear(linear, bits, group, kernel="packed")
        assert packed.kernel == {8: "int8pack", 4: "int4pack"}[bits]
        layers.append(packed)
    else:
        assert auto.kernel == "dequantize"
    for layer in layers:
        assert torch.equal(layer.codes(), fallback.codes())
    for tokens in (1, 3, 20):                                     # decode (kernel) and prefill (dequantized)
        x = torch.randn(2, tokens, 128).to(dtype)
        reference = x.float() @ fallback.dequantized_weight(torch.float32).T + linear.bias.float()
        tolerance = 1e-4 if dtype == torch.float32 else 0.05
        for layer in layers:
            y = layer(x)
            assert y.shape == (2, tokens, 96) and y.dtype == dtype
            torch.testing.assert_close(y.float(), reference, atol=tolerance, rtol=tolerance)
    # quantization really changed the weight, by a bounded amount
    difference = (fallback.dequantized_weight(torch.float32) - linear.weight.detach().float()).abs().max()
    assert 0 < float(difference) < 0.5 * float(linear.weight.detach().float().abs().max())


def test_layer_bytes_follow_the_bits():
    linear = nn.Linear(256, 64, bias=False)
    sizes = {bits: QuantizedLinear.from_linear(linear, bits, None if bits == 8 else 32).nbytes for bits in (8, 4, 2)}
    assert sizes[8] == 64 * 256 + 64 * 4
    native = QuantizedLinear.from_linear(linear, 4, 32).kernel == "native"
    # int4 on the native kernel reads its terms as float16 (2 bytes), elsewhere in the model's dtype (float32)
    assert sizes[4] == 64 * 256 // 2 + 64 * 8 * 2 * (2 if native else 4)
    assert sizes[2] == 64 * 256 // 4 + 64 * 8 * 2 * 4


def test_int4_terms_are_float16_values_and_the_kernel_keeps_them_in_two_bytes():
    """quantize rounds int4's scales and minimums to float16 values before choosing codes (as GGUF's Q4_1 stores
    them); the native kernel then keeps them as float16, and its product equals the layer's own weight."""
    torch.manual_seed(3)
    linear = nn.Linear(256, 64, bias=False)
    qt = quantize_tensor(linear.weight, 4, "group", 32, terms_dtype=torch.float16)
    assert torch.equal(qt.scales.half().float(), qt.scales) and torch.equal(qt.offsets.half().float(), qt.offsets)
    # the codes are chosen against the rounded terms: every weight within half a step (plus the minimum's rounding)
    error = (dequantize(qt) - linear.weight).abs().reshape(64, 8, 32).amax(-1)
    assert (error <= qt.scales / 2 + (qt.offsets - linear.weight.reshape(64, 8, 32).amin(-1)).abs() + 1e-7).all()
    layer = QuantizedLinear.from_linear(linear, 4, 32)
    x = torch.randn(3, 256)
    with torch.no_grad():
        reference = x @ layer.dequantized_weight(torch.float32).T
        torch.testing.assert_close(layer(x), reference, atol=1e-4, rtol=1e-4)
    if layer.kernel == "native":
        assert layer.qweight.dim() == 3 and layer.kernel_scale.dtype == torch.float16
        assert layer.kernel_offset.dtype == torch.float16
        assert torch.equal(layer.codes(), qt.codes)


def test_int4_terms_that_are_not_float16_values_stay_float32_in_the_kernel():
    """A layer built from terms float16 cannot hold (from a checkpoint of another quantizer) keeps them in
    float32, tiled all the same, and gives the same numbers as its own weight."""
    torch.manual_seed(4)
    codes = torch.randint(0, 16, (64, 128), dtype=torch.uint8)
    scales, zeros = torch.rand(64, 4) / 7, torch.randn(64, 4) / 3          # not float16 values
    layer = QuantizedLinear(128, 64, 4, 32, codes, scales, zeros)
    x = torch.randn(2, 128)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ layer.dequantized_weight(torch.float32).T, atol=1e-4, rtol=1e-4)
    if layer.kernel == "native":
        assert layer.qweight.dim() == 3 and layer.kernel_scale.dtype == torch.float32
    tiny = quantize_tensor(torch.full((1, 32), 1e-9) + torch.arange(32.0) * 1e-12, 4, "group", 32,
                           terms_dtype=torch.float16)
    assert tiny.scales.item() != 0 and tiny.offsets.item() == pytest.approx(1e-9)   # below float16: kept


# --- the module transform ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias-gqa"])
def test_quantize_replaces_every_linear_and_stays_close(name):
    model = random_model(SMALL_CONFIGS[name])
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    reference = model(ids)
    n_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    quantized = quantize(copy.deepcopy(model), "int8")
    assert len(quant.quantized_modules(quantized)) == n_linears
    assert not any(type(m) is nn.Linear for m in quantized.modules())
    logits = quantized(ids).detach()
    reference = reference.detach()
    assert float((logits - reference).norm() / reference.norm()) < 0.05
    assert not torch.equal(logits, reference)
    # the head stays float when asked
    kept = quantize(copy.deepcopy(model), "int8", include_head=False)
    assert type(kept.lm_head) is nn.Linear and isinstance(kept.layers[0].mlp.up_proj, QuantizedLinear)


def test_quantize_bad_input_is_refused_before_any_change():
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])      # hidden_dim 112: groups of 32 do not divide
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"scheme='int5' is not supported"):
        quantize(model, "int5")
    with pytest.raises(ValueError, match=r"group_size=48 is not supported.*32, 64, 128, 256"):
        quantize(model, "int4", group_size=48)
    with pytest.raises(ValueError, match=r"group_size=32 does not divide the input width 112"):
        quantize(model, "int4", group_size=32)
    with pytest.raises(ValueError, match=r"int8 uses one scale per output channel"):
        quantize(model, "int8", group_size=32)
    with pytest.raises(ValueError, match=r"kernel='fast' must be one of"):
        quantize(model, "int8", kernel="fast")
    # nothing was touched by the refusals
    assert not quant.quantized_modules(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    quantize(model, "int4", group_size=None)
    with pytest.raises(ValueError, match=r"already quantized.*quantizing twice"):
        quantize(model, "int8")


def test_packed_kernel_demanded_where_there_is_none_is_refused(monkeypatch):
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    monkeypatch.setattr(quant_linear, "has_kernel", lambda bits, device: False)
    monkeypatch.setattr(quant_linear.native_cpu, "available", lambda: False)          # as without a compiler
    monkeypatch.setattr(quant_linear.native_cpu, "why_unavailable", lambda: "no C++ compiler found")
    with pytest.raises(ValueError, match=r"no packed int4 kernel.*kernel='auto'"):
        quantize(model, "int4", group_size=32, kernel="packed")
    with pytest.raises(ValueError, match=r"no native kernel.*int4.*unavailable here \(no C\+\+ compiler found\)"
                                         r".*kernel='auto'"):
        quantize(model, "int4", group_size=32, kernel="native")
    assert not quant.quantized_modules(model)
    quantize(model, "int4", group_size=32, kernel="auto")        # the fallback runs instead
    assert {m.kernel for m in quant.quantized_modules(model).values()} == {"dequantize"}


def test_native_kernel_refuses_what_it_does_not_take():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    with pytest.raises(ValueError, match=r"no native kernel.*int3.*int8 per channel or in groups, and int4"):
        quantize(model, "int3", group_size=32, kernel="native")
    assert not quant.quantized_modules(model)
    quantize(model, "int8", kernel="native")
    assert {m.kernel for m in quant.quantized_modules(model).values()} == {"native"}


# --- quantized checkpoints ----------------------------------------------------------------------------------

@pytest.mark.parametrize("scheme,group,name", [("int8", None, "qwen2-bias-gqa"), ("int4", 32, "llama-gqa-tied"),
                                               ("int3", None, "llama-mha-untied")])
def test_save_and_load_round_trip(tmp_path, scheme, group, name):
    model = quantize(random_model(SMALL_CONFIGS[name]), scheme, group)
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    quant.save_pretrained(model, tmp_path, word_tokenizer(model.config.vocab_size))
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["bits"] == int(scheme[3:]) and saved["group_size"] == group
    loaded, tokenizer = quant.load_pretrained(tmp_path, device="cpu")     # compared with a CPU model
    assert tokenizer is not None
    assert torch.equal(loaded(ids), model(ids))
    for (name_a, a), (name_b, b) in zip(quant.quantized_modules(model).items(),
                                        quant.quantized_modules(loaded).items()):
        assert name_a == name_b and torch.equal(a.codes(), b.codes())
    # a float loader refuses the integer weights
    with pytest.raises(ValueError):
        llminfer.load_pretrained(tmp_path)


def test_fused_model_saves_under_the_checkpoint_names(tmp_path):
    from llminfer.fast import fuse_projections
    from safetensors import safe_open

    model = quantize(random_model(SMALL_CONFIGS["llama-gqa-tied"]), "int4", 32)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    expected = model(ids)
    fuse_projections(model)
    quant.save_pretrained(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.0.self_attn.k_proj.qweight" in names and "model.layers.0.mlp.up_proj.zeros" in names
    assert not any("qkv_proj" in n or "gate_up_proj" in n for n in names)
    loaded, _ = quant.load_pretrained(tmp_path, device="cpu", load_tokenizer=False)
    assert torch.equal(loaded(ids), expected)


def test_load_refuses_a_mismatched_config(tmp_path):
    model = quantize(random_model(SMALL_CONFIGS["llama-gqa-tied"]), "int8")
    quant.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has shape .* but config.json implies"):
        quant.load_pretrained(tmp_path)
    config["intermediate_size"] = 96
    config["quantization_config"]["group_size"] = 32
    config["quantization_config"]["bits"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"has no tensor .*zeros|has shape"):
        quant.load_pretrained(tmp_path)
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"not a quantized llminfer checkpoint"):
        quant.load_pretrained(tmp_path)


def test_loading_int4_where_there_is_no_kernel_and_no_fallback_is_refused(tmp_path, monkeypatch):
    model = quantize(random_model(SMALL_CONFIGS["llama-gqa-tied"]), "int4", 32)
    quant.save_pretrained(model, tmp_path)
    monkeypatch.setattr(quant_linear, "has_kernel", lambda bits, device: False)
    monkeypatch.setattr(quant_linear.native_cpu, "available", lambda: False)
    from llminfer import checkpoint as reader      # the one checkpoint reader opens the weight files
    opened = reader.safe_open

    def must_not_open(*args, **kwargs):
        raise AssertionError("a weight file was opened before the kernel check")

    monkeypatch.setattr(reader, "safe_open", must_not_open)
    with pytest.raises(ValueError, match=r"no packed int4 kernel .* kernel='auto'"):
        quant.load_pretrained(tmp_path, device="cpu", kernel="packed")
    with pytest.raises(ValueError, match=r"no native kernel .* kernel='auto'"):
        quant.load_pretrained(tmp_path, device="cpu", kernel="native")
    monkeypatch.setattr(reader, "safe_open", opened)
    loaded, _ = quant.load_pretrained(tmp_path, device="cpu", kernel="auto")   # the fallback: the same numbers
    ids = torch.tensor([[2, 7, 1, 8]])
    torch.testing.assert_close(loaded(ids), model(ids), atol=1e-5, rtol=1e-5)
    assert {m.kernel for m in quant.quantized_modules(loaded).values()} == {"dequantize"}


def test_saving_a_float_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"not quantized"):
        quant.save_pretrained(random_model(SMALL_CONFIGS["llama-gqa-tied"]), tmp_path)


# --- the whole task: the bundled model's 195 capitals ----------------------------------------------------

def test_capitals_accuracy_cliff(bundled):
    model, tokenizer = bundled
    sentences = accuracy.load_held_out()[::6]                     # KL on a sample of the held-out sentences
    float_result = accuracy.evaluate_format(model, tokenizer, None, sentences=sentences)
    assert float_result.correct == float_result.total == 195
    int8 = accuracy.evaluate_format(model, tokenizer, "int8", sentences=sentences)
    int4 = accuracy.evaluate_format(model, tokenizer, "int4", 32, sentences=sentences)
    int2 = accuracy.evaluate_format(model, tokenizer, "int2", None, sentences=sentences)
    assert int8.correct >= 194 and int4.correct >= 185
    assert int2.correct < 195 // 2                                # the cliff: fewer than half survive
    assert 0 < int8.kl < int4.kl < int2.kl
    assert int2.weight_bytes < int4.weight_bytes < int8.weight_bytes < float_result.weight_bytes


def test_kl_of_a_model_against_itself_is_zero(bundled):
    model, tokenizer = bundled
    sentences = accuracy.load_held_out()[:20]
    assert abs(accuracy.kl_from_reference(model, model, tokenizer, sentences)) < 1e-6


def test_offsets_give_code_times_scale_plus_offset_exactly():
    """GGUF's Q4_1 stores w = q·scale + minimum; a layer given offsets computes exactly that, without a zero point."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=generator)
    scales, offsets = torch.rand(16, 2, generator=generator), torch.randn(16, 2, generator=generator)
    expected = (codes.float().view(16, 2, 32) * scales[..., None] + offsets[..., None]).view(16, 64)
    layer = QuantizedLinear(64, 16, 4, 32, codes, scales, None, kernel="dequantize", offsets=offsets)
    assert torch.equal(layer.dequantized_weight(), expected)
    x = torch.randn(3, 64, generator=generator)
    torch.testing.assert_close(layer(x), x @ expected.T)
    with pytest.raises(ValueError, match="replace zeros"):
        QuantizedLinear(64, 16, 8, 32, codes.to(torch.int8), scales, None, offsets=offsets)


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 32)])
def test_an_moe_models_router_and_shared_gate_stay_in_float(tmp_path, scheme, group):
    """Rounding the router would change which experts a token goes to: quantize leaves it (and the shared
    expert's gate) as it was, and rounds the shared expert's and attention's matrices; saved and loaded, the same."""
    from llminfer.moe import MoEFeedForward

    config = llminfer.ModelConfig(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48,
                                  max_seq_len=64, model_type="qwen3_moe", n_experts=4, n_experts_per_tok=2,
                                  moe_hidden_dim=32, shared_expert_dim=64, shared_expert_gate=True)
    model = llminfer.Transformer(config).init_weights(seed=3, std=0.2).eval()
    floats = copy.deepcopy(model)
    quantize(model, scheme, group)
    layers = [(m, f) for m, f in zip(model.modules(), floats.modules()) if isinstance(m, MoEFeedForward)]
    assert len(layers) == 2
    for moe, before in layers:
        for gate, float_gate in ((moe.router, before.router), (moe.shared_expert_gate, before.shared_expert_gate)):
            assert type(gate) is nn.Linear and torch.equal(gate.weight, float_gate.weight)
        assert all(isinstance(m, QuantizedLinear) for m in moe.shared_expert.modules() if m is not moe.shared_expert)
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
        assert torch.equal(moe.route(x)[1], before.route(x)[1])       # the same experts for every token
    assert isinstance(model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert len(llminfer.generate(model, [1, 2, 3], max_new_tokens=3, ignore_eos=True).token_ids) == 3
    # saved and loaded (Qwen3-MoE's config.json has no shared expert): the routers are read back in float
    plain = llminfer.ModelConfig(**{**config.__dict__, "shared_expert_dim": 0, "shared_expert_gate": False})
    model = quantize(llminfer.Transformer(plain).init_weights(seed=3, std=0.2).eval(), scheme, group)
    quant.save_pretrained(model, tmp_path)
    loaded, _ = quant.load_pretrained(tmp_path, device="cpu")
    assert type(loaded.layers[1].mlp.router) is nn.Linear
    assert list(quant.quantized_modules(loaded)) == list(quant.quantized_modules(model))
    ids = torch.tensor([[5, 9, 13, 2, 60]])
    assert torch.equal(loaded(ids), model(ids))
