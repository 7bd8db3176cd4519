"""Sizes checked by arithmetic before allocation: the KV pool, its blocks, and a config against its checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest

import llminfer
from llminfer import checkpoint as checkpoint_module
from llminfer.checkpoint import model_folder
from llminfer.costs import kv_cache_bytes
from llminfer.engine import LLMEngine
from llminfer.engine import llm_engine as llm_engine_module


@pytest.fixture(scope="module")
def model():
    return llminfer.load_pretrained("tiny-capitals", load_tokenizer=False)[0]


@pytest.fixture
def nothing_allocated(monkeypatch):
    """Fails the test if the engine builds its block manager or its pool."""
    def refuse(*args, **kwargs):
        raise AssertionError("allocated before the size was checked")
    monkeypatch.setattr(llm_engine_module, "BlockManager", refuse)
    monkeypatch.setattr(llm_engine_module.PagedKVCache, "for_model", refuse)


def test_a_huge_num_blocks_is_refused_by_arithmetic(model, nothing_allocated):
    per_block = kv_cache_bytes(model.config, 16, 4)
    with pytest.raises(MemoryError, match=rf"num_blocks=1000000000 blocks .*\({per_block} bytes of K/V a block.* "
                                          r"GiB but only .* GiB is free .*pass a smaller num_blocks"):
        LLMEngine(model, num_blocks=10**9)


def test_block_bookkeeping_counts_too(model, nothing_allocated, monkeypatch):
    free = 10**9
    monkeypatch.setattr("llminfer.device.free_memory_bytes", lambda device: free)
    blocks = free // llm_engine_module.BLOCK_BOOKKEEPING_BYTES           # the K/V would fit at 1 byte a block...
    monkeypatch.setattr(llm_engine_module, "kv_cache_bytes", lambda *a: 1)
    with pytest.raises(MemoryError, match=rf"the bookkeeping of num_blocks={blocks} blocks"):
        LLMEngine(model, num_blocks=blocks)


def test_a_block_larger_than_a_request_is_refused(model, nothing_allocated):
    with pytest.raises(ValueError, match=r"block_size=1048576 is larger than a request can fill \(max_model_len="
                                         r"128\); pass block_size <= 128"):
        LLMEngine(model, block_size=2**20)


def test_kv_cache_memory_sizes_the_pool(model):
    per_block = kv_cache_bytes(model.config, 16, 4)
    engine = LLMEngine(model, kv_cache_memory=20 * per_block + 5)
    assert engine.num_blocks == 20 and engine.cache.nbytes == 20 * per_block
    assert "kv_cache_memory" in engine.pool_sizing
    with pytest.raises(ValueError, match=rf"too few for one request .*pass kv_cache_memory >= {8 * per_block}"):
        LLMEngine(model, kv_cache_memory=per_block)
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(model, kv_cache_memory=20 * per_block, num_blocks=20)
    with pytest.raises(ValueError, match="kv_cache_memory must be an integer"):
        LLMEngine(model, kv_cache_memory=1e6)


def test_the_default_pool_is_what_max_num_seqs_requests_need_capped_by_free_memory(model, monkeypatch):
    per_block = kv_cache_bytes(model.config, 16, 4)
    one_request = 128 // 16
    monkeypatch.setattr(llm_engine_module, "free_memory_bytes", lambda device: 1 << 34)
    assert LLMEngine(model, max_num_seqs=3).num_blocks == 3 * one_request          # the need
    free = 10 * one_request * per_block
    monkeypatch.setattr(llm_engine_module, "free_memory_bytes", lambda device: free)
    capped = LLMEngine(model, max_num_seqs=16, kv_memory_fraction=0.3)
    assert capped.num_blocks == int(0.3 * free) // per_block < 16 * one_request  # the cap
    floor = LLMEngine(model, max_num_seqs=16, kv_memory_fraction=0.01)
    assert floor.num_blocks == one_request                                        # at least one full request


def _folder_with_config(tmp_path, **changes):
    source = model_folder("tiny-capitals")
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes,words", [
    (dict(num_hidden_layers=10**5), r"config.json gives 100000 layers \(n_layers\) but the checkpoint's tensors "
                                    r"hold 4 \(layers.0 .. layers.3\)"),
    (dict(vocab_size=10**7), r"'model.embed_tokens.weight' has shape \(1024, 128\) in the checkpoint but config.json "
                             r"implies \(10000000, 128\)"),
])
def test_a_config_that_disagrees_with_its_tensors_is_refused_from_the_headers(tmp_path, monkeypatch, changes, words):
    folder = _folder_with_config(tmp_path, **changes)

    def refuse(config):
        raise AssertionError("built a model for the config before checking it against the headers")
    monkeypatch.setattr(checkpoint_module, "_meta_model", refuse)
    with pytest.raises(ValueError, match=words):
        llminfer.load_pretrained(folder)


# --- checks at load and before sampling ---------------------------------------------------------------------

def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    folder = _folder_with_config(tmp_path)
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens(["<one-too-many>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"has 1025 ids but the model's vocabulary has 1024: ids 1024..1024 would "
                                         r"index past its embedding"):
        llminfer.load_pretrained(folder)
    with pytest.warns(UserWarning, match=r"vocabulary of 1024 ids but its tokenizer spells only 1000; a generated "
                                         r"id in 1000..1023 cannot be decoded"):
        checkpoint_module.check_vocabularies(1000, 1024)


def test_nan_weights_load_with_a_warning(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    folder = _folder_with_config(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, 5] = float("nan")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 weight tensor\(s\) of model hold NaN or inf values "
                                         r"\(layers.1.mlp.up_proj.weight\)"):
        model, _ = llminfer.load_pretrained(folder)
    assert torch.isnan(model.layers[1].mlp.up_proj.weight).any()


def test_clean_weights_load_without_a_warning(recwarn):
    llminfer.load_pretrained("tiny-capitals")
    assert not [w for w in recwarn if "NaN" in str(w.message) or "vocabulary" in str(w.message)]


def test_the_seed_range_is_named(model):
    from llminfer.engine import SamplingParams
    for seed in (2**64, -2**63 - 1):
        with pytest.raises(ValueError, match=r"seed=-?\d+ is outside the range a random generator takes, "
                                             r"-2\*\*63 .. 2\*\*64 - 1"):
            llminfer.generate(model, [1, 5, 6], max_new_tokens=2, temperature=1.0, seed=seed)
        with pytest.raises(ValueError, match="outside the range"):
            SamplingParams(temperature=1.0, seed=seed)
    assert len(llminfer.generate(model, [1, 5, 6], max_new_tokens=2, temperature=1.0, seed=2**64 - 1).token_ids) == 2


def test_a_drafter_proposing_ids_outside_the_vocabulary_is_refused(model):
    from llminfer import speculative

    class Wild(speculative.Drafter):
        name = "wild"

        def propose(self, context_ids, k):
            return [3, model.config.vocab_size + 7][:k]

    with pytest.raises(ValueError, match=r"the drafter 'wild' proposed 1031 as guess 1, not a token id of the "
                                         r"target \(0..1023\)"):
        speculative.generate(model, [1, 5, 6], Wild(), num_speculative_tokens=2, max_new_tokens=8)


def test_the_finiteness_check_reads_every_chunk(monkeypatch):
    import torch
    monkeypatch.setattr(checkpoint_module, "_FINITE_CHUNK", 7)           # chunks of 7 elements over 6 x 5
    model = torch.nn.Linear(5, 6)
    assert checkpoint_module.warn_if_not_finite(model) == []
    with torch.no_grad():
        model.weight[5, 4] = float("inf")                                # the last element, in the last chunk
    with pytest.warns(UserWarning, match="NaN or inf"):
        assert checkpoint_module.warn_if_not_finite(model) == ["weight"]
    with torch.no_grad():
        model.weight[5, 4] = 0.0
        model.bias[0] = float("nan")
    with pytest.warns(UserWarning, match="NaN or inf"):
        assert checkpoint_module.warn_if_not_finite(model) == ["bias"]
