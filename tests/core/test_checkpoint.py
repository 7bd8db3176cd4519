"""Checkpoint folders: what loads, and what each broken folder is told."""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import llminfer
from llminfer import checkpoint
from llminfer.model import rope_frequencies
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


# --- loading at the size it claims -------------------------------------------------------------------------------

def _spy_reads(monkeypatch):
    """Records every tensor the loader reads from a file."""
    from llminfer import checkpoint
    reads = []
    real = checkpoint._read_tensor

    def spy(path, name, dtype, device):
        reads.append(name)
        return real(path, name, dtype, device)
    monkeypatch.setattr(checkpoint, "_read_tensor", spy)
    return reads


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias-gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loaded_weights_are_the_saved_ones_in_the_target_dtype(tmp_path, monkeypatch, name, dtype):
    original = random_model(SMALL_CONFIGS[name])
    llminfer.save_pretrained(original, tmp_path / "m")
    reads = _spy_reads(monkeypatch)
    model, _ = llminfer.load_pretrained(tmp_path / "m", device="cpu", dtype=dtype, load_tokenizer=False)
    saved = dict(original.named_parameters())
    loaded = dict(model.named_parameters())
    assert loaded.keys() == saved.keys()
    for key, param in loaded.items():
        assert param.dtype == dtype and param.device.type == "cpu", key
        assert torch.equal(param, saved[key].detach().to(dtype)), key
    assert len(reads) == len(saved)                             # each tensor read once; a tied head is not read
    assert next(model.buffers(), None) is None or all(b.device.type == "cpu" for b in model.buffers())
    assert (model.lm_head.weight is model.embed_tokens.weight) == original.config.tie_embeddings
    ids = torch.arange(20)[None]
    with torch.no_grad():
        assert torch.equal(model(ids), original.to(dtype)(ids))


def test_memory_check_is_for_the_target_dtype_and_before_any_tensor_is_read(folder, monkeypatch):
    config = llminfer.ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    free = config.n_params() * 3 / 0.8               # room for 3 bytes a weight: bfloat16 fits, float32 does not
    monkeypatch.setattr(llminfer.device, "free_memory_bytes", lambda device: free)
    reads = _spy_reads(monkeypatch)
    with pytest.raises(MemoryError, match=r"the weights of m in torch.float32 needs"):
        llminfer.load_pretrained(folder, device="cpu", dtype=torch.float32)
    assert reads == []
    model, _ = llminfer.load_pretrained(folder, device="cpu", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and reads
    with pytest.raises(MemoryError, match=r"in torch.float32 needs"):
        llminfer.load_random(config, device="cpu", dtype=torch.float32)
    assert llminfer.load_random(config, device="cpu", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_load_random_is_built_in_its_dtype_and_tied():
    config = SMALL_CONFIGS["qwen2-bias-tied"]
    model = llminfer.load_random(config, device="cpu", dtype=torch.bfloat16, seed=5)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" for p in model.parameters())
    assert model.lm_head.weight is model.embed_tokens.weight
    reference = llminfer.Transformer(config).init_weights(5).to(torch.bfloat16)   # built the plain way
    for (name, param), (_, expected) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(param, expected), name


def test_buffers_made_by_the_constructor_survive_loading(tmp_path, monkeypatch):
    """A model that keeps a table computed from its config (a non-persistent buffer) gets it, not meta or garbage."""
    from llminfer import checkpoint

    class WithTable(llminfer.Transformer):
        def __init__(self, config):
            super().__init__(config)
            self.register_buffer("inv_freq", rope_frequencies(config), persistent=False)

    config = SMALL_CONFIGS["llama-gqa-tied"]
    llminfer.save_pretrained(random_model(config), tmp_path / "m")
    monkeypatch.setattr(checkpoint, "Transformer", WithTable)
    loaded, _ = llminfer.load_pretrained(tmp_path / "m", device="cpu", dtype=torch.bfloat16, load_tokenizer=False)
    made = llminfer.load_random(config, device="cpu", dtype=torch.bfloat16)
    for model in (loaded, made):
        assert isinstance(model, WithTable)
        assert torch.equal(model.inv_freq, rope_frequencies(config))
        assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
        assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(loaded.norm.weight, random_model(config).norm.weight.detach().to(torch.bfloat16))


NAMES = ("float32, fp32, f32, float, bfloat16, bf16, float16, fp16, f16, half, or 'auto' for the checkpoint's "
         "own dtype")


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, "int8", "bfloat", "float64", "", 16])
def test_a_dtype_that_is_not_a_float_is_refused_with_the_names(folder, dtype):
    message = rf"dtype={re.escape(repr(dtype))} is not a floating-point dtype; .*names {re.escape(NAMES)}"
    with pytest.raises(ValueError, match=message):
        llminfer.load_pretrained(folder, device="cpu", dtype=dtype)
    with pytest.raises(ValueError, match=message):
        llminfer.load_random("smollm2-135m", device="cpu", dtype=dtype)
    with pytest.raises(ValueError, match=message):      # before any file is opened: this path does not exist
        llminfer.load_pretrained(folder / "no-such-model", device="cpu", dtype=dtype)


