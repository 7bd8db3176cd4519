"""The kernels' instruction-set dispatch (llminfer.cpu.choose_isa), every level this CPU runs against a
float64 reference, the W4A8 and grouped-int8 paths, and the measured prefill choice's logic. Appendix A1."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from llminfer import quant
from llminfer.attention import attention
from llminfer.device import cpu_capabilities, parse_cpuinfo
from llminfer import cpu
from llminfer.quant.linear import QuantizedLinear

FIXTURES = Path(__file__).parents[1] / "fixtures" / "cpuinfo"


def _fixture(name: str):
    return parse_cpuinfo((FIXTURES / f"{name}.txt").read_text())


# fixture -> the levels its CPU runs, lowest first
RUNNABLE = {
    "arm_neoverse": ["portable"],
    "amd_epyc_avx2": ["portable", "avx2"],
    "amd_zen4_avx512_bf16": ["portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"],
    "intel_xeon_avx512_bf16_vnni": ["portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"],
    "intel_xeon_amx": ["portable", "avx2", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16", "amx"],
    "amd_zen5_avx512_bf16_avx_vnni": ["portable", "avx2", "avx_vnni", "avx512", "avx512_vnni", "avx512_bf16"],
}


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_every_level_at_or_below_the_cpu_is_taken_and_every_level_above_is_refused(name, monkeypatch):
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    monkeypatch.delenv("LLMINFER_CPU_KERNELS_PORTABLE", raising=False)
    caps = _fixture(name)
    runnable = RUNNABLE[name]
    assert cpu.choose_isa(caps).level == runnable[-1]
    for level in cpu.KERNEL_LEVELS:
        if level in runnable:
            choice = cpu.choose_isa(caps, level)
            assert choice.level == level and choice.forced
            # a level runs its own instructions and those of every lower level the CPU has
            assert choice.features == tuple(l for l in runnable[1:] if runnable.index(l) <= runnable.index(level))
        else:
            with pytest.raises(ValueError, match=rf"LLMINFER_ISA={level} needs the CPU flags .* the highest it runs "
                                                 rf"is {runnable[-1]}"):
                cpu.choose_isa(caps, level)


def test_the_default_is_the_highest_level_and_unknown_levels_are_refused(monkeypatch):
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    monkeypatch.delenv("LLMINFER_CPU_KERNELS_PORTABLE", raising=False)
    amx = _fixture("intel_xeon_amx")
    assert amx.isa_level == "amx"
    default = cpu.choose_isa(amx)
    assert (default.level, default.forced) == ("amx", False)
    assert default.bits == 1 + 16 + 2 + 4 + 8 + 32
    assert cpu.choose_isa(amx, "avx512_bf16").bits == 1 + 16 + 2 + 4 + 8       # the tiles off, for comparisons
    # AMX tiles without their bfloat16 instructions run the level below
    no_bf16 = parse_cpuinfo((FIXTURES / "intel_xeon_amx.txt").read_text().replace(" amx_bf16", ""))
    assert cpu.choose_isa(no_bf16).level == "avx512_bf16"
    with pytest.raises(ValueError, match=r"LLMINFER_ISA='sse9' is not a level .*known levels are portable"):
        cpu.choose_isa(amx, "sse9")
    monkeypatch.setenv(cpu.ISA_ENV, "AVX2")                            # the environment, any case
    assert cpu.choose_isa(amx).level == "avx2" and cpu.choose_isa(amx).features == ("avx2",)
    monkeypatch.delenv(cpu.ISA_ENV)
    monkeypatch.setenv("LLMINFER_CPU_KERNELS_PORTABLE", "1")          # the older switch still works
    assert cpu.choose_isa(amx).level == "portable" and cpu.choose_isa(amx).bits == 0


def test_isa_reports_what_runs_here():
    assert cpu.available(), cpu.why_unavailable()
    here = cpu.choose_isa(cpu_capabilities())
    assert cpu.isa() == here.level and cpu.isa_features() == here.features
    assert int(torch.ops.llminfer.cpu_features()) == here.bits


def _cases(generator):
    """x (3, 576) and, per format, (kernel arguments, float64 reference weight)."""
    n, k = 37, 576
    x = torch.randn(3, k, generator=generator)
    w = torch.randn(n, k, generator=generator)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=generator)
    s_row, s_group = torch.rand(n, generator=generator), torch.rand(n, k // 32, generator=generator)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    nibbles = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scale = torch.rand(n, k // 64, generator=generator) * 0.1
    offset = torch.randn(n, k // 64, generator=generator) * 0.1
    int4 = (codes.double().view(n, k // 64, 64) * scale.double()[..., None] + offset.double()[..., None]).view(n, k)
    # int4 in tiles of 8 rows (40 rows: five tiles, so the loops take four tiles at once and then one)
    codes40 = torch.randint(0, 16, (40, k), dtype=torch.uint8, generator=generator)
    scale40 = torch.rand(40, k // 32, generator=generator) * 0.1
    offset40 = torch.randn(40, k // 32, generator=generator) * 0.1
    tiled = cpu.tile_int4((codes40[:, 0::2] | (codes40[:, 1::2] << 4)).contiguous(), scale40, offset40)
    int4_tiled = (codes40.double().view(40, k // 32, 32) * scale40.double()[..., None]
                  + offset40.double()[..., None]).view(40, k)
    # the same codes with float16 terms (as the quantized layers keep them): 2 bytes each, widened by vcvtph2ps
    scale16, offset16 = scale40.half(), offset40.half()
    tiled16 = cpu.tile_int4((codes40[:, 0::2] | (codes40[:, 1::2] << 4)).contiguous(), scale16, offset16)
    int4_tiled16 = (codes40.double().view(40, k // 32, 32) * scale16.double()[..., None]
                    + offset16.double()[..., None]).view(40, k)
    cases = {
        "f32": ((w,), w.double()),
        "bf16": ((w.bfloat16(),), w.bfloat16().double()),
        "int8": ((q, s_row), q.double() * s_row.double()[:, None]),
        "int8_g32": ((q, s_group), (q.double().view(n, k // 32, 32) * s_group.double()[..., None]).view(n, k)),
        "int4": ((nibbles, scale, offset, 64), int4),
        "int4_tiled": ((*tiled, 32), int4_tiled),
        "int4_tiled16": ((*tiled16, 32), int4_tiled16),
    }
    return x, cases


_RUN_LEVEL = textwrap.dedent("""
    import json, sys, torch
    from llminfer import cpu
    sys.path.insert(0, sys.argv[2])
    from test_cpu_isa import _attention_cases, _cases
    x, cases = _cases(torch.Generator().manual_seed(0))
    out = {"isa": cpu.isa()}
    for rows in (1, 3, 20, 70):              # the matrix-vector loops, and the blocked kernel: 20 rows (one token
                                             # tile, part full) and 70 (whole tiles of 16, 32 or 64 tokens, then a part)
        xr = x.repeat(24, 1)[:rows]
        for name, (args, _) in cases.items():
            out[f"{name}/{rows}"] = cpu.gemv(xr, *args).tolist()
        for name in ("int4", "int4_tiled", "int4_tiled16"):
            out[f"w4a8/{name}/{rows}"] = cpu.gemv(xr, *cases[name][0], activations="int8").tolist()
        # x already bfloat16 (a bfloat16 model's activations): the vdpbf16ps loops take it where the CPU has them
        out[f"bf16_x/{rows}"] = cpu.gemv(xr.bfloat16().float(), *cases["bf16"][0]).tolist()
    for name, (q, k, v) in _attention_cases(torch.Generator().manual_seed(1)).items():
        out[f"attention/{name}"] = cpu.decode_attention(q, k, v).float().tolist()
    print(json.dumps(out))
