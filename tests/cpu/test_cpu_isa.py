"""The kernels' instruction-set dispatch (llminfer.cpu.choose_isa) and its static table of decode loops against the
benchmark records, every level this CPU runs against a float64 reference, the W4A8 and grouped-int8 paths, and the
prefill path. Appendix A1."""
from __future__ import annotations

import json
import math
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
    "intel_xeon_amx": ["portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"],
    "amd_zen5_avx512_bf16_avx_vnni": ["portable", "avx2", "avx512", "avx512_vnni", "avx512_bf16"],
}


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_every_level_at_or_below_the_cpu_is_taken_and_every_level_above_is_refused(name, monkeypatch):
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
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
    amx = _fixture("intel_xeon_amx")
    assert amx.isa_level == "amx"
    default = cpu.choose_isa(amx)
    assert (default.level, default.forced) == ("amx", False)
    assert default.bits == 1 + 2 + 4 + 8 + 32
    assert cpu.choose_isa(amx, "avx512_bf16").bits == 1 + 2 + 4 + 8       # the tiles off, for comparisons
    # AMX tiles without their bfloat16 instructions run the level below
    no_bf16 = parse_cpuinfo((FIXTURES / "intel_xeon_amx.txt").read_text().replace(" amx_bf16", ""))
    assert cpu.choose_isa(no_bf16).level == "avx512_bf16"
    with pytest.raises(ValueError, match=r"LLMINFER_ISA='sse9' is not a level .*known levels are portable"):
        cpu.choose_isa(amx, "sse9")
    monkeypatch.setenv(cpu.ISA_ENV, "AVX2")                            # the environment, any case
    assert cpu.choose_isa(amx).level == "avx2" and cpu.choose_isa(amx).features == ("avx2",)
    monkeypatch.setenv(cpu.ISA_ENV, "portable")
    assert cpu.choose_isa(amx).level == "portable" and cpu.choose_isa(amx).bits == 0


def test_isa_reports_what_runs_here():
    assert cpu.available(), cpu.why_unavailable()
    here = cpu.choose_isa(cpu_capabilities())
    assert cpu.isa() == here.level and cpu.isa_features() == here.features
    assert int(torch.ops.llminfer.cpu_features()) == here.bits
    # each format's decode loops run the bits of the level the table names (and of every lower level it runs)
    assert cpu.decode_loops() == dict(here.decode)
    for kind, (name, level) in enumerate(here.decode):
        assert name == cpu.DECODE_FORMATS[kind]
        assert int(torch.ops.llminfer.matvec_features(kind)) == here.level_bits(level), name
    with pytest.raises(RuntimeError, match="matvec_features: kind 7 is not one of 0..4"):
        torch.ops.llminfer.matvec_features(7)


# fixture -> the decode loops the table gives it (a format: the level whose loops run)
EXPECTED_LOOPS = {
    "arm_neoverse": ("", dict.fromkeys(cpu.DECODE_FORMATS, "portable")),
    "amd_epyc_avx2": ("AVX2", dict.fromkeys(cpu.DECODE_FORMATS, "avx2")),
    "amd_zen4_avx512_bf16": ("AMD Zen 4, AVX-512", {"float32": "avx2", "bfloat16": "avx2", "int8": "avx512",
                                                    "int4": "avx512", "int4a8": "avx2"}),
    "amd_zen5_avx512_bf16_avx_vnni": ("AMD Zen 5, AVX-512", {"float32": "avx2", "bfloat16": "avx512", "int8": "avx2",
                                                             "int4": "avx512", "int4a8": "avx2"}),
    "intel_xeon_amx": ("Intel Xeon, AVX-512", {"float32": "avx512", "bfloat16": "avx512_bf16", "int8": "avx512",
                                               "int4": "avx512_vnni", "int4a8": "avx512_vnni"}),
    "intel_xeon_avx512_bf16_vnni": ("Intel Xeon, AVX-512", {"float32": "avx512", "bfloat16": "avx512_bf16",
                                                            "int8": "avx512", "int4": "avx512_vnni",
                                                            "int4a8": "avx512_vnni"}),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_LOOPS))
def test_each_cpu_class_takes_the_decode_loops_of_its_row_and_a_forced_level_its_own(name, monkeypatch):
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    caps = _fixture(name)
    cpu_class, loops = EXPECTED_LOOPS[name]
    choice = cpu.choose_isa(caps)
    assert (choice.cpu_class, dict(choice.decode)) == (cpu_class, loops)
    assert all(level in choice.features for level in loops.values() if level != "portable")
    for level in RUNNABLE[name]:                     # forced: every format runs that level's widest loops
        forced = cpu.choose_isa(caps, level)
        assert forced.cpu_class == "" and dict(forced.decode) == dict.fromkeys(cpu.DECODE_FORMATS, level)
    # the bits a format's loops run: its level's and every lower level's this CPU has, never a higher one's
    if name == "intel_xeon_amx":
        assert choice.level_bits("avx2") == 1 and choice.level_bits("avx512") == 1 + 2
        assert choice.level_bits("avx512_vnni") == 1 + 2 + 4


