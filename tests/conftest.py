"""Test settings shared by the unit tests."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# the tests live in one folder per package (tests/core, tests/engine, ...); their shared helpers (small_models) here
sys.path.insert(0, str(Path(__file__).parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Chapter 07's Triton kernel runs on CPU tensors only under Triton's interpreter, a mode fixed when triton
# is first imported (torch._dynamo and transformers import it too): without CUDA, choose it before they do.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def native_calls(monkeypatch):
    """Records, for each forward through a NativeDecoderStack, whether it ran as one native call
    (tests/cpu, tests/engine)."""
    from llminfer import fast
    seen = []
    real = fast.NativeDecoderStack.native_step

    def spy(self, *args):
        out = real(self, *args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(fast.NativeDecoderStack, "native_step", spy)
    return seen