""")


def _attention_cases(generator):
    """Decode attention problems (q, k, v): query heads a K/V head shares 3, 4 and 6 (more than one pass of four),
    head sizes 64, 32 and 16 (each a different register width of the 16-lane loops), keys not a multiple of 4. And
    prefills (16 query positions or more: with AVX-512, blocks of 16 positions as small matrix products): 40 positions
    (a last block of 8), 37 after 8 cached ones in two sequences, 20 with 6 query heads a K/V head (96 query rows a
    block), 17 with one query head a K/V head and head size 128 (two passes of 64 columns)."""
    cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, hkv, tq, tk, d in ((1, 9, 3, 1, 203, 64), (2, 8, 2, 3, 37, 32), (1, 6, 1, 1, 50, 16),
                                     (1, 9, 3, 40, 40, 64), (2, 8, 2, 37, 45, 32), (1, 6, 1, 20, 20, 16),
                                     (1, 4, 4, 17, 17, 128)):
            q, k, v = (torch.randn(b, heads, t, d, generator=generator).to(dtype)
                       for heads, t in ((h, tq), (hkv, tk), (hkv, tk)))
            cases[f"{str(dtype)[6:]}/{h}x{hkv}/{tq}x{tk}/{d}"] = (q, k, v)
    return cases


def _levels_here() -> list[str]:
    caps = cpu_capabilities()
    return [level for level in cpu.KERNEL_LEVELS if cpu._level_runs(level, caps.flags)]


@pytest.mark.parametrize("level", _levels_here())
def test_every_level_this_cpu_runs_matches_the_float64_reference(level):
    """Each path runs in its own process (the level is chosen once per process) under LLMINFER_ISA=level."""
    env = dict(os.environ, LLMINFER_ISA=level)
    env.pop("LLMINFER_CPU_KERNELS_PORTABLE", None)
    done = subprocess.run([sys.executable, "-c", _RUN_LEVEL, "-", str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["isa"] == level
    x, cases = _cases(torch.Generator().manual_seed(0))
    for rows in (1, 3, 20, 70):
        xr = x.repeat(24, 1)[:rows].double()
        for name, (_, weight) in cases.items():
            reference = xr @ weight.T
            got = torch.tensor(there[f"{name}/{rows}"], dtype=torch.float64)
            # float32 x is never rounded to bfloat16 on the way (the vdpbf16ps loops take only bfloat16 x)
            assert float((got - reference).abs().max()) < 1e-4 * float(reference.abs().max()), (level, name, rows)
        reference = xr.bfloat16().double() @ cases["bf16"][1].T
        got = torch.tensor(there[f"bf16_x/{rows}"], dtype=torch.float64)
        assert float((got - reference).abs().max()) < 1e-4 * float(reference.abs().max()), (level, "bf16_x", rows)
        for name in ("int4", "int4_tiled", "int4_tiled16"):
            w4a8 = torch.tensor(there[f"w4a8/{name}/{rows}"], dtype=torch.float64)
            reference = xr @ cases[name][1].T
            error = float((w4a8 - reference).abs().max() / reference.abs().max())
            assert (0 < error < 2e-2) if rows <= cpu.MAX_TOKENS else error < 1e-4, (level, name, rows, error)
            if rows <= cpu.MAX_TOKENS:              # x rounded to int8 blocks exactly as the reference rounds it
                expected = _w4a8_reference(xr, cases[name][1], _offsets(cases[name][0]))
                assert float((w4a8 - expected).abs().max()) < 1e-5 * float(expected.abs().max()), (level, name, rows)
        # the tiled and row-major W4A8 loops round x the same way: the same integer sums, float rounding apart
        tiled = torch.tensor(there[f"w4a8/int4_tiled/{rows}"], dtype=torch.float64)
        nibbles, scale, offset = cpu.untile_int4(*cases["int4_tiled"][0][:3])
        rowmajor = cpu.gemv(x.repeat(24, 1)[:rows], nibbles, scale, offset, 32, activations="int8").double()
        assert float((tiled - rowmajor).abs().max()) < 1e-5 * float(rowmajor.abs().max()), (level, rows)
        # float16 terms give what float32 ones of the same values give
        tiled16 = torch.tensor(there[f"w4a8/int4_tiled16/{rows}"], dtype=torch.float64)
        nibbles, scale, offset = cpu.untile_int4(*cases["int4_tiled16"][0][:3])
        rowmajor = cpu.gemv(x.repeat(24, 1)[:rows], nibbles, scale.float(), offset.float(), 32,
                            activations="int8").double()
        assert float((tiled16 - rowmajor).abs().max()) < 1e-5 * float(rowmajor.abs().max()), (level, rows)
    # decode attention (the 16-lane loops take a K/V head's query heads together; the others one at a time)
    for name, (q, k, v) in _attention_cases(torch.Generator().manual_seed(1)).items():
        reference = attention(q.double(), k.double(), v.double(), causal=True)[0]
        got = torch.tensor(there[f"attention/{name}"], dtype=torch.float64)
        assert float((got - reference).abs().max()) < (1e-5 if name.startswith("float32") else 1e-2), (level, name)


def test_the_blocked_bfloat16_products_pack_every_input_and_fall_back_on_one_that_is_not_bfloat16():
    """A prefill's bfloat16 products by the blocked kernel (vdpbf16ps where the CPU has AVX512-BF16): x is packed in
    blocks of 16 input pairs and 16 tokens, so the shapes here leave 4 pairs over (K = 584), a second token tile of
    8 tokens (40 rows) and a last block of W with 1 row (N = 37). An x with one input that is not a bfloat16 value,
    in the pairs left over or in a block, takes the float32 tile: the sum of float32 products, not of that input
    rounded."""
    g = torch.Generator().manual_seed(3)
    n, k, rows = 37, 584, 40
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16().float()
    reference = x.double() @ w.double().T
    got = cpu.gemv(x, w).double()
    assert float((got - reference).abs().max()) < 1e-5 * float(reference.abs().max())
    for row, col in ((39, 583), (5, 100)):                   # in the pairs left over; in a block of 16
        off = x.clone()
        off[row, col] = off[row, col] * (1 + 2 ** -12)       # no longer a bfloat16 value
        assert off[row, col].bfloat16().float() != off[row, col]
        reference = off.double() @ w.double().T
        got = cpu.gemv(off, w).double()
        assert float((got - reference).abs().max()) < 1e-5 * float(reference.abs().max()), (row, col)
        # the element's own product, not its rounded one: its row differs from the exact x's by that much
        moved = float((got[row] - (x.double() @ w.double().T)[row]).abs().max())
        assert moved > 0.5 * float((off[row, col] - x[row, col]).abs() * w[:, col].double().abs().max()), (row, col)


def test_the_blocked_bfloat16_products_and_torchs_take_turns_on_the_same_threads():
    """Where the CPU has AMX, the blocked kernel's bfloat16 products and torch's bfloat16 matmul (oneDNN) both run on
    the tiles, each thread under a configuration that the other replaces: each of the blocked kernel's threads loads
    its own before its share of a product and releases the tiles after. Taking turns on the same threads, 96 rows
    (three token tiles) and a last block of W of 8 rows (N = 72), both stay exact to float32 rounding."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(72, 576, generator=g).bfloat16()
    x = torch.randn(96, 576, generator=g).bfloat16()
    reference = x.double() @ w.double().T
    scale = float(reference.abs().max())
    for _ in range(3):
        ours = cpu.gemv(x.float(), w).double()
        assert float((ours - reference).abs().max()) < 1e-5 * scale
        theirs = (x @ w.T).double()                          # oneDNN: bfloat16 products, rounded to bfloat16
        assert float((theirs - reference).abs().max()) < 1e-2 * scale