_RECORDS = Path(__file__).parents[2] / "data" / "benchmarks"


@pytest.mark.parametrize("row", range(len(cpu.DECODE_LOOPS)))
def test_the_table_names_for_each_format_the_loops_that_won_its_record(row):
    """Each row's level for a format is the lowest median of that format's decode steps by level in the class's
    benchmark record (the row's comment names the file); the AVX2 class has one level and no timing to read."""
    cpu_class, _, _, loops = cpu.DECODE_LOOPS[row]
    record = {"Intel Xeon, AVX-512": "decode-cpu-intel-xeon-avx512-amx.json",
              "AMD Zen 5, AVX-512": "decode-cpu-amd-epyc-zen5-avx512.json",
              "AMD Zen 4, AVX-512": "decode-cpu-amd-epyc-zen4-avx512.json",
              "AVX2": "decode-cpu-amd-epyc.json"}[cpu_class]
    report = json.loads((_RECORDS / record).read_text())
    assert set(loops) == set(cpu.DECODE_FORMATS) and set(loops.values()) <= set(cpu.KERNEL_LEVELS)
    timed = report["kernels"].get("matvec", {})
    if not timed:
        assert report["kernels"]["isa"] == "avx2" and set(loops.values()) == {"avx2"}
        return
    for name, level in loops.items():
        medians = {lv: s for lv, s in timed[name]["median_s"].items() if lv in cpu.KERNEL_LEVELS}
        assert level == min(medians, key=medians.get), (cpu_class, name, medians)


def test_every_record_ran_every_formats_prefill_faster_on_the_blocked_kernel():
    """The prefill path's rule (the blocked kernel wherever the vector loops run) against every CPU class's record."""
    records = sorted(_RECORDS.glob("decode-cpu-*.json"))
    assert len(records) >= 4
    for path in records:
        for name, entry in json.loads(path.read_text())["prefill"]["by_precision"].items():
            assert entry["blocked_s"] < entry["torch_s"], (path.name, name)


