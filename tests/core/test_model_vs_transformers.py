"""Logits against transformers on the same weights: the independent reference for the whole decoder."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

import llminfer
from small_models import SMALL_CONFIGS, random_model

HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}
TOLERANCE = 1e-4


def hf_model_for(config: llminfer.ModelConfig, seed: int = 0):
    """A transformers model of `config`'s shape with random weights (norms and biases perturbed too)."""
    hf_config = transformers.AutoConfig.for_model(**config.to_hf())
    torch.manual_seed(seed)
    model = HF_CLASSES[config.model_type](hf_config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.copy_((1.0 if name.endswith("norm.weight") else 0.0)
                            + 0.1 * torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_logits_match_transformers_loaded_from_its_folder(name, tmp_path):
    config = SMALL_CONFIGS[name]
    reference = hf_model_for(config)
    reference.save_pretrained(tmp_path)
    model, _ = llminfer.load_pretrained(tmp_path, device="cpu", load_tokenizer=False)
    assert model.config.tie_embeddings == config.tie_embeddings
    assert model.config.qkv_bias == config.qkv_bias
    assert (model.config.rope_scaling or {}).get("rope_type") == (config.rope_scaling or {}).get("rope_type")
    ids = torch.randint(0, config.vocab_size, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(ids).logits
        got = model(ids)
    diff = (expected - got).abs().max().item()
    print(f"{name}: max |logit difference| vs transformers = {diff:.3g}")
    assert diff <= TOLERANCE
    assert expected.abs().max() > 0.1  # the comparison is of real, non-trivial logits


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_transformers_reads_what_llminfer_saves(name, tmp_path):
    config = SMALL_CONFIGS[name]
    model = random_model(config, seed=3)
    llminfer.save_pretrained(model, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(reference) is HF_CLASSES[config.model_type]
    ids = torch.randint(0, config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (reference(ids).logits - model(ids)).abs().max().item()
    assert diff <= TOLERANCE


def test_llama3_rope_scaling_is_actually_applied():
    """Dropping the rope scaling changes the logits, so the match above is evidence it is implemented."""
    config = SMALL_CONFIGS["llama3-rope-scaling"]
    model = random_model(config)
    plain = llminfer.Transformer(config.replace(rope_scaling=None)).eval()
    plain.load_state_dict(model.state_dict())
    ids = torch.arange(200)[None] % config.vocab_size
    with torch.no_grad():
        assert (model(ids) - plain(ids)).abs().max() > 1e-3


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    config = SMALL_CONFIGS["llama-gqa-tied"]
    reference = hf_model_for(config, seed=5)
    reference.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) >= 3 and (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model, _ = llminfer.load_pretrained(tmp_path / "hf", device="cpu", load_tokenizer=False)
    ids = torch.randint(0, config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (reference(ids).logits - model(ids)).abs().max() <= TOLERANCE

    # and llminfer's own sharded writer round-trips
    llminfer.save_pretrained(model, tmp_path / "ours", max_shard_size="30KB")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    again, _ = llminfer.load_pretrained(tmp_path / "ours", device="cpu", load_tokenizer=False)
    with torch.no_grad():
        assert torch.equal(again(ids), model(ids))


def test_config_from_hf_reads_legacy_and_new_rope_fields():
    legacy = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 16, "rope_theta": 5e5,
              "rope_scaling": {"type": "llama3", "factor": 32.0}}
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_type": "llama3", "factor": 32.0, "rope_theta": 5e5}
    for hf in (legacy, new):
        config = llminfer.ModelConfig.from_hf(hf)
        assert config.rope_theta == 5e5 and config.rope_scaling["rope_type"] == "llama3"
        assert config.n_kv_heads == 2 and config.head_dim == 4


def test_parameter_count_matches_transformers():
    for config in SMALL_CONFIGS.values():
        reference = hf_model_for(config)
        assert config.n_params() == sum(p.numel() for p in reference.parameters())