def test_int4_tiles_round_trip_and_the_layers_keep_their_codes():
    """tile_int4 puts row 8t+j's bytes for inputs 8c..8c+7 at [t, c, 4j:4j+4]; layers tile and read back the same."""
    nibbles = torch.randint(0, 256, (16, 64), dtype=torch.uint8)
    scale, offset = torch.rand(16, 4), torch.randn(16, 4)
    codes, s8, o8 = cpu.tile_int4(nibbles, scale, offset)
    assert tuple(codes.shape) == (2, 16, 32) and tuple(s8.shape) == (2, 4, 8)
    assert torch.equal(codes[1, 3, 8:12], nibbles[10, 12:16]) and float(s8[1, 2, 5]) == float(scale[13, 2])
    assert all(torch.equal(a, b) for a, b in zip(cpu.untile_int4(codes, s8, o8), (nibbles, scale, offset)))
    with pytest.raises(ValueError, match=r"tiles of 8 rows need N a multiple of 8 .* \(12 x 128\) weight"):
        cpu.tile_int4(nibbles[:12], scale[:12], offset[:12])
    torch.manual_seed(0)
    for rows in (64, 36):                                    # 36 rows: not a multiple of 8, kept row-major
        linear = nn.Linear(128, rows)
        layer = QuantizedLinear.from_linear(linear, 4, 32)
        assert layer.kernel == "native" and layer.qweight.dim() == (3 if rows % 8 == 0 else 2)
        reference = QuantizedLinear.from_linear(linear, 4, 32, kernel="dequantize")
        assert torch.equal(layer.codes(), reference.codes())
        assert torch.equal(layer.state()["qweight"], reference.state()["qweight"])
        x = torch.randn(3, 128)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), reference(x), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer(x.repeat(8, 1)), reference(x.repeat(8, 1)), atol=1e-4, rtol=1e-4)


def _offsets(args) -> torch.Tensor:
    """The (N, groups) offsets of an int4 case's kernel arguments, row-major or tiled."""
    if args[0].dim() == 3:
        return cpu.untile_int4(*args[:3])[2]
    return args[2]