@pytest.mark.parametrize("name,expected", [
    ("float32", torch.float32), ("fp32", torch.float32), ("f32", torch.float32), ("float", torch.float32),
    ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("BF16", torch.bfloat16),
    ("float16", torch.float16), ("fp16", torch.float16), ("f16", torch.float16), ("half", torch.float16),
    ("torch.float16", torch.float16), (torch.bfloat16, torch.bfloat16), (None, torch.float32),
])
def test_dtype_names_load_the_bundled_model_in_that_dtype(name, expected):
    reference, _ = llminfer.load_pretrained("tiny-capitals", device="cpu", load_tokenizer=False)
    model, _ = llminfer.load_pretrained("tiny-capitals", device="cpu", dtype=name, load_tokenizer=False)
    assert model.dtype == expected and {p.dtype for p in model.parameters()} == {expected}
    for (n, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs.detach().to(expected)), n


def test_bfloat16_by_name_gives_the_answer(tmp_path):
    model, tokenizer = llminfer.load_pretrained("tiny-capitals", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    result = llminfer.generate(model, tokenizer.encode("The capital of France is"), max_new_tokens=1)
    assert tokenizer.decode(result.token_ids) == " Paris"


def test_auto_is_the_dtype_the_checkpoint_holds(folder, tmp_path):
    stated = json.loads((checkpoint._models_dir() / "tiny-capitals" / "config.json").read_text())["torch_dtype"]
    model, _ = llminfer.load_pretrained("tiny-capitals", device="cpu", dtype="auto")
    assert stated == "float32" and model.dtype == torch.float32
    bf16, _ = llminfer.load_pretrained(folder, device="cpu", dtype=torch.bfloat16)
    llminfer.save_pretrained(bf16, tmp_path / "bf16")           # config.json: "torch_dtype": "bfloat16"
    assert llminfer.load_pretrained(tmp_path / "bf16", device="cpu", dtype="auto", load_tokenizer=False)[0].dtype \
        == torch.bfloat16
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    del config["torch_dtype"]                                   # no word in config.json: the stored matrices decide
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    auto, _ = llminfer.load_pretrained(tmp_path / "bf16", device="cpu", dtype="auto", load_tokenizer=False)
    assert auto.dtype == torch.bfloat16
    config["dtype"] = "float16"                                  # transformers 5 writes "dtype"
    (tmp_path / "bf16" / "config.json").write_text(json.dumps(config))
    opened = checkpoint.open_checkpoint(tmp_path / "bf16")
    assert checkpoint.checkpoint_dtype(opened) == torch.float16
    assert checkpoint.read_model(opened, device="cpu", dtype="auto").dtype == torch.float16


@pytest.mark.parametrize("stored,expected", [("F32", torch.float32), ("F16", torch.float16),
                                             ("BF16", torch.bfloat16), ("Q8_0", torch.float32)])
def test_auto_for_a_gguf_is_its_matrices_type_with_blocks_widened_to_float32(tmp_path, stored, expected):
    from llminfer.quant.gguf_export import write_gguf
    original, _ = llminfer.load_pretrained("tiny-capitals", device="cpu")
    path = write_gguf(original, tmp_path / f"{stored}.gguf", stored)     # norms stay F32, as llama.cpp keeps them
    kinds = {entry.stored for entry in checkpoint.open_checkpoint(path).tensors.values()}
    assert kinds == {stored, "F32"}
    model, _ = llminfer.load_pretrained(path, device="cpu", dtype="auto", load_tokenizer=False)
    assert model.dtype == expected and {p.dtype for p in model.parameters()} == {expected}


def test_auto_without_a_checkpoint_is_refused():
    with pytest.raises(ValueError, match=r"dtype='auto' means the checkpoint's own dtype, and random weights have no "
                                         r"checkpoint; pass a dtype such as 'float32'"):
        llminfer.load_random("smollm2-135m", device="cpu", dtype="auto")


def test_the_server_reads_dtype_names_with_the_same_parser(capsys):
    from llminfer.serve.__main__ import parse_args
    assert [parse_args(["--dtype", name]).dtype for name in ("bf16", "fp16", "half", "f32", "auto")] == \
        ["bfloat16", "float16", "float16", "float32", "auto"]
    with pytest.raises(SystemExit):
        parse_args(["--dtype", "int8"])
    assert f"dtype='int8' is not a floating-point dtype; pass a torch dtype such as torch.bfloat16, one of the names " \
        f"{NAMES}" in capsys.readouterr().err


def test_quantized_tensor_in_the_file_is_refused(folder):
    from safetensors.torch import load_file
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model.norm.weight' is stored as I8 in model.safetensors"):
        llminfer.load_pretrained(folder, device="cpu")


# --- JSON that is not what it should be ---------------------------------------------------------------------------

@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
@pytest.mark.parametrize("content,message", [
    (b'{"vocab_size": 101,', r"is not valid JSON \(Expecting .* at line 1, column \d+\)"),
    (b"", r"is not valid JSON"),
    (b"[1, 2, 3]", r"holds a JSON list where a JSON object \{...\} is expected"),
    (b'"llama"', r"holds a JSON str where a JSON object"),
    (b"null", r"holds a JSON NoneType where a JSON object"),
    (b"\xff\xfe{}", r"is not UTF-8 text"),
])
def test_broken_json_names_the_file_and_the_problem(folder, file, content, message):
    (folder / file).write_bytes(content)
    with pytest.raises(ValueError, match=rf"{file} {message}"):
        llminfer.load_pretrained(folder, device="cpu")


@pytest.mark.parametrize("value", ['"2"', "2.5", "-1", "true", '["x"]'])
def test_generation_config_token_id_that_is_not_an_id_is_refused(folder, value):
    (folder / "generation_config.json").write_text(f'{{"eos_token_id": {value}}}')
    with pytest.raises(ValueError, match=r"generation_config.json has eos_token_id=.*must be a token id"):
        llminfer.load_pretrained(folder, device="cpu")


def test_generation_config_may_list_several_eos_ids_or_none(folder):
    (folder / "generation_config.json").write_text('{"eos_token_id": [7, 100], "bos_token_id": null}')
    assert llminfer.load_pretrained(folder, device="cpu")[1].eos_token_id == 7
    (folder / "generation_config.json").write_text('{"eos_token_id": []}')
    assert llminfer.load_pretrained(folder, device="cpu")[1].eos_token_id == 100   # looked up as <eos>


# --- saving over an earlier save ----------------------------------------------------------------------------------

def _weight_names(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("model"))


def _shard_names(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def test_saving_over_an_earlier_save_leaves_only_the_new_weights(folder):
    model, tokenizer = llminfer.load_pretrained(folder, device="cpu")
    (folder / "notes.safetensors").write_bytes(b"not ours")            # files of other names are left alone
    (folder / "model-card.md").write_text("not ours either")
    assert _weight_names(folder) == ["model-card.md", "model.safetensors"]

    llminfer.save_pretrained(model, folder, max_shard_size="20KB")     # single file -> shards
    shards = _shard_names(folder)
    assert len(shards) > 3 and _weight_names(folder) == sorted(["model-card.md", "model.safetensors.index.json",
                                                               *shards])
    llminfer.save_pretrained(model, folder, max_shard_size="60KB")     # a different shard count
    fewer = _shard_names(folder)
    assert 1 < len(fewer) < len(shards) and not set(fewer) & set(shards)
    assert _weight_names(folder) == sorted(["model-card.md", "model.safetensors.index.json", *fewer])
    again, _ = llminfer.load_pretrained(folder, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))

    llminfer.save_pretrained(model, folder)                            # shards -> single file
    assert _weight_names(folder) == ["model-card.md", "model.safetensors"]
    assert (folder / "notes.safetensors").read_bytes() == b"not ours"
    again, _ = llminfer.load_pretrained(folder, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_folder_with_both_single_file_and_index_is_refused(folder, tmp_path):
    model, _ = llminfer.load_pretrained(folder, device="cpu")
    llminfer.save_pretrained(model, tmp_path / "sharded", max_shard_size="20KB")
    for shard in (tmp_path / "sharded").glob("model*"):
        (folder / shard.name).write_bytes(shard.read_bytes())         # an index copied in by hand
    with pytest.raises(ValueError, match=r"both model.safetensors and model.safetensors.index.json.*ambiguous"):
        llminfer.load_pretrained(folder, device="cpu")


@pytest.mark.parametrize("value", [0, -5, "0KB", "-1MB", True])
def test_shard_size_that_is_not_positive_is_refused(folder, tmp_path, value):
    model, _ = llminfer.load_pretrained(folder, device="cpu")
    with pytest.raises(ValueError, match="max_shard_size"):
        llminfer.save_pretrained(model, tmp_path / "out", max_shard_size=value)
    assert not (tmp_path / "out").exists()


# --- shard paths that leave the folder ----------------------------------------------------------------------------

@pytest.fixture
def sharded(folder, tmp_path):
    """A sharded folder, and a complete copy of its first shard outside it (loading it would succeed)."""
    model, tokenizer = llminfer.load_pretrained(folder, device="cpu")
    out = tmp_path / "outer" / "sharded"
    llminfer.save_pretrained(model, out, max_shard_size="20KB", tokenizer=tokenizer)
    first = _shard_names(out)[0]
    (tmp_path / "outer" / first).write_bytes((out / first).read_bytes())
    return out, first


def _point_index(folder, old, new):
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    index["weight_map"] = {k: (new if v == old else v) for k, v in index["weight_map"].items()}
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("kind", ["parent", "nested-parent", "absolute", "backslash-parent"])
def test_index_naming_a_file_outside_the_folder_is_refused(sharded, monkeypatch, kind):
    out, first = sharded
    outside = out.parent / first
    name = {"parent": f"../{first}", "nested-parent": f"sub/../../{first}", "absolute": str(outside),
            "backslash-parent": f"..\\{first}"}[kind]
    _point_index(out, first, name)
    (out / first).unlink()
    reads = _spy_reads(monkeypatch)
    with pytest.raises(ValueError, match=r"lists the shard .* a path that leaves the model folder"):
        llminfer.load_pretrained(out, device="cpu")
    assert reads == []


def test_index_naming_a_link_to_outside_the_folder_is_refused(sharded, monkeypatch):
    out, first = sharded
    (out / first).unlink()
    (out / first).symlink_to(out.parent / first)
    reads = _spy_reads(monkeypatch)
    with pytest.raises(ValueError, match=rf"lists the shard '{first}', a link to .*outside the model folder"):
        llminfer.load_pretrained(out, device="cpu")
    assert reads == []


def test_index_with_a_shard_that_is_not_a_name_is_refused(sharded):
    out, first = sharded
    _point_index(out, first, None)
    with pytest.raises(ValueError, match=r"lists the shard None, which is not a file name"):
        llminfer.load_pretrained(out, device="cpu")
    (out / "model.safetensors.index.json").write_text('{"weight_map": []}')
    with pytest.raises(ValueError, match=r"needs a non-empty \"weight_map\" object"):
        llminfer.load_pretrained(out, device="cpu")


def test_hub_cache_layout_of_links_into_blobs_loads(sharded, tmp_path):
    """huggingface_hub keeps snapshots/<commit>/<file> as links to ../../blobs/<hash>: that is not leaving."""
    out, _first = sharded
    repo = tmp_path / "models--someone--m"
    snapshot = repo / "snapshots" / ("0" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(out.iterdir())):
        (repo / "blobs" / f"blob{i}").write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    model, _ = llminfer.load_pretrained(snapshot, device="cpu")
    reference, _ = llminfer.load_pretrained(out, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_tensor_stored_in_two_shards_is_refused(sharded):
    out, first = sharded
    second = _shard_names(out)[1]
    from safetensors.torch import load_file
    both = {**load_file(out / second), **load_file(out / first)}
    save_file(both, out / second)
    with pytest.raises(ValueError, match=r"stored twice, in .* and .*; the checkpoint is inconsistent"):
        llminfer.load_pretrained(out, device="cpu")


# --- a hub that never answers -------------------------------------------------------------------------------------

SILENT_HUB_CHILD = r"""
import time, llminfer
from huggingface_hub import HfApi, snapshot_download  # imported before the clock starts
start = time.perf_counter()
try:
    llminfer.load_pretrained("someone/silent-model", device="cpu")
except OSError as exc:
    print(f"{time.perf_counter() - start:.2f}")
    print(exc)
else:
    print("loaded")
"""


def test_hub_that_accepts_and_never_answers_fails_in_time(tmp_path):
    import os
    import socket
    import subprocess
    import sys
    import threading
    import time

    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def accept_and_stay_silent():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept_and_stay_silent, daemon=True).start()
    timeout = 2
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    # huggingface_hub reads these when it is imported, so the fetch runs in a fresh interpreter
    env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{server.getsockname()[1]}",
               HF_HOME=str(tmp_path / "hf"), LLMINFER_HUB_TIMEOUT=str(timeout))
    try:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", SILENT_HUB_CHILD], env=env, capture_output=True, text=True,
                              timeout=60)
        wall = time.perf_counter() - start
    finally:
        server.close()
        for conn in held:
            conn.close()
    assert done.returncode == 0, done.stderr[-2000:]
    elapsed, message = done.stdout.split("\n", 1)
    print(f"\nsilent hub: gave up after {float(elapsed):.1f} s with LLMINFER_HUB_TIMEOUT={timeout} ({wall:.1f} s "
          f"with the interpreter's start)")
    assert held, "the client never connected to the silent server"
    assert "could not fetch 'someone/silent-model'" in message and "pass its local folder" in message
    assert "Timeout" in message
    # huggingface_hub spends up to 3 s of its own fetching a registry it uses in request headers, then one
    # request waits LLMINFER_HUB_TIMEOUT; nothing is retried
    assert timeout <= float(elapsed) < 3 + 2 * timeout < 60
    assert 3 + 2 * llminfer.checkpoint.HUB_TIMEOUT_S <= 60