def test_the_prefill_path_is_the_blocked_kernel_unless_forced_and_nothing_is_kept(monkeypatch):
    assert cpu.available(), cpu.why_unavailable()
    monkeypatch.delenv(cpu.PREFILL_ENV, raising=False)
    vector = cpu.isa() != "portable"
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.uint8):
        assert cpu.prefill_path(dtype, 128) == ("blocked" if vector else "torch")
        with cpu.force_prefill("torch"):
            assert cpu.prefill_path(dtype, 128) == "torch" and not cpu.blocked_prefill(dtype, 128)
    monkeypatch.setenv(cpu.PREFILL_ENV, "torch")
    assert cpu.prefill_path(torch.float32, 64) == "torch"
    monkeypatch.setenv(cpu.PREFILL_ENV, "fast")
    with pytest.raises(ValueError, match=r"LLMINFER_PREFILL='fast' must be one of \('blocked', 'torch'\)"):
        cpu.prefill_path(torch.float32, 64)
    with pytest.raises(ValueError, match=r"path='fast' must be one of"), cpu.force_prefill("fast"):
        pass
    # nothing measured is kept next to the build
    assert not list(Path(cpu._state["build"]).glob("*.json"))


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
    # 37 rows: tiles of 8 rows padded with 3 rows of zeros (their outputs are cut off)
    int4 = (codes.double().view(n, k // 64, 64) * scale.double()[..., None] + offset.double()[..., None]).view(n, k)
    int4 = torch.cat([int4, int4.new_zeros(3, k)])
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
        "int4": ((*cpu.tile_int4(nibbles, scale, offset), 64), int4),
        "int4_tiled": ((*tiled, 32), int4_tiled),
        "int4_tiled16": ((*tiled16, 32), int4_tiled16),
    }
    return x, cases


_RUN_LEVEL = textwrap.dedent("""
    import json, sys, torch
    from llminfer import cpu
    sys.path.insert(0, sys.argv[2])
    from test_cpu_isa import _attention_cases, _cases, _hard_int4_case
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
    hard_x, (hard_args, _) = _hard_int4_case()
    out["int4_hard"] = cpu.gemv(hard_x, *hard_args).tolist()
    special = hard_x[2:].clone().repeat(2, 1)
    special[0, 7], special[1, 200] = float("inf"), float("nan")
    out["int4_special"] = [[str(v) for v in row] for row in cpu.gemv(special, *hard_args).tolist()]
    out["decode_loops"] = cpu.decode_loops()
    print(json.dumps(out))
""")


def _hard_int4_case():
    """x (3, 256) whose blocks of 32 span 40 orders of magnitude, or are zero, tiny or huge, and int4 tiles with
    float16 terms: (x, (gemv's arguments after x, float64 weight))."""
    generator = torch.Generator().manual_seed(5)
    n, k, group = 64, 256, 32
    nibbles = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=generator)
    scale = (torch.rand(n, k // group, generator=generator) + 0.5).half()
    offset = (torch.randn(n, k // group, generator=generator)).half()
    codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).reshape(n, k).double()
    weight = (codes.view(n, -1, group) * scale.double()[..., None] + offset.double()[..., None]).view(n, k)
    x = torch.randn(3, k, generator=generator)
    x[0, :32] *= torch.logspace(-20, 20, 32)                 # one block: 40 orders of magnitude
    x[0, 32:64] = 0.0                                        # a zero block
    x[1, 64:96] *= 1e-30                                     # a tiny block, and a huge one
    x[1, 96:128] *= 1e30
    return x, ((*cpu.tile_int4(nibbles, scale, offset), group), weight)


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


@pytest.mark.parametrize("level", list(cpu.KERNEL_LEVELS))
def test_every_level_this_cpu_runs_matches_the_float64_reference(level):
    """Each path runs in its own process (the level is chosen once per process) under LLMINFER_ISA=level."""
    flags = cpu_capabilities().flags
    if not cpu._level_runs(level, flags):
        pytest.skip(f"this CPU cannot run the {level} level (its loops are compiled, not run, here)")
    env = dict(os.environ, LLMINFER_ISA=level)
    done = subprocess.run([sys.executable, "-c", _RUN_LEVEL, "-", str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["isa"] == level
    assert there["decode_loops"] == dict.fromkeys(cpu.DECODE_FORMATS, level)   # a forced level runs its own loops
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
        # float16 terms give what float32 ones of the same values give (the same loops, the terms widened)
        tiled16 = torch.tensor(there[f"w4a8/int4_tiled16/{rows}"], dtype=torch.float64)
        codes, scale, offset = cases["int4_tiled16"][0][:3]
        as32 = cpu.gemv(x.repeat(24, 1)[:rows], codes, scale.float(), offset.float(), 32, activations="int8").double()
        assert float((tiled16 - as32).abs().max()) < 1e-5 * float(as32.abs().max()), (level, rows)
    # int4 with float x on hard activations (the VNNI loop reads x as three int8 planes of each block of 32)
    hard_x, (hard_args, hard_weight) = _hard_int4_case()
    reference = hard_x.double() @ hard_weight.T
    got = torch.tensor(there["int4_hard"], dtype=torch.float64)
    for row in range(3):
        # float32 accuracy: the error within a few roundings of the row's largest product terms
        bound = 1e-6 * float((hard_x[row].double().abs() @ hard_weight.abs().T).max())
        assert float((got[row] - reference[row]).abs().max()) < bound, (level, row)
    # every output reads every input: an inf or a NaN in x leaves no output finite, never a finite value from a
    # clipped block
    assert not any(math.isfinite(float(v)) for row in there["int4_special"] for v in row), level
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
    # N not a multiple of 8: padded with rows of zero codes and terms, which untile_int4 gives back
    codes12, s12, o12 = cpu.tile_int4(nibbles[:12], scale[:12], offset[:12])
    assert tuple(codes12.shape) == (2, 16, 32) and torch.equal(codes12[0], codes[0])
    back = cpu.untile_int4(codes12, s12, o12)
    assert torch.equal(back[0][:12], nibbles[:12]) and not back[0][12:].any() and not back[1][12:].any()
    with pytest.raises(ValueError, match=r"tiles of 8 rows need K a multiple of 8, got a \(16 x 4\) weight"):
        cpu.tile_int4(nibbles[:, :2], scale, offset)
    torch.manual_seed(0)
    for rows in (64, 36):                                    # 36 rows: padded to 40, the last 4 outputs cut off
        linear = nn.Linear(128, rows)
        layer = QuantizedLinear.from_linear(linear, 4, 32)
        assert layer.kernel == "native" and layer.qweight.dim() == 3
        reference = QuantizedLinear.from_linear(linear, 4, 32, kernel="dequantize")
        assert torch.equal(layer.codes(), reference.codes())
        assert torch.equal(layer.state()["qweight"], reference.state()["qweight"])
        x = torch.randn(3, 128)
        with torch.no_grad():
            torch.testing.assert_close(layer(x), reference(x), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer(x.repeat(8, 1)), reference(x.repeat(8, 1)), atol=1e-4, rtol=1e-4)


def _offsets(args) -> torch.Tensor:
    """The (N, groups) offsets of an int4 case's kernel arguments (tiles of 8 rows)."""
    return cpu.untile_int4(*args[:3])[2]


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
    got = cpu.gemv(x, *cases["int4"][0], activations="int8").double()
    # the offset term uses the exact group sums of x, the code term x's int8 blocks
    expected = _w4a8_reference(x.double(), cases["int4"][1], _offsets(cases["int4"][0]))
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