def _w4a8_reference(x: torch.Tensor, weight: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """W4A8's product in float64: x's blocks of 32 rounded to int8 (half to even, step max|x|/127) against the
    codes' part of the weight, and the exact x against the offsets' part."""
    rows = x.shape[0]
    blocks = x.view(rows, -1, 32)
    step = blocks.abs().amax(-1, keepdim=True) / 127
    x_rounded = (torch.round(blocks / step) * step).view(rows, -1)
    offsets = offset.double().repeat_interleave(weight.shape[1] // offset.shape[1], 1)
    return x_rounded @ (weight - offsets).T + x @ offsets.T


def test_w4a8_changes_the_numbers_by_the_int8_rounding_of_x_and_no_more():
    """W4A8 equals, to float rounding, the float int4 product with x replaced by its int8 blocks."""
    x, cases = _cases(torch.Generator().manual_seed(3))
    nibbles, scale, offset, group = cases["int4"][0]
    got = cpu.gemv(x, nibbles, scale, offset, group, activations="int8").double()
    # the offset term uses the exact group sums of x, the code term x's int8 blocks
    expected = _w4a8_reference(x.double(), cases["int4"][1], offset)
    assert float((got - expected).abs().max()) < 1e-4 * float(expected.abs().max())
    assert float((got - x.double() @ cases["int4"][1].T).abs().max()) > 1e-5


def test_w4a8_layers_and_their_refusals():
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=False)
    float_layer = QuantizedLinear.from_linear(linear, 4, 32)
    a8 = QuantizedLinear.from_linear(linear, 4, 32, activations="int8")
    assert a8.kernel == "native" and "activations=int8" in repr(a8)
    x = torch.randn(1, 128)
    with torch.no_grad():
        exact, changed = float_layer(x), a8(x)
        error = float((changed - exact).abs().max() / exact.abs().max())
        assert 0 < error < 3e-2
        long_x = torch.randn(20, 128)                  # a prefill takes float activations
        torch.testing.assert_close(a8(long_x), float_layer(long_x), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="activations='int8' \\(W4A8\\) is for int4 weights"):
        QuantizedLinear.from_linear(linear, 8, None, activations="int8")
    with pytest.raises(ValueError, match="activations='int8' \\(W4A8\\) is for int4 weights"):
        QuantizedLinear.from_linear(linear, 4, 32, kernel="dequantize", activations="int8")
    with pytest.raises(ValueError, match="activations='int16' must be one of"):
        quant.quantize(nn.Sequential(nn.Linear(64, 64)), "int4", 32, activations="int16")
    with pytest.raises(ValueError, match="activations='int8' is for int4 weights"):
        cpu.gemv(x, torch.zeros(64, 128, dtype=torch.int8), torch.ones(64), activations="int8")


def test_grouped_int8_layers_run_the_native_kernel():
    """GGUF's Q8_0 (int8 in groups of 32) takes the native kernel, not the dequantize path."""
    codes = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    scales = torch.rand(64, 4)
    layer = QuantizedLinear(128, 64, 8, 32, codes, scales, None)
    assert layer.kernel == "native" and tuple(layer.kernel_scale.shape) == (64, 4)
    x = torch.randn(2, 128)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), x @ layer.dequantized_weight(torch.float32).T, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="scale groups a row do not split"):
        cpu.gemv(x, codes, torch.rand(64, 3))


def test_the_prefill_choice_is_the_faster_median_and_the_blocked_kernel_on_a_tie():
    """First use and benchmark alike: the lower median of whole prefills, with no margin; rows in buckets."""
    assert cpu.PREFILL_PATHS == ("blocked", "torch")
    assert cpu.choose_fastest({"blocked": [3.0, 1.0, 1.1], "torch": [1.2, 1.3, 0.1]}) == "blocked"
    assert cpu.choose_fastest({"blocked": [1.04, 1.04, 0.1], "torch": [1.0, 1.02, 9.0]}) == "torch"
    assert cpu.choose_fastest({"blocked": [1.0], "torch": [1.0]}) == "blocked"
    with pytest.raises(ValueError, match="needs some timings for every candidate"):
        cpu.choose_fastest({"blocked": [1.0], "torch": []})
    assert [cpu.rows_bucket(r) for r in (1, 9, 16, 17, 128, 129, 4000)] == [16, 16, 16, 32, 128, 256, 512]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_the_prefill_probe_runs_the_layers_in_the_format_on_the_path_in_force(monkeypatch, dtype):
    """The first-use probe times what the choice moves: a prefill of a few layers with weights in the format,
    through the modules' products (F.linear over every row) on 'torch', through the native stack on 'blocked'."""
    import torch.nn.functional as F

    assert cpu.available(), cpu.why_unavailable()
    from llminfer import fast

    assert cpu.prefill_probe_name() == cpu.PREFILL_LAYERS_PROBE           # set when llminfer.fast is imported
    run = fast.prefill_probe(dtype, 16)
    seen, linear = [], F.linear

    def spy(x, weight, bias=None):
        seen.append((x.shape[-2] if x.dim() > 1 else 1, weight.dtype))
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", spy)
    with cpu.force_prefill("torch"):
        run()
    products = [entry for entry in seen if entry[0] == 16]
    assert len(products) == 4 * cpu.PREFILL_PROBE_LAYERS            # qkv, o, gate_up and down of every layer
    assert {weight_dtype for _, weight_dtype in products} == {torch.bfloat16 if dtype == torch.bfloat16
                                                               else torch.float32}
    if cpu.isa() != "portable":
        seen.clear()
        with cpu.force_prefill("blocked"):
            run()
        assert all(rows <= 1 for rows, _ in seen), seen              # the stack in one native call
    with pytest.raises(ValueError, match=r"prefills for \[torch.float16\]: the weight dtypes .* float32, bfloat16"):
        fast.prefill_probe(torch.float16, 16)


def test_without_the_stack_the_prefill_probe_is_a_layers_products(monkeypatch):
    """Where llminfer.fast is not imported no stack runs (only quantized layers' products), so the first use times a
    layer's products; setting a probe drops the choices made on another one."""
    import torch.nn.functional as F

    assert cpu.available(), cpu.why_unavailable()
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={"kept": {"probe": cpu.PREFILL_STEP},
                                                                      "other": {"probe": "another probe"}}))
    cpu.set_prefill_probe(None)
    assert cpu.prefill_probe_name() == cpu.PREFILL_PRODUCTS and set(cpu._prefill["choices"]) == {"kept"}
    seen, linear = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append(tuple(x.shape)) or linear(x, w, b))
    timings = cpu.measure_prefill(torch.int8, 16, repeats=1)
    assert sorted(timings) == ["blocked", "torch"] and all(len(t) == 1 for t in timings.values())
    # torch's path: each of the layer's products, in its warm-up turn and its one timed turn
    assert seen == [(16, k) for _, k in cpu.PREFILL_PROBE_SHAPES] * 2


