"""Checkpoint folders: what loads, and what each broken folder is told."""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from safetensors.torch import save_file

import llminfer
from small_models import SMALL_CONFIGS, random_model, word_tokenizer


@pytest.fixture
def folder(tmp_path):
    """A complete folder: config.json, model.safetensors, tokenizer.json, generation_config.json."""
    config = SMALL_CONFIGS["llama-gqa-tied"].replace(eos_token_id=100)
    model = random_model(config)
    llminfer.save_pretrained(model, tmp_path / "m", tokenizer=word_tokenizer(config.vocab_size))
    return tmp_path / "m"


def test_complete_folder_loads_model_and_tokenizer(folder):
    model, tokenizer = llminfer.load_pretrained(folder, device="cpu")
    assert isinstance(model, llminfer.Transformer) and model.config.tie_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight
    assert tokenizer.encode("t3 t5 t1") == [3, 5, 1]
    assert tokenizer.eos_token_id == 100 and tokenizer.tokens([3, 100]) == ["t3", "<eos>"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_load_stays_close(folder, dtype):
    full, _ = llminfer.load_pretrained(folder, device="cpu")
    low, _ = llminfer.load_pretrained(folder, device="cpu", dtype=dtype)
    assert low.dtype == dtype
    ids = torch.arange(30)[None]
    with torch.no_grad():
        assert (full(ids) - low(ids).float()).abs().max() < 0.1
    assert len(llminfer.generate(low, ids, 5).token_ids) == 5


@pytest.mark.parametrize("missing,message", [
    ("config.json", "no config.json"),
    ("model.safetensors", "expected model.safetensors"),
    ("tokenizer.json", "no tokenizer.json.*load_tokenizer=False"),
])
def test_missing_file_is_named(folder, missing, message):
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=message):
        llminfer.load_pretrained(folder, device="cpu")


def test_pickle_checkpoint_is_refused_and_never_unpickled(folder, tmp_path):
    marker = tmp_path / "unpickled"

    class Trap:
        def __reduce__(self):
            return (open, (str(marker), "w"))
    (folder / "model.safetensors").unlink()
    with open(folder / "pytorch_model.bin", "wb") as f:
        pickle.dump(Trap(), f)
    with pytest.raises(ValueError, match=r"pickle checkpoint\(s\) \['pytorch_model.bin'\].*safetensors only"):
        llminfer.load_pretrained(folder, device="cpu")
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_names_the_file(folder, damage):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(ValueError, match=r"could not read .*model\.safetensors.*truncated or not a safetensors"):
        llminfer.load_pretrained(folder, device="cpu")


def test_wrong_shape_names_the_tensor_and_both_shapes(folder):
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\).*\(100, 64\)"):
        llminfer.load_pretrained(folder, device="cpu")


def test_missing_and_unexpected_tensor_names(folder):
    from safetensors.torch import load_file
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight_renamed"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.0.self_attn.q_proj.weight' \(expected shape"):
        llminfer.load_pretrained(folder, device="cpu")
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight_renamed"].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="does not use.*q_proj.weight_renamed"):
        llminfer.load_pretrained(folder, device="cpu")


def test_missing_shard_is_named(folder, tmp_path):
    model, _ = llminfer.load_pretrained(folder, device="cpu")
    llminfer.save_pretrained(model, tmp_path / "sharded", max_shard_size="20KB", tokenizer=word_tokenizer(101))
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        llminfer.load_pretrained(tmp_path / "sharded", device="cpu")


def test_unsupported_architecture_is_named(folder):
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'gpt2'.*llama, qwen2, mistral"):
        llminfer.load_pretrained(folder, device="cpu")


def test_hub_id_without_network_says_to_pass_a_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match=r"could not fetch 'someone/no-such-model'.*local folder"):
        llminfer.load_pretrained("someone/no-such-model", device="cpu")


def test_unknown_name_lists_what_exists():
    with pytest.raises(FileNotFoundError, match="not a folder, a bundled model"):
        llminfer.load_pretrained("no-such-model-anywhere", device="cpu")


def test_load_random_presets():
    model = llminfer.load_random(SMALL_CONFIGS["qwen2-bias-gqa"], seed=3)
    again = llminfer.load_random(SMALL_CONFIGS["qwen2-bias-gqa"], seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    with pytest.raises(ValueError, match="unknown model shape 'gpt-5'.*smollm2-135m"):
        llminfer.load_random("gpt-5")
    with pytest.raises(MemoryError, match=r"needs \d+\.\d+ GiB but only \d+\.\d+ GiB is free"):
        llminfer.load_random("llama-3-70b", device="cpu", dtype=torch.float32)


def test_preset_shapes_are_the_published_ones():
    assert llminfer.get_preset("smollm2-135m").n_params() == 134_515_008
    assert round(llminfer.get_preset("llama-3-8b").n_params() / 1e9, 2) == 8.03
    assert round(llminfer.get_preset("llama-3.2-1b").n_params() / 1e9, 2) == 1.24
    assert round(llminfer.get_preset("qwen2.5-7b").n_params() / 1e9, 2) == 7.62
    assert round(llminfer.get_preset("mistral-7b").n_params() / 1e9, 2) == 7.24
    assert set(llminfer.PRESETS) == set(llminfer.PRESET_SOURCES)
