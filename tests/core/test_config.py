"""ModelConfig refuses every config it cannot run, naming the field, the value and what is allowed."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import llminfer
from llminfer import ModelConfig
from llminfer.config import SHAPE_ONLY_MODEL_TYPES
from small_models import SMALL_CONFIGS

FIXTURES = Path(__file__).parents[1] / "fixtures" / "configs"
LLAMA = json.loads((FIXTURES / "Llama-3.2-1B.json").read_text())
SMOL = json.loads((FIXTURES / "SmolLM2-135M.json").read_text())
QWEN = json.loads((FIXTURES / "Qwen2.5-0.5B.json").read_text())
MISTRAL = {  # the shape of Mistral-7B-v0.2 and later: no sliding window
    "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
}
CODE = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, max_seq_len=64)


def with_(hf: dict, **changes) -> dict:
    return {**hf, **changes}


def without(hf: dict, key: str) -> dict:
    return {k: v for k, v in hf.items() if k != key}


def refused(hf, *names: str) -> str:
    """from_hf(hf) raises ValueError whose message names every one of `names`; returns the message."""
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf(hf)
    for name in names:
        assert name in str(error.value), f"{name!r} not named in: {error.value}"
    return str(error.value)


# ---- what is read correctly ------------------------------------------------------------------

@pytest.mark.parametrize("hf", [SMOL, LLAMA, QWEN, MISTRAL])
def test_published_configs_are_accepted(hf):
    config = ModelConfig.from_hf(hf)
    assert config.model_type == hf["model_type"] and config.attn_backend == "sdpa"


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), ("False", False), ("TRUE", True),
                                         (" false ", False), (True, True), (False, False)])
def test_boolean_strings_are_parsed_not_truth_tested(text, value):
    assert ModelConfig.from_hf(with_(SMOL, tie_word_embeddings=text)).tie_embeddings is value


def test_every_preset_and_small_config_round_trips_through_to_hf():
    for config in [*llminfer.PRESETS.values(), *SMALL_CONFIGS.values()]:
        if config.model_type in SHAPE_ONLY_MODEL_TYPES:      # shapes for the cost model, with no checkpoint form
            with pytest.raises(ValueError, match="cost model only"):
                config.to_hf()
            continue
        assert ModelConfig.from_hf(config.to_hf()) == config


def test_attn_backend_is_read_only_from_its_own_key_and_never_written():
    assert ModelConfig.from_hf(with_(SMOL, llminfer_attn_backend="explicit")).attn_backend == "explicit"
    config = ModelConfig(**CODE, attn_backend="explicit")
    assert "attn_backend" not in json.dumps(config.to_hf()) and "llminfer" not in json.dumps(config.to_hf())
    assert config.replace(n_layers=3).attn_backend == "explicit"


def test_an_unused_sliding_window_is_fine():
    assert ModelConfig.from_hf(QWEN).max_seq_len == 32768                       # carried, but switched off
    assert ModelConfig.from_hf(with_(MISTRAL, sliding_window=32768)).n_layers == 32   # as long as the context
    assert ModelConfig.from_hf(with_(SMOL, sliding_window=16)).n_layers == 30   # Llama has no sliding window


def test_head_dim_given_explicitly_need_not_divide_hidden_size():
    config = ModelConfig.from_hf(with_(SMOL, num_attention_heads=7, num_key_value_heads=1, head_dim=64))
    assert config.head_dim == 64 and config.n_heads * config.head_dim == 448


def test_llama3_rope_scaling_keys_left_out_get_llama3_published_values():
    scaling = ModelConfig.from_hf(with_(LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0})).rope_scaling
    assert scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}


# ---- one test per refused row ------------------------------------------------------------------

@pytest.mark.parametrize("value", ["false", "False", "true", "no", "0", "", 0, 1, None, [True]])
def test_tie_word_embeddings_must_be_a_boolean(value):
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        assert ModelConfig.from_hf(with_(SMOL, tie_word_embeddings=value)).tie_embeddings is (value.lower() == "true")
    else:
        message = refused(with_(SMOL, tie_word_embeddings=value), "tie_word_embeddings", repr(value), "true or false")
        assert "boolean" in message


@pytest.mark.parametrize("key", ["attention_bias", "mlp_bias", "use_sliding_window"])
def test_other_boolean_fields_must_be_booleans(key):
    refused(with_(QWEN if key == "use_sliding_window" else SMOL, **{key: "yes"}), key, "'yes'", "true or false")


def test_boolean_fields_built_in_code_must_be_booleans():
    for name in ("tie_embeddings", "qkv_bias"):
        with pytest.raises(ValueError, match=f"ModelConfig.{name}.*'false'"):
            ModelConfig(**CODE, **{name: "false"})


@pytest.mark.parametrize("value", [0, 0.0, -1e-5, math.nan, math.inf, -math.inf, "1e-5", True, None])
def test_rms_norm_eps_must_be_finite_and_positive(value):
    refused(with_(SMOL, rms_norm_eps=value), "rms_norm_eps", repr(value), "> 0")
    with pytest.raises(ValueError, match="norm_eps"):
        ModelConfig(**CODE, norm_eps=value)


@pytest.mark.parametrize("value", [0, -10000.0, math.nan, math.inf, "10000", None])
def test_rope_theta_must_be_finite_and_positive(value):
    refused(with_(SMOL, rope_theta=value), "rope_theta", repr(value), "> 0")
    with pytest.raises(ValueError, match="rope_theta"):
        ModelConfig(**CODE, rope_theta=value)


def test_rope_theta_inside_rope_parameters_is_checked_too():
    hf = without(SMOL, "rope_theta") | {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}
    refused(hf, "rope_theta", "-1.0")


def llama3(**changes):
    return with_(LLAMA, rope_scaling=with_(LLAMA["rope_scaling"], **changes))


def test_llama3_rope_scaling_without_factor_is_refused():
    refused(with_(LLAMA, rope_scaling=without(LLAMA["rope_scaling"], "factor")), "factor", "missing")


@pytest.mark.parametrize("factor", [0, -32.0, math.nan, math.inf, "32", None])
def test_llama3_rope_scaling_factor_must_be_positive(factor):
    refused(llama3(factor=factor), "factor", repr(factor), "> 0")


@pytest.mark.parametrize("low, high", [(4.0, 4.0), (4.0, 1.0)])
def test_llama3_high_freq_factor_must_exceed_low_freq_factor(low, high):
    refused(llama3(low_freq_factor=low, high_freq_factor=high), "high_freq_factor", "low_freq_factor",
            repr(high), repr(low))


@pytest.mark.parametrize("low", [0, -1.0, math.nan])
def test_llama3_low_freq_factor_must_be_positive(low):
    refused(llama3(low_freq_factor=low), "low_freq_factor", repr(low))


@pytest.mark.parametrize("original", [0, -8192, 8192.5, None])
def test_llama3_original_max_position_embeddings_must_be_positive(original):
    refused(llama3(original_max_position_embeddings=original), "original_max_position_embeddings", repr(original))


def test_llama3_checks_apply_to_configs_built_in_code():
    with pytest.raises(ValueError, match="factor"):
        ModelConfig(**CODE, rope_scaling={"rope_type": "llama3", "factor": 0.0})
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelConfig(**CODE, rope_scaling="llama3")


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn", None])
def test_unsupported_rope_scaling_types_are_refused(kind):
    refused(with_(LLAMA, rope_scaling={"rope_type": kind, "factor": 4.0}), "rope_scaling", repr(kind), "llama3")


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu", "SiLU", None])
def test_hidden_act_other_than_silu_is_refused(act):
    refused(with_(SMOL, hidden_act=act), "hidden_act", repr(act), "'silu'")


def test_mlp_bias_is_refused():
    refused(with_(LLAMA, mlp_bias=True), "mlp_bias", "true")
    refused(with_(LLAMA, mlp_bias="true"), "mlp_bias")


def test_llama_attention_bias_is_refused_because_it_includes_o_proj():
    refused(with_(SMOL, attention_bias=True), "attention_bias", "o_proj")
    with pytest.raises(ValueError, match="qkv_bias"):
        ModelConfig(**CODE, qkv_bias=True)
    with pytest.raises(ValueError, match="qkv_bias"):
        ModelConfig(**CODE, qkv_bias=False, model_type="qwen2")


@pytest.mark.parametrize("hf, changes", [
    (QWEN, {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}),
    (QWEN, {"use_sliding_window": "true", "sliding_window": 4096, "max_window_layers": 12}),
    (MISTRAL, {"sliding_window": 4096}),                          # Mistral-7B-v0.1 as published
    (without(MISTRAL, "sliding_window"), {}),                     # left out: transformers assumes 4096
    (SMOL, {"layer_types": ["full_attention"] * 15 + ["sliding_attention"] * 15}),
])
def test_a_sliding_window_in_use_is_refused(hf, changes):
    message = refused(with_(hf, **changes), "sliding_window" if "layer_types" not in changes else "layer_types")
    assert "whole causal prefix in every layer" in message


def test_num_attention_heads_zero_is_refused():
    refused(with_(SMOL, num_attention_heads=0), "num_attention_heads", "0")
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(**{**CODE, "n_heads": 0})


def test_num_attention_heads_must_divide_hidden_size_when_head_dim_is_derived():
    refused(with_(SMOL, num_attention_heads=7, num_key_value_heads=1), "hidden_size", "num_attention_heads",
            "576", "7", "head_dim")
    with pytest.raises(ValueError, match="head_dim"):
        ModelConfig(**{**CODE, "n_heads": 5, "n_kv_heads": 1})


@pytest.mark.parametrize("value", [0, -3, 3.0, "3"])
def test_num_key_value_heads_must_be_a_positive_integer(value):
    refused(with_(SMOL, num_key_value_heads=value), "num_key_value_heads", repr(value))


def test_num_key_value_heads_must_divide_num_attention_heads():
    refused(with_(SMOL, num_key_value_heads=2), "num_attention_heads", "num_key_value_heads", "9", "2")
    assert ModelConfig.from_hf(with_(SMOL, num_key_value_heads=None)).n_kv_heads == 9   # null: one per query head


@pytest.mark.parametrize("value", [None, "config.json", ["vocab_size"], 42, SMOL.items()])
def test_from_hf_takes_a_dict(value):
    message = refused(value, "from_hf", type(value).__name__)
    assert "json.loads" in message


@pytest.mark.parametrize("value", ["", "  ", None, 3])
def test_attn_backend_must_be_a_nonempty_string(value):
    with pytest.raises(ValueError, match="attn_backend"):
        ModelConfig(**CODE, attn_backend=value)
    refused(with_(SMOL, llminfer_attn_backend=value), "attn_backend", repr(value))


@pytest.mark.parametrize("name, value", [("bos_token_id", 49152), ("eos_token_id", -1), ("eos_token_id", "0")])
def test_special_token_ids_must_be_in_the_vocabulary(name, value):
    refused(with_(SMOL, **{name: value}), name, repr(value), "49151")


def test_configs_changed_with_replace_are_checked_too():
    config = ModelConfig.from_hf(SMOL)
    with pytest.raises(ValueError, match="norm_eps"):
        config.replace(norm_eps=-1.0)
    with pytest.raises(ValueError, match="n_kv_heads"):
        config.replace(n_kv_heads=2)