def test_the_prefill_choice_is_measured_once_and_cached(monkeypatch, tmp_path):
    assert cpu.available(), cpu.why_unavailable()          # loaded first: loading sets the build folder patched below
    calls = []

    def fake_measure(dtype, rows, repeats=5):
        calls.append((dtype, rows))
        return {"blocked": [1.0], "torch": [2.0]} if dtype == torch.bfloat16 else {"blocked": [2.0], "torch": [1.0]}

    monkeypatch.setattr(cpu, "measure_prefill", fake_measure)
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    monkeypatch.delenv(cpu.PREFILL_ENV, raising=False)
    vector = cpu.isa() != "portable"
    assert cpu.blocked_prefill(torch.bfloat16, 100) is vector and cpu.blocked_prefill(torch.bfloat16, 128) is vector
    assert cpu.blocked_prefill(torch.float32, 128) is False
    assert calls == ([(torch.bfloat16, 128), (torch.float32, 128)] if vector else [])
    if vector:
        saved = json.loads((tmp_path / "prefill_choices.json").read_text())
        assert sorted(v["path"] for v in saved.values()) == ["blocked", "torch"]
        assert all(key.endswith(("bfloat16|128", "float32|128")) for key in cpu.prefill_choices())
        assert cpu.prefill_choice(torch.bfloat16, 120) == {"path": "blocked", "probe": cpu.prefill_probe_name(),
                                                           "median_s": {"blocked": 1.0, "torch": 2.0}}
        with pytest.raises(ValueError, match=r"prefills for \[torch.float16\]"):
            cpu.prefill_choice(torch.float16, 128)
        with cpu.force_prefill("blocked"):
            assert cpu.blocked_prefill(torch.float32, 128) is True
        monkeypatch.setenv(cpu.PREFILL_ENV, "torch")
        assert cpu.blocked_prefill(torch.bfloat16, 128) is False
        monkeypatch.setenv(cpu.PREFILL_ENV, "fastest")
        with pytest.raises(ValueError, match="LLMINFER_PREFILL='fastest' must be one of"):
            cpu.blocked_prefill(torch.bfloat16, 128)
    with pytest.raises(ValueError, match="path='quick' must be one of"):
        cpu.force_prefill("quick")


def test_a_quantized_stack_takes_the_prefill_path_measured_for_its_own_weights(monkeypatch, tmp_path):
    """The one-call prefill of an int4 stack follows the choice for uint8 weights, not float32's (its activations)."""
    from llminfer import fast, load_random

    assert cpu.available(), cpu.why_unavailable()          # loaded first: loading sets the build folder patched below
    from llminfer.config import ModelConfig

    def fake_measure(dtype, rows, repeats=5):              # float32: torch's matmul; int4 (uint8): the blocked kernel
        return {"blocked": [1.0], "torch": [2.0]} if dtype == torch.uint8 else {"blocked": [2.0], "torch": [1.0]}

    monkeypatch.setattr(cpu, "measure_prefill", fake_measure)
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    monkeypatch.delenv(cpu.PREFILL_ENV, raising=False)
    config = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=64)
    float_model = fast.fuse_projections(load_random(config, seed=0))
    int4_model = fast.fuse_projections(quant.quantize(load_random(config, seed=0), "int4", 32))
    x, cos = torch.zeros(1, 40, 64), torch.zeros(40, 16)
    for model, dtype in ((float_model, torch.float32), (int4_model, torch.uint8)):
        fast.use_native_kernels(model)
        stack = model.layers
        assert isinstance(stack, fast.NativeDecoderStack)
        assert fast._weight_dtype(stack[0], x) == dtype
        vector = cpu.isa() != "portable"
        expected = "prefill" if vector and dtype == torch.uint8 else None
        assert stack._step_fits(x, cos, cpu.attention_backend) == expected, dtype
        assert fast._step_fits(x, cos, cpu.attention_backend) is None          # float32's own choice: torch


def test_an_engine_settles_every_prefill_path_before_its_first_request(monkeypatch, tmp_path):
    """settle_prefill_paths times each rows bucket a step can take, for the stack's own weights, once; an engine
    calls it when it is made, so no request waits on a first-use timing."""
    from llminfer import fast, load_random
    from llminfer.config import ModelConfig
    from llminfer.engine import LLMEngine

    assert cpu.available(), cpu.why_unavailable()
    calls = []

    def fake_measure(dtype, rows, repeats=5):
        calls.append((dtype, rows))
        return {"blocked": [1.0], "torch": [2.0 if rows < 64 else 0.5]}

    monkeypatch.setattr(cpu, "measure_prefill", fake_measure)
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    monkeypatch.delenv(cpu.PREFILL_ENV, raising=False)
    config = ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=128, max_seq_len=64)
    assert fast.settle_prefill_paths(load_random(config, seed=0), 40) == {}            # no native stack: nothing
    model = fast.optimize_decode(quant.quantize(load_random(config, seed=0), "int4", 32))
    if cpu.isa() == "portable":                              # no blocked kernel: nothing to time
        assert fast.settle_prefill_paths(model, 40) == {} or calls == []
        return
    assert fast.settle_prefill_paths(model, 40) == {16: "blocked", 32: "blocked", 64: "torch"}
    assert calls == [(torch.uint8, 16), (torch.uint8, 32), (torch.uint8, 64)]
    assert fast.settle_prefill_paths(model, 2000) == {16: "blocked", 32: "blocked", 64: "torch", 128: "torch",
                                                      256: "torch", 512: "torch"}
    assert len(calls) == 6                                    # the kept ones not again
    calls.clear()
    LLMEngine(load_random(config, seed=0).to(torch.bfloat16), block_size=4, num_blocks=64,
              max_num_batched_tokens=100, max_model_len=64, optimize=True)
    assert calls == [(torch.bfloat16, 16), (torch.bfloat16, 32), (torch.bfloat16, 64), (torch.bfloat16, 128)]


