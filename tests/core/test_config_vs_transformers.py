"""Published config.json files read by llminfer and by transformers: same fields, same shapes, same logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

import llminfer
from llminfer.model import rope_frequencies

FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs"
PUBLISHED = {path.stem: json.loads(path.read_text()) for path in sorted(FIXTURES.glob("*.json"))}
TOLERANCE = 1e-5          # max |logit difference| in float32


def test_the_three_published_configs_are_here():
    assert sorted(PUBLISHED) == ["Llama-3.2-1B", "Qwen2.5-0.5B", "SmolLM2-135M"]


def transformers_config(hf: dict):
    """transformers' own reading of a config.json dict."""
    return transformers.AutoConfig.for_model(**hf)


def derived_fields_by_transformers(config) -> dict:
    """The fields a decoder's shape and numerics depend on, as transformers derives them."""
    rope = dict(config.rope_parameters)
    theta = rope.pop("rope_theta")
    kind = rope.get("rope_type", "default")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {
        "vocab_size": config.vocab_size, "dim": config.hidden_size, "n_layers": config.num_hidden_layers,
        "n_heads": config.num_attention_heads, "n_kv_heads": config.num_key_value_heads, "head_dim": head_dim,
        "hidden_dim": config.intermediate_size, "max_seq_len": config.max_position_embeddings,
        "norm_eps": config.rms_norm_eps, "rope_theta": float(theta),
        "rope_scaling": None if kind == "default" else rope,
        "tie_embeddings": config.tie_word_embeddings,
    }


def derived_fields_by_llminfer(config: llminfer.ModelConfig) -> dict:
    return {name: getattr(config, name) for name in (
        "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "max_seq_len",
        "norm_eps", "rope_theta", "rope_scaling", "tie_embeddings")}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_derived_field_matches_transformers(name):
    hf = PUBLISHED[name]
    ours, theirs = llminfer.ModelConfig.from_hf(hf), transformers_config(hf)
    assert derived_fields_by_llminfer(ours) == derived_fields_by_transformers(theirs)
    assert theirs.hidden_act == "silu" and not getattr(theirs, "mlp_bias", False)
    assert getattr(theirs, "sliding_window", None) is None
    assert set(getattr(theirs, "layer_types", None) or ["full_attention"]) == {"full_attention"}
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    # the same fields in the repository's presets, which the cost chapters use
    preset = llminfer.get_preset(name.lower())
    assert derived_fields_by_llminfer(preset) == derived_fields_by_llminfer(ours)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_parameter_name_and_shape_matches_transformers(name):
    """Built on the meta device (no memory): the full-size models hold the same tensors, biases and tying included."""
    hf = PUBLISHED[name]
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(transformers_config(hf))
        model = llminfer.Transformer(llminfer.ModelConfig.from_hf(hf))
    expected = {key.removeprefix("model."): tuple(value.shape) for key, value in reference.state_dict().items()}
    got = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    assert got == expected
    assert any(key.endswith("q_proj.bias") for key in got) == (hf["model_type"] == "qwen2")
    tied = reference.lm_head.weight is reference.model.embed_tokens.weight
    assert tied == (model.lm_head.weight is model.embed_tokens.weight) == hf["tie_word_embeddings"]
    assert sum(p.numel() for p in reference.parameters()) == llminfer.ModelConfig.from_hf(hf).n_params()


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_rope_frequencies_match_transformers(name):
    """The full-size inverse frequencies (theta, head_dim and Llama 3's rescaling) against transformers' own."""
    hf = PUBLISHED[name]
    rotary = {"llama": LlamaRotaryEmbedding, "qwen2": Qwen2RotaryEmbedding}[hf["model_type"]](
        config=transformers_config(hf))
    assert rotary.attention_scaling == 1.0       # llminfer does not rescale cos/sin; neither may the reference
    expected = rotary.inv_freq.float()
    got = rope_frequencies(llminfer.ModelConfig.from_hf(hf))
    assert got.shape == expected.shape == (32,)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


