"""The native CPU matrix-vector kernels (llminfer.cpu) against plain float matmuls, and the module
transform that puts them under a model (llminfer.fast.use_native_kernels)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import llminfer
from llminfer import fast
from llminfer.device import cpu_capabilities
from llminfer import cpu
from llminfer.quant.linear import QuantizedLinear

from small_models import SMALL_CONFIGS, random_model



def test_the_kernels_build_here():
    """`make test` needs a C++ compiler (g++ or clang): the fast decode path is built from source."""
    assert cpu.available(), f"the native CPU kernels did not build: {cpu.why_unavailable()}"
    assert cpu.isa() in cpu.KERNEL_LEVELS


def _int4_case(n: int, k: int, group: int, generator):
    """int4 codes of an (n, k) weight as row-major nibbles, their tiles of 8 rows (N padded to a multiple of 8:
    `tile_int4`), and the float weight they stand for."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=generator)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
    scale = torch.rand(n, k // group, generator=generator) * 0.1
    offset = torch.randn(n, k // group, generator=generator) * 0.1
    weight = (codes.float().view(n, k // group, group) * scale[..., None] + offset[..., None]).view(n, k)
    return packed, cpu.tile_int4(packed, scale, offset), weight


# shapes with odd row counts (the 4-row blocks' tail) and, for the dense formats, K off the 16-wide step
# the last eight: a prefill's many rows, which float32 weights multiply by the blocked kernel (tiles of 16 or 32 rows
# of x and 6 of W, inputs in equal chunks of at most 1024, 2048 for bfloat16 x, fewer the more rows), with every
# edge: 37 and 29 rows, 13 outputs, 700 inputs; 1100 inputs in two chunks (one for bfloat16 x), and 300 rows whose
# 700 inputs take three (two for bfloat16 x); then outputs past the chunks' budget, so the tokens go in groups: 300
# rows in three (128, 128, 44; with bfloat16 x and weights 160 and 140), each taking its 700 inputs at once, and 520
# rows of 1536 inputs in nine groups of up to 64 (five of up to 128), each in two chunks again (one)
DENSE_SHAPES = [(1, 960, 576), (3, 13, 64), (8, 7, 40), (2, 1, 17), (37, 13, 700), (29, 12, 520), (128, 96, 576),
                (16, 6, 3), (37, 13, 1100), (300, 7, 700), (300, 400, 700), (520, 200, 1536)]


@pytest.mark.parametrize("tokens,n,k", DENSE_SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_dense_kernels_match_a_float64_reference(tokens, n, k, x_dtype):
    g = torch.Generator().manual_seed(n * k + tokens)
    x = torch.randn(tokens, k, generator=g).to(x_dtype)
    w = torch.randn(n, k, generator=g)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) * 0.01
    cases = {"f32": (cpu.gemv(x, w), w.double()),
             "bf16": (cpu.gemv(x, w.bfloat16()), w.bfloat16().double()),
             "int8": (cpu.gemv(x, q, s), q.double() * s.double()[:, None])}
    for name, (got, weight) in cases.items():
        reference = x.double() @ weight.T
        assert got.shape == (tokens, n) and got.dtype == x_dtype, name
        # float32 accumulation; a bfloat16 result is rounded once more (8 bits of mantissa)
        tolerance = 2e-5 * (k ** 0.5) * float(reference.abs().max()) if x_dtype == torch.float32 else \
            float(reference.abs().max()) / 128
        assert float((got.double() - reference).abs().max()) <= tolerance + 1e-6, name


# the last five: many rows (a prefill), the blocked kernel widening blocks of 6 rows; 1088 inputs cross a chunk in
# the middle of a group of 64, 300 rows take 1024 inputs in four chunks, and with 400 outputs in five groups of
# tokens (64 a group, the last 44) of 1024 inputs each
@pytest.mark.parametrize("tokens,n,k,group", [(1, 96, 128, 32), (3, 13, 576, 64), (8, 5, 256, 256), (2, 9, 96, 96),
                                             (37, 13, 1088, 64), (16, 6, 96, 32), (29, 20, 576, 576),
                                             (300, 7, 1024, 128), (300, 400, 1024, 128)])
def test_int4_kernel_matches_a_float64_reference(tokens, n, k, group):
    g = torch.Generator().manual_seed(k + n)
    packed, tiles, weight = _int4_case(n, k, group, g)
    x = torch.randn(tokens, k, generator=g)
    got = cpu.gemv(x, *tiles, group)
    reference = x.double() @ weight.double().T
    assert got.shape == (tokens, -(-n // 8) * 8)                 # N padded to whole tiles: those outputs are 0
    assert not got[:, n:].any()
    got = got[:, :n]
    assert float((got.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max()) + 1e-5
    # a wrong nibble order would move it far: swapping the halves of every byte is caught
    swapped = cpu.tile_int4(((packed >> 4) | (packed << 4)).contiguous(), *(t[:n] for t in cpu.untile_int4(*tiles)[1:]))[0]
    assert float((cpu.gemv(x, swapped, *tiles[1:], group)[:, :n].double() - reference).abs().max()) > \
        1e-2 * float(reference.abs().max())


def test_the_portable_loops_give_the_same_numbers_as_the_vector_ones():
    """LLMINFER_ISA=portable runs the loops other CPUs (ARM) get; they must agree."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g)
    w = torch.randn(37, 576, generator=g)
    q = torch.randint(-127, 128, (37, 576), dtype=torch.int8, generator=g)
    s = torch.rand(37, generator=g)
    _, (packed, scale, offset), _ = _int4_case(37, 576, 64, g)
    here = {"f32": cpu.gemv(x, w), "bf16": cpu.gemv(x, w.bfloat16()), "int8": cpu.gemv(x, q, s),
            "int4": cpu.gemv(x, packed, scale, offset, 64)}
    script = textwrap.dedent("""
        import json, sys, torch
        from llminfer import cpu
        x, w, q, s, packed, scale, offset = torch.load(sys.argv[1])
        out = {"isa": cpu.isa(), "f32": cpu.gemv(x, w).tolist(), "bf16": cpu.gemv(x, w.bfloat16()).tolist(),
               "int8": cpu.gemv(x, q, s).tolist(), "int4": cpu.gemv(x, packed, scale, offset, 64).tolist()}
        print(json.dumps(out))
    """)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.pt")
        torch.save((x, w, q, s, packed, scale, offset), path)
        env = dict(os.environ, LLMINFER_ISA="portable")
        done = subprocess.run([sys.executable, "-c", script, path], env=env, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr
    there = json.loads(done.stdout.strip().splitlines()[-1])
    assert there["isa"] == "portable"
    for name, value in here.items():
        torch.testing.assert_close(torch.tensor(there[name]), value, atol=1e-3, rtol=1e-4, msg=name)


def test_bad_inputs_are_refused_with_the_sizes_named():
    w = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match=r"x has 32 inputs, the weight 64"):
        cpu.gemv(torch.randn(1, 32), w)
    with pytest.raises(RuntimeError, match=r"x must be float32 or bfloat16"):
        cpu.gemv(torch.randn(1, 64).half(), w)
    with pytest.raises(RuntimeError, match=r"contiguous \(N, K\)"):
        cpu.gemv(torch.randn(1, 8), w.t())
    with pytest.raises(RuntimeError, match=r"one entry per output row \(8\)"):
        cpu.gemv(torch.randn(1, 64), torch.zeros(8, 64, dtype=torch.int8), torch.ones(7))
    packed = torch.zeros(8, 48, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"int4 weights are read in tiles of 8 rows, got nibbles of shape \(8, 48\); "
                                         r"pass tile_int4"):
        cpu.gemv(torch.randn(1, 96), packed, torch.ones(8, 2), torch.ones(8, 2), 48)
    with pytest.raises(RuntimeError, match=r"group 48 must be a multiple of 32 that divides 96"):
        cpu.gemv(torch.randn(1, 96), *cpu.tile_int4(packed, torch.ones(8, 2), torch.ones(8, 2)), 48)
    with pytest.raises(RuntimeError, match=r"scale and offset must be contiguous \(1, 3, 8\)"):
        cpu.gemv(torch.randn(1, 96), cpu.tile_int4(packed, torch.ones(8, 2), torch.ones(8, 2))[0],
                 torch.ones(1, 2, 8), torch.ones(1, 2, 8), 32)
    with pytest.raises(ValueError, match=r"no native kernel for torch.float16 weights"):
        cpu.gemv(torch.randn(1, 64), w.half())


def test_the_ops_trace_under_torch_compile():
    w = torch.randn(40, 64)
    x = torch.randn(1, 64)
    compiled = torch.compile(lambda a: torch.relu(cpu.gemv(a, w)) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), torch.relu(x @ w.T) * 2, atol=1e-5, rtol=1e-5)


# --- under a model -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen2-bias-gqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_model_decodes_the_same_tokens(name, dtype):
    model = random_model(SMALL_CONFIGS[name]).to(dtype)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    expected_logits = model(ids)
    expected = llminfer.generate(model, ids, max_new_tokens=10)
    keys = list(model.state_dict())
    tied = model.lm_head.weight is model.embed_tokens.weight
    fast.use_native_kernels(model)
    assert fast.uses_native_kernels(model)
    assert all(type(m) is not nn.Linear for m in model.modules())
    assert list(model.state_dict()) == keys                       # same names: checkpoints are unchanged
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(model(ids), expected_logits, atol=tolerance, rtol=tolerance)   # prefill: F.linear
    got = llminfer.generate(model, ids, max_new_tokens=10)                                    # decode: native
    if dtype == torch.float32:
        assert got.token_ids == expected.token_ids
    # one decode step, native against F.linear
    cache = model.new_cache(1, 16)
    with torch.inference_mode():
        model(ids, cache=cache)
        step = model(ids[:, -1:], cache=cache)
    cache = model.new_cache(1, 16)
    reference_model = random_model(SMALL_CONFIGS[name]).to(dtype)
    with torch.inference_mode():
        reference_model(ids, cache=cache)
        reference = reference_model(ids[:, -1:], cache=cache)
    torch.testing.assert_close(step, reference, atol=tolerance, rtol=tolerance)


def test_native_linear_leaves_autograd_to_torch_and_takes_a_prefill_where_it_can(monkeypatch):
    layer = fast.use_native_kernels(nn.Linear(64, 24))  # a bare module is a model too: its replacement comes back
    assert type(layer) is fast.NativeLinear
    calls = []
    real = cpu.gemv
    monkeypatch.setattr(cpu, "gemv", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()                           # autograd: F.linear, which has a backward
    assert x.grad is not None and calls == []
    with torch.no_grad():
        x20 = torch.randn(1, 20, 64)                    # 20 tokens: a prefill, the blocked kernel where it runs
        torch.testing.assert_close(layer(x20), F.linear(x20, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
        assert calls == ([(20, 64)] if cpu.blocked_prefill() else [])
        y = layer(torch.randn(1, 3, 64))
    assert calls[-1] == (3, 64) and y.shape == (1, 3, 24)
    monkeypatch.setattr(cpu, "blocked_prefill", lambda *_: False)       # a CPU without AVX2: torch's matmul
    calls.clear()
    with torch.no_grad():
        layer(x20)
    assert calls == []


def test_fused_quantized_model_runs_the_native_kernels_in_the_compiled_step():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    reference = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    llminfer.quant.quantize(model, "int8")
    llminfer.quant.quantize(reference, "int8", kernel="dequantize")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    decoder = fast.compile_decode(model, max_seq_len=32, backend="eager")
    assert fast.uses_native_kernels(model)
    assert {m.kernel for m in llminfer.quant.quantized_modules(model).values()} == {"native"}
    got = decoder.generate(ids, max_new_tokens=8).token_ids
    assert got == llminfer.generate(reference, ids, max_new_tokens=8).token_ids


def test_without_the_kernels_the_model_keeps_torchs(monkeypatch):
    monkeypatch.setattr(cpu, "available", lambda: False)
    monkeypatch.setattr(cpu, "why_unavailable", lambda: "turned off by LLMINFER_NATIVE_KERNELS=0")
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    assert fast.use_native_kernels(model) is model and not fast.uses_native_kernels(model)
    with pytest.raises(RuntimeError, match=r"unavailable \(turned off by LLMINFER_NATIVE_KERNELS=0\).*strict=False"):
        fast.use_native_kernels(model, strict=True)


def test_turned_off_by_the_environment():
    script = "from llminfer import cpu; print(cpu.available(), cpu.why_unavailable(), cpu.isa())"
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, LLMINFER_NATIVE_KERNELS="0"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "turned", "off", "by", "LLMINFER_NATIVE_KERNELS=0", "unavailable"]


# --- decode attention ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch,heads,kv_heads,t_q,t_k,head_dim", [(1, 9, 3, 1, 200, 64), (2, 4, 2, 3, 17, 8),
                                                                   (1, 2, 2, 2, 5, 12)])
def test_decode_attention_matches_the_explicit_attention(dtype, batch, heads, kv_heads, t_q, t_k, head_dim):
    from llminfer.attention import attention
    g = torch.Generator().manual_seed(t_k)
    q = torch.randn(batch, heads, t_q, head_dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, t_k, head_dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, t_k, head_dim, generator=g).to(dtype)
    mask = torch.rand(batch, 1, t_q, t_k, generator=g) > 0.4
    mask[..., 0] = True
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for kwargs, reference in (({"mask": mask}, attention(q.float(), k.float(), v.float(), mask=mask)[0]),
                              ({}, attention(q.float(), k.float(), v.float(), causal=True)[0]),
                              ({"scale": 0.3}, attention(q.float(), k.float(), v.float(), causal=True, scale=0.3)[0])):
        got = cpu.decode_attention(q, k, v, **kwargs)
        assert got.shape == q.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), reference, atol=tolerance, rtol=tolerance)
    # strided inputs (q as a view of a wider tensor) are read as they are
    wide = torch.randn(batch, heads, t_q, head_dim * 2, generator=g).to(dtype)
    view = wide[..., :head_dim]
    torch.testing.assert_close(cpu.decode_attention(view, k, v).float(),
                               attention(view.float(), k.float(), v.float(), causal=True)[0],
                               atol=tolerance, rtol=tolerance)


def test_decode_attention_with_nothing_visible_gives_nan_and_bad_shapes_are_refused():
    q, k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    hidden = torch.zeros(1, 1, 1, 4, dtype=torch.bool)
    assert torch.isnan(cpu.decode_attention(q, k, v, hidden)).all()       # as softmax over nothing
    with pytest.raises(RuntimeError, match=r"H a multiple of H_kv"):
        cpu.decode_attention(torch.randn(1, 3, 1, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))
    with pytest.raises(RuntimeError, match=r"one dtype, float32 or bfloat16"):
        cpu.decode_attention(q.double(), k.double(), v.double())
    with pytest.raises(RuntimeError, match=r"boolean"):
        cpu.decode_attention(q, k, v, hidden.float())


def test_the_native_backend_sends_long_inputs_to_sdpa(monkeypatch):
    from llminfer.attention import get_backend
    backend = get_backend("native")
    calls = []
    real = cpu.decode_attention
    monkeypatch.setattr(cpu, "decode_attention", lambda *a, **k: calls.append(a[0].shape[-2]) or real(*a, **k))
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    full = backend(q, k, v, causal=True)                          # a prefill: sdpa
    step = backend(q[:, :, -1:], k, v, causal=True)               # a decode step: the kernel
    assert calls == [1]
    torch.testing.assert_close(step, full[:, :, -1:], atol=1e-5, rtol=1e-5)


# --- generate runs the compiled step it is handed ----------------------------------------------------------

def test_generate_runs_the_compiled_step_it_is_passed_and_nothing_else(monkeypatch):
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    reference = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    decoder = fast.compile_decode(model, max_seq_len=24, backend="eager")
    assert model.attn_backend == "native" and not hasattr(model, "compiled_decoder")   # no hook on the model
    steps = []
    real = decoder.decode
    monkeypatch.setattr(decoder, "decode", lambda token: steps.append(1) or real(token))
    expected = llminfer.generate(reference, ids, max_new_tokens=9)
    got = llminfer.generate(model, ids, max_new_tokens=9, step=decoder)
    assert got.token_ids == expected.token_ids and len(steps) == 8 and got.num_prompt_tokens == 7
    # EOS ends the row there, as in the eager loop
    eos = expected.token_ids[3]
    assert llminfer.generate(model, ids, max_new_tokens=9, eos_token_id=eos, step=decoder).token_ids == \
        llminfer.generate(reference, ids, max_new_tokens=9, eos_token_id=eos).token_ids
    # without step= the model's eager forward runs: the transform left no hook behind
    steps.clear()
    assert llminfer.generate(model, ids, max_new_tokens=20).token_ids == \
        llminfer.generate(reference, ids, max_new_tokens=20).token_ids and steps == []
    # a request that does not fit the decoder is refused before any compute, not run some other way
    with pytest.raises(ValueError, match=r"need 26 cache positions, the decoder's cache holds 24"):
        llminfer.generate(model, ids, max_new_tokens=20, step=decoder)
    with pytest.raises(ValueError, match="not of this model"):
        llminfer.generate(reference, ids, max_new_tokens=4, step=decoder)
    assert steps == []


def test_two_compiled_decoders_keep_their_own_models():
    """The compiled step has no guards on the model's modules; each decoder must still run its own model."""
    first = random_model(SMALL_CONFIGS["llama-gqa-tied"], seed=0)
    second = random_model(SMALL_CONFIGS["llama-gqa-tied"], seed=5)
    ids = torch.randint(0, first.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(6))
    expected = [llminfer.generate(m, ids, max_new_tokens=6).token_ids for m in (first, second)]
    assert expected[0] != expected[1]
    decoders = [fast.compile_decode(m, max_seq_len=16) for m in (first, second)]
    assert [d.generate(ids, 6).token_ids for d in decoders] == expected
    assert [d.generate(ids, 6).token_ids for d in reversed(decoders)] == expected[::-1]


def test_a_venvs_own_ninja_is_found_without_activating_it(monkeypatch):
    import shutil

    import ninja
    monkeypatch.setenv("PATH", "/nonexistent")
    assert shutil.which("ninja") is None
    cpu._ninja_on_path()
    assert shutil.which("ninja") is not None
    assert os.environ["PATH"].split(os.pathsep)[0] == str(ninja.BIN_DIR)


def test_a_quantized_model_cast_afterwards_still_runs_its_native_kernel():
    model = random_model(SMALL_CONFIGS["llama-gqa-tied"])
    llminfer.quant.quantize(model, "int4", group_size=32)
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(7))
    model.to(torch.bfloat16)                          # casts the float32 kernel scales too
    layer = next(iter(llminfer.quant.quantized_modules(model).values()))
    assert layer.kernel == "native" and layer.kernel_scale.dtype == torch.bfloat16
    with torch.inference_mode():
        cache = model.new_cache(1, 8)
        model(ids, cache=cache)
        step = model(ids[:, -1:], cache=cache)        # one token: the native kernel
    assert step.shape == (1, 1, model.config.vocab_size) and torch.isfinite(step).all()


def test_a_cold_build_into_an_empty_cache(tmp_path):
    """What a new user's first use does: compile the source into an empty kernel cache, then use it."""
    script = ("import torch; from llminfer import cpu; "
              "w = torch.randn(5, 40); x = torch.randn(2, 40); "
              "print(cpu.available(), cpu.why_unavailable(), bool(torch.allclose(cpu.gemv(x, w), x @ w.T, atol=1e-5)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, LLMINFER_KERNEL_CACHE=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "None", "True"], done.stderr
    assert "compiling the CPU decode kernels once" in done.stderr
    [built] = tmp_path.glob("llminfer_cpu_kernels_*/*.so")
    # a build killed midway leaves torch's `lock` file behind: the next start must not wait on it for ever
    (built.parent / "lock").write_text("")
    again = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, LLMINFER_KERNEL_CACHE=str(tmp_path)))
    assert again.stdout.split() == ["True", "None", "True"], again.stderr
    assert "compiling" not in again.stderr and not (built.parent / "lock").exists()


def test_a_failed_build_says_why_and_leaves_torchs_kernels(tmp_path):
    """No working compiler: the first use reports it once, and a model keeps torch's kernels."""
    script = ("import torch, llminfer; from llminfer import fast; from llminfer import cpu; "
              "m = llminfer.Transformer(llminfer.get_preset('smollm2-135m').replace(n_layers=1, dim=64, n_heads=2, "
              "n_kv_heads=1, hidden_dim=128, vocab_size=100)); fast.use_native_kernels(m); "
              "print(cpu.available(), fast.uses_native_kernels(m), m.attn_backend)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, LLMINFER_KERNEL_CACHE=str(tmp_path), CXX="/nonexistent/c++"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False", "sdpa"]
    assert done.stderr.count("the native CPU decode kernels did not build") == 1
    assert "torch's kernels run instead" in done.stderr


_ROUND_HERE = textwrap.dedent("""
    import sys, torch
    from llminfer import cpu
    x = torch.load(sys.argv[1])
    print(cpu.isa())
    torch.save(torch.ops.llminfer.round_bfloat16(x), sys.argv[2])
""")


@pytest.mark.parametrize("level", [level for level in ("portable", "avx2", "avx512")
                                   if cpu._level_runs(level, cpu_capabilities().flags)])
def test_bfloat16_rounding_of_the_layers_is_torchs_to_the_bit(level, tmp_path):
    """The layers round a bfloat16 model's activations 16 at a time (AVX-512), 8 at a time (AVX2) or one by one
    (portable); each gives what torch's conversion gives for every float32 pattern tried: ties to even, infinities,
    the largest finite values (which round to infinity), subnormals; a NaN stays a NaN. 1001 values: the vector
    loops' tails run too."""
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(-2 ** 31, 2 ** 31, (1001,), generator=generator, dtype=torch.int64).to(torch.int32)
    ties = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 2 ** -130 * 1.5])
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.4028235e38, -3.4028235e38,
                            1e-45, 1.0000001])
    x = torch.cat([special, ties, patterns.view(torch.float32)])
    torch.save(x, tmp_path / "x.pt")
    env = dict(os.environ, LLMINFER_ISA=level)
    done = subprocess.run([sys.executable, "-c", _ROUND_HERE, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == level
    got, expected = torch.load(tmp_path / "out.pt"), x.bfloat16().float()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))
    assert float(got[special.numel()]) == 1.0 and float(got[special.numel() + 1]) == 1.015625   # ties to even