@pytest.mark.parametrize("value", ["abc", "0", "-3", "inf", "nan"])
def test_hub_timeout_that_is_not_a_positive_number_is_refused(monkeypatch, value):
    monkeypatch.setenv("LLMINFER_HUB_TIMEOUT", value)
    with pytest.raises(ValueError, match=rf"LLMINFER_HUB_TIMEOUT='{value}' is not a positive number of seconds"):
        llminfer.load_pretrained("someone/no-such-model", device="cpu")


def test_hub_requests_carry_the_timeout(monkeypatch, tmp_path):
    """Without LLMINFER_HUB_TIMEOUT every hub request made for a hub id is bounded by HUB_TIMEOUT_S (<= 60 s)."""
    import huggingface_hub
    from types import SimpleNamespace
    monkeypatch.delenv("LLMINFER_HUB_TIMEOUT", raising=False)
    calls = []

    def repo_info(self, repo_id, timeout=None, **kwargs):
        calls.append(("repo_info", repo_id, timeout))
        return SimpleNamespace(sha="a" * 40)

    def snapshot_download(repo_id, **kwargs):
        calls.append(("snapshot_download", repo_id, kwargs))
        return str(tmp_path)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", repo_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert llminfer.checkpoint._fetch_from_hub("someone/m") == tmp_path
    timeout = llminfer.checkpoint.HUB_TIMEOUT_S
    assert 0 < timeout <= 60
    assert calls[0] == ("repo_info", "someone/m", timeout)
    assert calls[1][2]["revision"] == "a" * 40 and calls[1][2]["etag_timeout"] == timeout
    assert len(calls) == 2
