"""Several rows of x per weight load (issue: a decode step of B sequences, a verification of k + 1 positions): for every
weight format and every row count up to 16, the multi-row loops give what as many one-row products give and what a
float64 reference gives, at each level this CPU runs (LLMINFER_ISA forces the portable loops and the vector ones),
and a layer-stack step over R positions gives what R one-position steps give."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from llminfer import cpu
from llminfer.device import cpu_capabilities

ROWS = list(range(1, 17))            # 3, 7 and 13: not a multiple of a block of rows of x

_PRODUCTS = textwrap.dedent("""
    import json, torch
    from llminfer import cpu
    N, K = 44, 576                       # 44 rows: blocks of W with a remainder; int4 pads to 48
    g = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=g)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s_row, s_group = torch.rand(N, generator=g) * 0.01, torch.rand(N, K // 32, generator=g) * 0.01
    codes = torch.randint(0, 16, (N, K), dtype=torch.uint8, generator=g)
    s4, o4 = torch.rand(N, K // 32, generator=g) * 0.1, torch.randn(N, K // 32, generator=g) * 0.1
    tiles = cpu.tile_int4((codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous(), s4, o4)
    weights = {"float32": ([w], w.double()), "bfloat16": ([w.bfloat16()], w.bfloat16().double()),
               "int8": ([q, s_row], q.double() * s_row.double()[:, None]),
               "int8 groups": ([q, s_group], (q.double().view(N, -1, 32) * s_group.double()[..., None]).view(N, K)),
               "int4": ([*tiles, 32], (codes.double().view(N, -1, 32) * s4.double()[..., None]
                                       + o4.double()[..., None]).view(N, K)),
               "int4a8": ([*tiles, 32], None)}
    out = {"isa": cpu.isa(), "max_tokens": cpu.MAX_TOKENS}
    for rows in %(rows)r:
        x = torch.randn(rows, K, generator=g)
        for name, (args, exact) in weights.items():
            extra = {"activations": "int8"} if name == "int4a8" else {}
            got = cpu.gemv(x, *args, **extra).double()[:, :N]
            alone = torch.cat([cpu.gemv(x[i:i + 1], *args, **extra) for i in range(rows)]).double()[:, :N]
            scale = float(alone.abs().max())
            entry = {"vs_rows": float((got - alone).abs().max()) / scale}
            if exact is not None:
                entry["vs_float64"] = float((got - x.double() @ exact.T).abs().max()) / scale
            out[f"{name}/{rows}"] = entry
        xb = x.bfloat16()                  # a bfloat16 model's activations (vdpbf16ps where the CPU has it)
        got = cpu.gemv(xb, w.bfloat16()).double()
        alone = torch.cat([cpu.gemv(xb[i:i + 1], w.bfloat16()) for i in range(rows)]).double()
        out[f"bfloat16 x/{rows}"] = {"vs_rows": float((got - alone).abs().max() / alone.abs().max()),
                                     "vs_float64": float((got - xb.double() @ w.bfloat16().double().T).abs().max()
                                                         / alone.abs().max())}
    print(json.dumps(out))
""")


def _levels() -> list[str]:
    return [level for level in ("portable", "avx2", "avx512") if cpu._level_runs(level, cpu_capabilities().flags)]


def _run(script: str, level: str) -> dict:
    env = dict(os.environ, LLMINFER_ISA=level)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("level", _levels())
def test_every_format_takes_up_to_16_rows_as_many_one_row_products(level):
    assert cpu.available(), cpu.why_unavailable()
    got = _run(_PRODUCTS % {"rows": ROWS}, level)
    assert got["isa"] == level and got["max_tokens"] == 16
    for key, entry in got.items():
        if not isinstance(entry, dict):
            continue
        # float32 sums in another order: a few units of float32's rounding of the largest output (bfloat16 x: the
        # result is bfloat16, rounded once more, 8 bits of mantissa, against the float64 reference)
        assert entry["vs_rows"] < (1 / 128 if key.startswith("bfloat16 x") else 1e-5), (level, key, entry)
        if "vs_float64" in entry:
            assert entry["vs_float64"] < (1 / 128 if key.startswith("bfloat16 x") else 1e-5), (level, key, entry)


_STACK = textwrap.dedent("""
    import copy, json, sys, torch
    sys.path.insert(0, %(tests)r)
    from small_models import SMALL_CONFIGS, random_model
    from llminfer import cpu, fast, quant
    base = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    ids = torch.randint(0, base.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    out = {"isa": cpu.isa()}
    formats = {"float32": (torch.float32, None), "bfloat16": (torch.bfloat16, None), "int8": (torch.float32, (8, None)),
               "int4": (torch.float32, (4, 32)), "int4a8": (torch.float32, (4, 32))}
    for name, (dtype, scheme) in formats.items():
        model = copy.deepcopy(base).to(dtype)
        if scheme:
            quant.quantize(model, "int%%d" %% scheme[0], scheme[1], activations="int8" if name == "int4a8" else "float")
        model = fast.optimize_decode(model)
        for rows in (1, 3, 7, 13, 16):
            with torch.inference_mode():
                cache = model.new_cache(1, 40)
                model(ids[:, :8], cache=cache)
                together = model(ids[:, 8:8 + rows], cache=cache)           # one step of `rows` positions
                cache = model.new_cache(1, 40)
                model(ids[:, :8], cache=cache)
                alone = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(8, 8 + rows)], dim=1)
            out[f"{name}/{rows}"] = float((together.float() - alone.float()).abs().max() / alone.float().abs().max())
    print(json.dumps(out))
""")


@pytest.mark.parametrize("level", _levels()[:2])
def test_a_stack_step_over_r_positions_is_r_one_position_steps(level):
    """A speculative verification's forward (k + 1 positions of one sequence) in one native stack step gives the
    logits of as many decode steps, in every format, at the portable and the first vector level."""
    got = _run(_STACK % {"tests": os.path.dirname(os.path.dirname(__file__))}, level)
    assert got.pop("isa") == level
    for key, error in got.items():
        limit = 2e-2 if key.startswith("bfloat16") else 1e-4       # bfloat16 rounds each layer's sums
        assert error < limit, (level, key, error)
