"""Loading takes the memory it claims: peak extra memory within 1.3x the weights in the target dtype."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

LIMIT = 1.3          # peak extra memory while loading / bytes of the weights in the target dtype
SHAPE = "smollm2-135m"

# Run in a fresh interpreter so that no other test's allocations move the peak. The measurement starts right
# after `import llminfer`: one-time costs of the first load (lazy imports, torch's first use of a kernel) count.
CHILD = r"""
import json, sys
import torch
import llminfer

torch.set_num_threads(1)
mode, device, folder, shape = sys.argv[1], torch.device(sys.argv[2]), sys.argv[3], sys.argv[4]


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024


if device.type == "cuda":
    torch.cuda.init()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
else:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                        # resets VmHWM, the peak resident set, to the current VmRSS
    before = status("VmRSS")
if mode == "random":
    model = llminfer.load_random(shape, device=device, dtype=torch.bfloat16)
else:
    model = llminfer.load_pretrained(folder, device=device, dtype=torch.bfloat16, load_tokenizer=False)[0]
if device.type == "cuda":
    torch.cuda.synchronize()
    peak, after = torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before
else:
    peak, after = status("VmHWM") - before, status("VmRSS") - before
weights = sum(p.numel() * p.element_size() for p in model.parameters())   # a tied head counts once
print(json.dumps({"weights": weights, "claimed": model.config.n_params() * 2, "peak": peak, "after": after,
                  "dtype": str(model.dtype), "device": str(model.device),
                  "tied": model.lm_head.weight is model.embed_tokens.weight}))
"""


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).resolve().parents[2])


def _wait(child: subprocess.Popen, timeout: float = 120) -> str:
    stdout, stderr = child.communicate(timeout=timeout)
    assert child.returncode == 0, stderr[-3000:]
    return stdout


def _run(*args: str) -> str:
    return _wait(_child(*args))


def _measure(mode: str, device: str, folder: Path | str = "-") -> dict:
    result = json.loads(_run(CHILD, mode, device, str(folder), SHAPE).strip().splitlines()[-1])
    print(f"\n{mode} {SHAPE} bf16 on {device}: weights {result['weights'] / 2**20:.0f} MiB, "
          f"peak extra {result['peak'] / result['weights']:.3f}x, after {result['after'] / result['weights']:.3f}x")
    assert result["dtype"] == "torch.bfloat16" and result["device"].startswith(device) and result["tied"]
    assert result["weights"] == result["claimed"]      # the size the memory check was made for
    return result


@pytest.fixture(scope="module", autouse=True)
def _saving(tmp_path_factory):
    """Saves smollm2-135m's shape with random float32 weights (513 MiB) as a model folder, in another process
    that runs while the first test measures."""
    folder = tmp_path_factory.mktemp("float32") / SHAPE
    child = _child("import sys, torch, llminfer; torch.set_num_threads(1); llminfer.save_pretrained("
                   f"llminfer.load_random('{SHAPE}', device='cpu', dtype=torch.float32), sys.argv[1])", str(folder))
    yield child, folder
    if child.poll() is None:
        child.kill()
        child.communicate()


@pytest.fixture
def float32_folder(_saving):
    child, folder = _saving
    if child.returncode is None:
        _wait(child)
    assert child.returncode == 0
    return folder


_needs_proc = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                                 reason="measuring peak RSS needs Linux's /proc/self/clear_refs")


@_needs_proc
def test_load_random_peak_memory_is_the_weights_in_their_dtype():
    result = _measure("random", "cpu")
    assert result["peak"] <= LIMIT * result["weights"]
    assert result["after"] >= 0.9 * result["weights"]   # the measurement sees the weights themselves


@_needs_proc
def test_load_pretrained_float32_file_into_bfloat16_peak_memory(float32_folder):
    assert (float32_folder / "model.safetensors").stat().st_size > 2 * 256 * 2**20   # float32 on disk
    result = _measure("pretrained", "cpu", float32_folder)
    assert result["peak"] <= LIMIT * result["weights"]
    assert result["after"] >= 0.9 * result["weights"]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["random", "pretrained"])
def test_cuda_peak_memory_is_the_weights_in_their_dtype(mode, request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    folder = request.getfixturevalue("float32_folder") if mode == "pretrained" else "-"
    result = _measure(mode, "cuda", folder)
    assert result["peak"] <= LIMIT * result["weights"]
    assert result["after"] >= result["weights"]