def test_kept_prefill_timings_are_decided_by_the_rule_in_force(monkeypatch, tmp_path):
    """A kept answer's timings are read again, not its path: one kept as 'torch' where the blocked kernel's median
    is lower is the blocked kernel's, without measuring."""
    assert cpu.available(), cpu.why_unavailable()
    if cpu.isa() == "portable":                              # no vector loops: nothing is kept or timed
        return
    monkeypatch.setattr(cpu, "measure_prefill", lambda *args, **kwargs: pytest.fail("measured a kept answer"))
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    monkeypatch.delenv(cpu.PREFILL_ENV, raising=False)
    kept = {cpu._choice_key(torch.bfloat16, 128): {"path": "torch", "probe": cpu.prefill_probe_name(),
                                                    "median_s": {"blocked": 3.9e-3, "torch": 4.0e-3}},
            cpu._choice_key(torch.float32, 128): {"path": "blocked", "probe": cpu.prefill_probe_name(),
                                                   "median_s": {"blocked": 4.0e-3, "torch": 3.0e-3}}}
    (tmp_path / "prefill_choices.json").write_text(json.dumps(kept))
    assert cpu.prefill_path(torch.bfloat16, 128) == "blocked"
    assert cpu.prefill_path(torch.float32, 128) == "torch"


def test_answers_kept_from_another_probe_are_timed_again(monkeypatch, tmp_path):
    """A kept answer names the probe that timed it; one timed on another probe (an earlier version's) is measured
    again, for the prefill and for the decode loops alike."""
    import dataclasses

    assert cpu.available(), cpu.why_unavailable()
    if cpu.isa() == "portable":                              # no vector loops: nothing is ever timed
        assert cpu.matvec_candidates("int8") == () and not cpu.blocked_prefill(torch.float32, 128)
        return
    calls = []
    monkeypatch.setattr(cpu, "measure_prefill", lambda dtype, rows, repeats=5: calls.append(dtype) or
                        {"blocked": [1.0], "torch": [2.0]})
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    monkeypatch.delenv(cpu.PREFILL_ENV, raising=False)
    key = cpu._choice_key(torch.float32, 128)
    stale = {key: {"path": "torch", "probe": "one product 1536x576", "median_s": {"blocked": 2.0, "torch": 1.0}}}
    (tmp_path / "prefill_choices.json").write_text(json.dumps(stale))
    assert cpu.prefill_path(torch.float32, 128) == "blocked" and calls == [torch.float32]
    assert json.loads((tmp_path / "prefill_choices.json").read_text())[key]["probe"] == cpu.prefill_probe_name()
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    assert cpu.prefill_path(torch.float32, 128) == "blocked" and calls == [torch.float32]     # kept: not again

    several = [name for name in cpu.MATVEC_CANDIDATES if len(cpu.matvec_candidates(name)) > 1]
    if not several:
        return
    name = several[0]
    levels = cpu.matvec_candidates(name)
    here = dataclasses.replace(cpu._state["isa"], forced=False)
    kinds = [k for k, _ in cpu.MATVEC_CANDIDATES.values()]
    before, saved_choices = {k: int(torch.ops.llminfer.matvec_features(k)) for k in kinds}, cpu.matvec_choices()
    timed = []
    monkeypatch.setattr(cpu, "measure_matvec", lambda n, lv, repeats=5: timed.append(n) or
                        {level: [1.0 if level == lv[0] else 2.0] for level in lv})
    kept_key = f"{cpu._machine_key(here.level)}|{name}"
    (tmp_path / "matvec_choices.json").write_text(json.dumps({kept_key: {"level": levels[-1], "median_s": {}}}))
    try:
        cpu._choose_matvec(here)
        assert name in timed and cpu.matvec_choices()[name]["level"] == levels[0]
        assert json.loads((tmp_path / "matvec_choices.json").read_text())[kept_key]["probe"] == cpu.MATVEC_PROBE
    finally:
        for k, bits in before.items():                        # every format's loops as they were
            torch.ops.llminfer.set_matvec_features(k, bits)
        cpu._matvec["choices"] = saved_choices


def test_a_prefill_path_timed_on_whole_prefills_is_the_faster_one_and_kept(monkeypatch, tmp_path):
    """remeasure_prefill runs each dtype's prefill forced onto each path in turn and keeps the lower median, with
    no margin (the blocked kernel on a tie); a later process reads the kept answer back by the same rule."""
    assert cpu.available(), cpu.why_unavailable()
    monkeypatch.setattr(cpu, "measure_prefill", lambda *args, **kwargs: pytest.fail("the first-use probe ran"))
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    monkeypatch.delenv(cpu.PREFILL_ENV, raising=False)
    seen = []

    def prefill(blocked_s, torch_s):
        def run():
            path = cpu.prefill_path(torch.float32, 128)          # the path forced while the run is timed
            seen.append(path)
            return blocked_s if path == "blocked" else torch_s
        return run

    with pytest.raises(ValueError, match=r"prefills for \[torch.float16\]: the weight dtypes .* float32, bfloat16"):
        cpu.remeasure_prefill({torch.float16: prefill(1.0, 1.0)}, 128)
    runs = {torch.float32: prefill(1.0, 0.97), torch.bfloat16: prefill(1.0, 1.03), torch.uint8: prefill(1.0, 1.0)}
    if cpu.isa() == "portable":                                  # no blocked kernel: nothing to time
        assert cpu.remeasure_prefill(runs, 100) == {} and seen == []
        return
    choices = cpu.remeasure_prefill(runs, 100, repeats=3)
    assert seen == ["blocked", "torch"] * 4 * 3                  # a warm-up and 3 turns each, taking turns
    assert {key.rsplit("|", 2)[1]: entry["path"] for key, entry in choices.items()} == \
        {"float32": "torch", "bfloat16": "blocked", "uint8": "blocked"}       # 3 % either way decides; a tie: blocked
    assert all(key.endswith("|128") and entry["probe"] == cpu.PREFILL_STEP for key, entry in choices.items())
    assert choices[cpu._choice_key(torch.float32, 128)]["median_s"] == {"blocked": 1.0, "torch": 0.97}
    assert cpu.prefill_path(torch.float32, 128) == "torch" and cpu._prefill["forced"] is None
    # kept: a later process takes the same paths without timing anything
    monkeypatch.setattr(cpu, "_prefill", dict(cpu._prefill, choices={}, forced=None, loaded_from_disk=False))
    assert [cpu.prefill_path(dtype, 120) for dtype in runs] == ["torch", "blocked", "blocked"]
    saved = json.loads((tmp_path / "prefill_choices.json").read_text())
    assert {entry["probe"] for entry in saved.values()} == {cpu.PREFILL_STEP}


