"""llminfer.fast.use_huge_pages: a model's weights moved into one huge-page-backed block (llminfer.device's),
unchanged."""
from __future__ import annotations

import copy
import mmap
import re
from pathlib import Path

import pytest
import torch

import llminfer
from llminfer import fast
from llminfer.device import on_huge_pages

from small_models import SMALL_CONFIGS, random_model

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MADVISE = hasattr(mmap, "MADV_HUGEPAGE")          # Linux: memory can be asked for on huge pages
NOT_LINUX = "no madvise(MADV_HUGEPAGE) on this platform: nothing moves onto huge pages"


def _huge_kib_around(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`, from /proc/self/smaps."""
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            current = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_weights_move_with_their_values_ties_and_names():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    reference = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    params = {name: p for name, p in model.named_parameters()}
    fast.use_huge_pages(model, min_bytes=0)
    if not MADVISE:
        assert not any(on_huge_pages(p) for p in model.parameters())
        pytest.skip(NOT_LINUX + " (checked); the rest of this test needs it")
    assert all(on_huge_pages(p) for p in model.parameters())
    assert {name: p for name, p in model.named_parameters()} == params          # the same Parameter objects
    assert model.lm_head.weight is model.embed_tokens.weight                    # still tied
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name
        assert p.data_ptr() % 64 == 0, name                                     # each on a cache line
    with torch.inference_mode():
        assert torch.equal(model(ids), reference(ids))
    fast.use_huge_pages(model, min_bytes=0)                                     # a second call moves nothing
    assert all(p.data_ptr() == params[name].data_ptr() for name, p in model.named_parameters())


def test_a_moved_model_saves_loads_and_copies(tmp_path):
    model = random_model(SMALL_CONFIGS["qwen2-bias-gqa"])
    fast.use_huge_pages(model, min_bytes=0)
    llminfer.save_pretrained(model, tmp_path)
    loaded, _ = llminfer.load_pretrained(tmp_path, device="cpu", load_tokenizer=False)   # huge pages: a CPU model
    twin = copy.deepcopy(model)
    for (name, p), (_, q), (_, r) in zip(model.named_parameters(), loaded.named_parameters(), twin.named_parameters()):
        assert torch.equal(p, q) and torch.equal(p, r), name


def test_quantized_codes_move_and_small_models_stay_by_default():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    llminfer.quant.quantize(model, "int8")
    before = [p.data_ptr() for p in model.parameters()]
    fast.use_huge_pages(model)                        # below the default 8 MiB: left where it is
    assert [p.data_ptr() for p in model.parameters()] == before
    fast.use_huge_pages(model, min_bytes=0)
    if MADVISE:
        codes = [m.qweight for m in model.modules() if isinstance(m, llminfer.quant.QuantizedLinear)]
        assert codes and all(on_huge_pages(c) for c in codes)


def test_the_kernel_backs_a_large_model_with_huge_pages():
    """Where transparent huge pages are on ([always] or [madvise]), the block really gets 2 MiB pages."""
    config = llminfer.ModelConfig(vocab_size=8192, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=512,
                                  max_seq_len=64)
    model = llminfer.Transformer(config).init_weights(0)                        # 12 MiB of float32
    fast.use_native_kernels(model)                                              # moves it (huge_pages=True)
    weight = model.embed_tokens.weight
    mode = THP.read_text() if THP.exists() else "[never]"
    if "[never]" in mode or not MADVISE:
        assert not on_huge_pages(weight) or _huge_kib_around(weight.data_ptr()) == 0
        pytest.skip(f"transparent huge pages are {mode.strip()} here, or {NOT_LINUX}: no 2 MiB pages to find")
    assert on_huge_pages(weight)
    assert _huge_kib_around(weight.data_ptr()) >= 2048, mode


def test_tensors_that_share_memory_keep_sharing_it():
    """Two parameters over one block of memory (not the same Parameter, so not a tie) are left where they are:
    moving each alone would silently untie them."""
    model = random_model(SMALL_CONFIGS["llama-mha-untied"])
    mlp = model.layers[0].mlp
    mlp.up_proj.weight.data = mlp.gate_proj.weight.data                       # one storage, two Parameters
    half = model.layers[1].self_attn.q_proj.weight
    half.data = torch.cat([half.data, half.data])[: half.shape[0]]            # a view of a larger block
    fast.use_huge_pages(model, min_bytes=0)
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_proj.weight.data_ptr()
    assert not on_huge_pages(mlp.up_proj.weight) and not on_huge_pages(half)
    if MADVISE:
        assert on_huge_pages(model.layers[1].self_attn.k_proj.weight)   # the rest moved


def test_the_record_of_a_block_goes_with_it():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    fast.use_huge_pages(model, min_bytes=0)
    weight = model.layers[0].mlp.down_proj.weight
    start = weight.untyped_storage().data_ptr()
    if not on_huge_pages(weight):
        pytest.skip(NOT_LINUX)
    del model, weight
    import gc
    gc.collect()
    assert start not in llminfer.device._ARENAS


def test_huge_page_copy_keeps_values_and_lands_on_huge_pages_where_it_can():
    from llminfer.device import huge_page_copy, huge_page_empty

    for t in (torch.randn(300, 7), torch.randint(0, 256, (33, 5, 32), dtype=torch.uint8),
              torch.rand(64).half()):
        copied = huge_page_copy(t)
        assert torch.equal(copied, t) and copied.dtype == t.dtype and copied.shape == t.shape
        if huge_page_empty((1,)) is None:         # the platform gives no 2 MiB pages: the tensor itself comes back
            assert copied is t
        else:
            assert on_huge_pages(copied) and copied.data_ptr() != t.data_ptr()