def scaled_down(hf: dict) -> dict:
    """The published config.json with 2 layers, head_dim 16, 2 K/V heads and a 256-token vocabulary.

    Everything else stays as published: rope theta and scaling, eps, tied head, biases, the GQA ratio,
    max positions, and whether head_dim is written out or derived from hidden_size.
    """
    ratio = hf["num_attention_heads"] // hf["num_key_value_heads"]
    small = dict(hf, num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=2 * ratio,
                 hidden_size=2 * ratio * 16, intermediate_size=128, vocab_size=256, bos_token_id=0, eos_token_id=1)
    if "head_dim" in hf:
        small["head_dim"] = 16
    return small


def random_reference(hf: dict, seed: int = 0):
    """transformers' model of `hf` in float32 with its own random init, norms and biases perturbed as well."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers_config(hf), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, param in model.named_parameters():
            if key.endswith("norm.weight") or key.endswith(".bias"):
                param.copy_(float(key.endswith("norm.weight")) + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def llminfer_copy(reference, config: llminfer.ModelConfig) -> llminfer.Transformer:
    """llminfer's Transformer of `config` holding `reference`'s weights (names as HF's less "model.")."""
    model = llminfer.Transformer(config).eval()
    state = {key.removeprefix("model."): value for key, value in reference.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model


@pytest.fixture(scope="module")
def scaled_pairs():
    """For each published config: its scaled-down json, transformers' model of it, llminfer's copy, and token ids."""
    pairs = {}
    for index, name in enumerate(sorted(PUBLISHED)):
        small = scaled_down(PUBLISHED[name])
        reference = random_reference(small, seed=index)
        config = llminfer.ModelConfig.from_hf(small)
        ids = torch.randint(0, small["vocab_size"], (2, 160), generator=torch.Generator().manual_seed(index))
        pairs[name] = (small, reference, llminfer_copy(reference, config), ids)
    return pairs


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_scaled_down_logits_match_transformers(name, scaled_pairs):
    small, reference, model, ids = scaled_pairs[name]
    assert reference.dtype == model.dtype == torch.float32
    assert model.config.n_heads // model.config.n_kv_heads == (
        PUBLISHED[name]["num_attention_heads"] // PUBLISHED[name]["num_key_value_heads"])
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids)
    diff = (expected - got).abs().max().item()
    print(f"{name} (scaled down): max |logit difference| vs transformers = {diff:.3g}")
    assert got.shape == expected.shape == (2, 160, small["vocab_size"])
    assert expected.abs().max() > 0.1           # real, non-trivial logits
    assert diff <= TOLERANCE


@pytest.mark.parametrize("field, change", [
    ("rope_scaling", None),                     # Llama 3.2's long-context rescaling, dropped
    ("norm_eps", 1e-6),                         # the published 1e-5, replaced by transformers' default
    ("rope_theta", 10000.0),                    # the published 500000, replaced by the classic base
])
def test_the_logit_comparison_detects_a_misread_field(field, change, scaled_pairs):
    """Each of these fields, misread, moves the logits far past the tolerance: the match above is evidence."""
    small, reference, model, ids = scaled_pairs["Llama-3.2-1B"]
    wrong = llminfer_copy(reference, model.config.replace(**{field: change}))
    with torch.no_grad():
        diff = (reference(ids).logits - wrong(ids)).abs().max().item()
    assert diff > 10 * TOLERANCE


QWEN = PUBLISHED["Qwen2.5-0.5B"]


@pytest.mark.parametrize("changes", [
    {},                                                                        # as published: window off
    {"use_sliding_window": True},                                              # on, but max_window_layers == layers
    {"use_sliding_window": True, "sliding_window": 4096},                      # same: no layer slides
    {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 21},
    {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0},
    {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 0},
])
def test_qwen2_sliding_window_refused_exactly_when_transformers_slides_a_layer(changes):
    hf = dict(QWEN, **changes)
    theirs = transformers_config(hf)
    slides = "sliding_attention" in theirs.layer_types and theirs.sliding_window < hf["max_position_embeddings"]
    if slides:
        with pytest.raises(ValueError, match="sliding_window"):
            llminfer.ModelConfig.from_hf(hf)
    else:
        assert llminfer.ModelConfig.from_hf(hf).n_layers == QWEN["num_hidden_layers"]
