"""FlexAttention's compiles counted on the CPU: dynamo traces and guards the paged kernel as it does on CUDA (with
its "eager" backend, since Inductor's CPU template refuses a mask over the pool), so the guard classes of the
warm-up, of a second dtype and of a second head size can be counted without a GPU."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from llminfer.engine import PagedKVCache
from llminfer.engine import paged_attention

DEFAULT_LIMIT = 8                                   # torch._dynamo.config.recompile_limit's default


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """FlexAttention compiled on the CPU, fresh caches, and a hit of the recompile limit an error, not a silent
    fall back to the unfused kernel."""
    torch._dynamo.reset()
    monkeypatch.setitem(paged_attention.FLEX_COMPILE_BACKENDS, "cpu", "eager")
    monkeypatch.setattr(paged_attention, "_compiled_flex", {})
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    yield paged_attention._compiled_flex
    torch._dynamo.reset()


def _compiled_versions(compiled: dict, dtype: torch.dtype, head_dim: int) -> int:
    (run,) = [fn for key, fn in compiled.items() if key[1] == dtype and key[4] == head_dim]
    return len(_debug_get_cache_entry_list(run.code))


def test_each_guard_class_compiles_once_per_pool_shape_and_none_hits_the_limit(compiled_on_cpu):
    cache = PagedKVCache(1, 2, 16, num_blocks=24, block_size=16, device="cpu", dtype=torch.float32, kernel="flex")
    runs = cache.warm_up(n_heads=4)
    assert len(runs) == 9 and cache.kernel_fallbacks == 0
    warm = _compiled_versions(compiled_on_cpu, torch.float32, 16)
    assert warm == len(runs) > DEFAULT_LIMIT                     # one per class: past dynamo's default limit ...
    assert warm < paged_attention.FLEX_RECOMPILE_LIMIT           # ... within the kernel's own
    cache.warm_up(n_heads=4)                                     # every class again: nothing new to compile
    assert _compiled_versions(compiled_on_cpu, torch.float32, 16) == warm

    # a second dtype and a second head size: functions of their own, the first one's count untouched
    # (small pools: only the classes they can hold)
    half = PagedKVCache(1, 2, 16, num_blocks=2, block_size=16, device="cpu", dtype=torch.bfloat16, kernel="flex")
    wide = PagedKVCache(1, 2, 32, num_blocks=1, block_size=16, device="cpu", dtype=torch.float32, kernel="flex")
    assert half.warm_up(n_heads=4) == [1, 1, 2] and wide.warm_up(n_heads=4) == [1]
    assert _compiled_versions(compiled_on_cpu, torch.bfloat16, 16) == 3
    assert _compiled_versions(compiled_on_cpu, torch.float32, 32) == 1
    assert _compiled_versions(compiled_on_cpu, torch.float32, 16) == warm
    assert len(compiled_on_cpu) == 3


def test_without_a_backend_for_the_device_it_runs_eagerly(monkeypatch):
    monkeypatch.setattr(paged_attention, "_compiled_flex", {})
    q, keys = torch.zeros(1, 4, 1, 16), torch.zeros(1, 2, 64, 16)
    assert paged_attention._flex_function(q, keys) is paged_attention._flex_call
    assert paged_attention._compiled_flex == {}