def test_measure_prefill_times_both_paths_in_turn():
    timings = cpu.measure_prefill(torch.uint8, 16, repeats=2)
    assert sorted(timings) == ["blocked", "torch"] and all(len(t) == 2 and min(t) > 0 for t in timings.values())


def test_the_decode_loops_choice_is_the_lowest_median_and_the_first_on_a_tie():
    assert cpu.choose_fastest({"avx2": [3.0, 1.0, 1.1], "avx512": [1.2, 1.3, 0.1]}) == "avx2"
    assert cpu.choose_fastest({"avx2": [2.0], "avx512": [1.0], "avx512_bf16": [1.5]}) == "avx512"
    assert cpu.choose_fastest({"avx2": [1.0], "avx512": [1.0]}) == "avx2"
    with pytest.raises(ValueError, match="needs some timings for every candidate"):
        cpu.choose_fastest({"avx2": [1.0], "avx512": []})
    with pytest.raises(ValueError, match="format 'int3' is not one of float32"):
        cpu.matvec_candidates("int3")


def test_each_format_runs_the_decode_loops_measured_fastest_and_a_forced_level_runs_its_own(monkeypatch, tmp_path):
    """With fake timings (float32: the lowest candidate fastest; every other format: the highest), each format's
    loops are set to the winner, the answers kept on disk and read back; a forced level measures nothing."""
    import dataclasses

    assert cpu.available(), cpu.why_unavailable()
    here = cpu._state["isa"]
    kinds = {name: kind for name, (kind, _) in cpu.MATVEC_CANDIDATES.items()}
    saved_bits = {name: int(torch.ops.llminfer.matvec_features(kind)) for name, kind in kinds.items()}
    saved_choices = cpu.matvec_choices()
    calls = []

    def fake_measure(name, levels, repeats=5):
        calls.append(name)
        winner = levels[0] if name == "float32" else levels[-1]
        return {level: [1.0 if level == winner else 2.0] for level in levels}

    monkeypatch.setattr(cpu, "measure_matvec", fake_measure)
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    unforced, forced = dataclasses.replace(here, forced=False), dataclasses.replace(here, forced=True)
    try:
        cpu._choose_matvec(unforced)
        choices = cpu.matvec_choices()
        several = [name for name in kinds if len(cpu.matvec_candidates(name, unforced)) > 1]
        assert calls == several
        for name, kind in kinds.items():
            levels = cpu.matvec_candidates(name, unforced)
            if not levels:                                  # (portable: no vector loops to choose among)
                assert name not in choices
                continue
            expected = levels[0] if name == "float32" else levels[-1]
            assert choices[name]["level"] == expected and choices[name]["measured"] == (name in several)
            assert int(torch.ops.llminfer.matvec_features(kind)) == cpu._level_bits(expected, unforced)
        kept = json.loads((tmp_path / "matvec_choices.json").read_text())
        assert sorted(key.rsplit("|", 1)[1] for key in kept) == sorted(several)
        cpu._choose_matvec(unforced)                        # read back from disk: nothing measured again
        assert calls == several
        cpu._choose_matvec(unforced, fresh=True)            # measured again (what remeasure_matvec does)
        assert calls == several + several
        calls[len(several):] = []
        cpu._choose_matvec(forced)                          # LLMINFER_ISA: every format on the level's own loops
        assert calls == several
        for name, kind in kinds.items():
            assert int(torch.ops.llminfer.matvec_features(kind)) == here.bits
            if cpu.matvec_candidates(name, forced):
                assert cpu.matvec_choices()[name] == {"level": cpu.matvec_candidates(name, forced)[-1],
                                                      "measured": False}
    finally:
        for name, kind in kinds.items():
            torch.ops.llminfer.set_matvec_features(kind, saved_bits[name])
        cpu._matvec["choices"] = saved_choices


def test_measure_matvec_times_every_candidate_in_turn_and_leaves_the_loops_as_they_were():
    assert cpu.available(), cpu.why_unavailable()
    levels = cpu.matvec_candidates("int8")                  # none on a CPU without AVX2: nothing to time
    assert levels == tuple(level for level in ("avx2", "avx512") if level in cpu.isa_features())
    kind = cpu.MATVEC_CANDIDATES["int8"][0]
    before = int(torch.ops.llminfer.matvec_features(kind))
    timings = cpu.measure_matvec("int8", levels, repeats=2)
    assert list(timings) == list(levels) and all(len(t) == 2 and min(t) > 0 for t in timings.values())
    assert int(torch.ops.llminfer.matvec_features(kind)) == before
    with pytest.raises(ValueError, match=r"\['sse9'\] are not levels this process runs int8 loops at"):
        cpu.measure_matvec("int8", ("sse9",))
    with pytest.raises(RuntimeError, match="set_matvec_features: kind 7 is not one of 0..4"):
        torch.ops.llminfer.set_matvec_features(7, 1)


