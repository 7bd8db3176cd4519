"""The llama.cpp peer's build options for each CPU class, and its child process."""
from __future__ import annotations

import pytest

from llminfer.bench import llama_peer
from llminfer.quant.gguf_export import llama_cpp_available

ZEN3 = {"avx", "avx2", "fma", "f16c", "sse4_2"}
ZEN4 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx512vbmi"}
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


def test_native_build_wherever_there_are_no_amx_tiles():
    assert llama_peer.cmake_args(ZEN3) == ["-DGGML_NATIVE=ON"]
    assert llama_peer.cmake_args(ZEN4) == ["-DGGML_NATIVE=ON"]


def test_on_an_amx_cpu_every_vector_option_it_has_and_amx_compiled_out():
    args = llama_peer.cmake_args(SAPPHIRE_RAPIDS)
    assert args[0] == "-DGGML_NATIVE=OFF"
    for on in ("AVX", "AVX2", "FMA", "F16C", "AVX_VNNI", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"):
        assert f"-DGGML_{on}=ON" in args, on
    for off in ("AMX_TILE", "AMX_INT8", "AMX_BF16"):
        assert f"-DGGML_{off}=OFF" in args, off
    older = llama_peer.cmake_args(SAPPHIRE_RAPIDS - {"avx512_bf16", "avx_vnni"})      # what it lacks stays off
    assert "-DGGML_AVX512_BF16=OFF" in older and "-DGGML_AVX_VNNI=OFF" in older and "-DGGML_AVX512=ON" in older
    assert "-DGGML_AVX512=OFF" in llama_peer.cmake_args((SAPPHIRE_RAPIDS - {"avx512bw"}))  # all four, or none


def test_extra_buffers_stay_on_unless_amx_tiles_are_compiled_in():
    amx_out = {"cmake_args": llama_peer.cmake_args(SAPPHIRE_RAPIDS)}
    assert llama_peer.extra_buffers(ZEN3, None)                          # no AMX: the repacked layouts run
    assert llama_peer.extra_buffers(SAPPHIRE_RAPIDS, amx_out)            # AMX compiled out: they run too
    assert not llama_peer.extra_buffers(SAPPHIRE_RAPIDS, None)           # unknown build on AMX: off, and said so
    assert not llama_peer.extra_buffers(SAPPHIRE_RAPIDS, {"cmake_args": ["-DGGML_NATIVE=ON"]})


def test_a_peer_that_cannot_start_fails_naming_its_file(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(RuntimeError, match="absent.gguf"):
        llama_peer.LlamaCppProcess(missing, n_ctx=64, threads=1)


@pytest.mark.skipif(not llama_cpp_available(), reason="the llama.cpp peer is not installed (make peer-llama-cpp)")
def test_the_peer_in_its_own_process_decodes_as_in_this_one(tmp_path):
    import llminfer
    from llminfer.quant.gguf_export import llama_cpp_generate, load_llama_cpp, write_gguf

    model, _ = llminfer.load_pretrained("tiny-capitals")
    path = write_gguf(model, tmp_path / "tiny.gguf", "F32")
    ids = [1, 5, 9, 2, 7]
    here = llama_cpp_generate(load_llama_cpp(path, 64, 1), ids, 8)
    with llama_peer.LlamaCppProcess(path, 64, 1) as peer:
        there = peer.generate(ids, 8)
        assert there.token_ids == here.token_ids and len(there.itl_s) == 7 and there.ttft_s > 0
        assert peer.logits(ids).shape == (model.config.vocab_size,)
