"""The Triton kernel's launch configuration: num_warps and num_stages per dtype and tile, and the measured reason
(ptxas's register and spill report for sm_90, which Triton's bundled compiler gives without a GPU)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llminfer.flash import triton_flash
from llminfer.flash.triton_flash import LAUNCH_CONFIGS, default_blocks, launch_config, padded_head_dim

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_tile_the_kernel_picks_itself_has_its_measured_configuration(dtype):
    for head_dim in range(1, triton_flash.MAX_HEAD_DIM + 1):
        block_m, block_n = default_blocks(head_dim, dtype)
        for tiles in ((block_m, block_n), (16, block_n)):                 # flash_attention's, flash_decode's
            key = (dtype == torch.float32, padded_head_dim(head_dim), *tiles)
            assert key in LAUNCH_CONFIGS, f"{dtype} head_dim {head_dim} tiles {tiles}: no measured entry"
            assert launch_config(head_dim, dtype, *tiles) == LAUNCH_CONFIGS[key]


def test_float32_gets_more_warps_where_four_spilled():
    assert launch_config(128, torch.float32, 64, 32) == (8, 2)           # 4 warps spilled an 8.8 KB stack
    assert launch_config(64, torch.float32, 64, 64) == (16, 2)
    assert launch_config(64, torch.bfloat16, 64, 64) == (4, 2)           # the tensor-core path fits in 4
    assert launch_config(80, torch.bfloat16, 64, 64) == launch_config(128, torch.bfloat16, 64, 64) == (8, 2)
    assert all(warps in (4, 8, 16) and stages in (1, 2) for warps, stages in LAUNCH_CONFIGS.values())


def test_tiles_a_caller_chooses_get_the_estimate():
    assert (True, 128, 32, 32) not in LAUNCH_CONFIGS
    assert launch_config(16, torch.bfloat16, 16, 16) == (4, 2)            # small tiles: 4 warps, 2 stages
    assert launch_config(256, torch.float32, 128, 128) == (8, 1)          # large ones: 8 warps, no second stage
    assert launch_config(128, torch.bfloat16, 128, 32) == (8, 2)          # 128 × 128 Q and accumulator: 8 warps


# Compiles the kernel for sm_90 on this machine (no GPU needed) and prints ptxas's registers and spill stack
_COMPILE = r"""
import inspect, json, os, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llminfer.flash.flash_kernel import flash_forward

params = list(inspect.signature(flash_forward.fn).parameters)
tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
results = []
for block_m, block_n, block_d, warps, stages in json.loads(sys.argv[1]):
    pointers = ("Q", "K", "V", "O", "LSE", "MASK", "COUNTS")
    sig = {p: "*fp32" if p in pointers else "constexpr" if p.isupper() else "fp32" if p == "qk_scale" else "i32"
           for p in params}
    consts = dict(CAUSAL=True, HAS_MASK=False, COUNT_TILES=False, IEEE_DOT=True, WIDEN=False,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    source = ASTSource(flash_forward, sig, constexprs={(params.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    fields = dict(item.split(":") for item in usage.split() if item.startswith(("REG:", "STACK:")))
    results.append({"registers": int(fields["REG"]), "stack": int(fields["STACK"])})
print(json.dumps(results))
"""


@pytest.mark.skipif(not triton_flash.triton_available(), reason="needs the triton package (its compiler and ptxas)")
def test_ptxas_confirms_the_float32_choice_spills_nothing_where_four_warps_spill(tmp_path):
    tools = Path(importlib.util.find_spec("triton").origin).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() or not (tools / "cuobjdump").exists():
        pytest.skip("this triton build carries no ptxas / cuobjdump")
    warps, stages = launch_config(128, torch.float32, 64, 32)
    runs = [[64, 32, 128, warps, stages], [64, 32, 128, 4, 2]]
    env = dict(os.environ, PYTHONPATH=str(ROOT))            # (Triton's cache keys a compile by source and options)
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(runs)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    chosen, four = json.loads(done.stdout.strip().splitlines()[-1])
    assert chosen["stack"] == 0 and chosen["registers"] <= 255
    assert four["stack"] > 4096                                         # kilobytes of spills a thread