@pytest.mark.parametrize("level", cpu.matvec_candidates("int4") if cpu.available() else ())
def test_each_int4_float_loop_keeps_float32_accuracy_on_hard_activations(level):
    """Every loop for int4 weights with float x, the VNNI one among them (x as three int8 planes per block of 32,
    exact to 2^-23 of the block's largest |x|), against float64: blocks whose inputs span 40 orders of magnitude, a
    zero block, tiny and huge values; and an inf or a NaN in x leaves no output finite."""
    generator = torch.Generator().manual_seed(5)
    n, k, group = 64, 256, 32
    nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // group, generator=generator) + 0.5).half()
    offset = (torch.randn(n, k // group, generator=generator)).half()
    codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(n, k).double()
    weight = (codes.view(n, -1, group) * scale.double()[..., None] + offset.double()[..., None]).view(n, k)
    tiled = cpu.tile_int4(nibbles, scale, offset)
    x = torch.randn(3, k, generator=generator)
    x[0, :32] *= torch.logspace(-20, 20, 32)                 # one block: 40 orders of magnitude
    x[0, 32:64] = 0.0                                        # a zero block
    x[1, 64:96] *= 1e-30                                     # a tiny block, and a huge one
    x[1, 96:128] *= 1e30
    x[2] = torch.randn(k, generator=generator)
    kind = cpu.MATVEC_CANDIDATES["int4"][0]
    before = int(torch.ops.llminfer.matvec_features(kind))
    torch.ops.llminfer.set_matvec_features(kind, cpu._level_bits(level, cpu._state["isa"]))
    try:
        got = cpu.gemv(x, *tiled, group).double()
        special = x[2:].clone().repeat(2, 1)
        special[0, 7], special[1, 200] = float("inf"), float("nan")
        got_special = cpu.gemv(special, *tiled, group)
    finally:
        torch.ops.llminfer.set_matvec_features(kind, before)
    reference = x.double() @ weight.T
    for row in range(3):
        # float32 accuracy: the error within a few roundings of the row's largest product terms
        bound = 1e-6 * float((x[row].double().abs() @ weight.abs().T).max())
        assert float((got[row] - reference[row]).abs().max()) < bound, (level, row)
    # every output reads every input: an inf or a NaN in x leaves no output finite (whether it comes out as inf or
    # NaN depends on the order of the terms, as in any float loop), never a finite value from a clipped block
    assert not bool(torch.isfinite(got_special).any()), level


def test_a_format_can_be_timed_on_its_own_decode_steps(monkeypatch, tmp_path):
    """measure_matvec(run=...) times the run with each candidate's loops set in turn; remeasure_matvec(steps) times
    the formats it is given on their steps (kept with the step's tag, and read back without measuring again), the
    others on the probe; a step for an unknown format is refused."""
    import dataclasses

    assert cpu.available(), cpu.why_unavailable()
    kind = cpu.MATVEC_CANDIDATES["int8"][0]
    levels = cpu.matvec_candidates("int8")
    here = cpu._state["isa"]
    before = int(torch.ops.llminfer.matvec_features(kind))
    seen = []

    def run() -> float:                                     # the last candidate "fastest": the loops it sees decide
        bits = int(torch.ops.llminfer.matvec_features(kind))
        seen.append(bits)
        return 1.0 if bits == cpu._level_bits(levels[-1], here) else 2.0

    timings = cpu.measure_matvec("int8", levels, repeats=2, run=run)
    assert {level: t for level, t in timings.items()} == {level: [1.0 if level == levels[-1] else 2.0] * 2
                                                          for level in levels}
    assert sorted(set(seen)) == sorted(cpu._level_bits(level, here) for level in levels)
    assert int(torch.ops.llminfer.matvec_features(kind)) == before
    with pytest.raises(ValueError, match=r"steps for \['int3'\]: formats are float32"):
        cpu.remeasure_matvec({"int3": run})
    # a decode step timed while the choice holds the kernels' lock loads them and asks for the prefill path: the
    # lock is re-entered, not waited on forever (a daemon thread, so that a deadlock fails the test)
    import threading

    done = threading.Event()

    def under_the_lock():
        with cpu._lock:
            cpu.load()
            cpu.prefill_path(torch.float32, 16)
            done.set()

    threading.Thread(target=under_the_lock, daemon=True).start()
    assert done.wait(60), "a step timed under the kernels' lock deadlocked"

    kinds = {name: k for name, (k, _) in cpu.MATVEC_CANDIDATES.items()}
    saved_bits = {name: int(torch.ops.llminfer.matvec_features(k)) for name, k in kinds.items()}
    saved_choices = cpu.matvec_choices()
    calls = []

    def fake_measure(name, levels, repeats=5, run=None):
        calls.append((name, run is not None))
        return {level: [1.0 if level == levels[-1] else 2.0] for level in levels}

    monkeypatch.setattr(cpu, "measure_matvec", fake_measure)
    monkeypatch.setitem(cpu._state, "build", str(tmp_path))
    unforced = dataclasses.replace(here, forced=False)
    several = [name for name in kinds if len(cpu.matvec_candidates(name, unforced)) > 1]
    try:
        cpu._choose_matvec(unforced, fresh=True, steps={"int8": run})
        assert calls == [(name, name == "int8") for name in several]
        kept = json.loads((tmp_path / "matvec_choices.json").read_text()) if several else {}
        assert sorted(key.rsplit("|", 1)[1] for key in kept) == sorted(several)
        for key, answer in kept.items():
            assert answer["probe"] == (cpu.MATVEC_STEP if key.endswith("|int8") else cpu.MATVEC_PROBE), key
        calls.clear()
        cpu._choose_matvec(unforced)                         # both kinds of answer are read back as they are
        assert calls == []
        assert all(cpu.matvec_choices()[name]["level"] == cpu.matvec_candidates(name, unforced)[-1]
                   for name in several)
    finally:
        for name, k in kinds.items():
            torch.ops.llminfer.set_matvec_features(k, saved_bits[name])
        cpu._matvec["choices"] = saved_choices
