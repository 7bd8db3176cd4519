"""`python -m llminfer.bench.decode`, the decode-by-precision benchmark of chapter 08, as a short smoke run."""
from __future__ import annotations

import json

import pytest

from llminfer.bench import decode


def test_a_short_run_writes_its_report(tmp_path, capsys):
    code = decode.main(["--precisions", "fp32,int8", "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1",
                        "--threads", "1", "--no-compile", "--no-transformers", "--no-llama-cpp",
                        "--out", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("decode-*.json")
    report = json.loads(path.read_text())
    band = report["bandwidth"]
    # the ceiling is the faster of the two probes, both measured in the run
    assert band["ceiling_bytes_per_s"] == max(band["matvec_bytes_per_s"], band["read_bytes_per_s"]) > 0
    rows = report["contenders"]
    assert {"llminfer fast fp32", "llminfer fast int8", "llminfer eager fp32"} <= set(rows)
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["same_tokens_as_warmup"]
        assert row["mbu"] == pytest.approx(row["bytes_per_token"] * row["tokens_per_s"] / band["ceiling_bytes_per_s"])
    # int8 reads about a quarter of the float32 bytes
    assert 3.5 < rows["llminfer fast fp32"]["bytes_per_token"] / rows["llminfer fast int8"]["bytes_per_token"] < 4.1
    assert "bandwidth ceiling" in capsys.readouterr().out
    # the read probe streams from huge pages where the weights are on them, and the file says which CPU class ran
    assert "MiB float32" in band["what"]
    assert path.name == f"decode-{report['slug']}.json"
    assert report["slug"].endswith("-avx512") == ("avx512f" in report["cpu_flags"])


def test_the_file_name_keeps_cpus_with_and_without_avx512_apart():
    assert decode._slug("cpu-amd-epyc", ["avx", "avx2", "fma"]) == "cpu-amd-epyc"
    assert decode._slug("cpu-amd-epyc", ["avx2", "avx512_bf16", "avx512f"]) == "cpu-amd-epyc-avx512"


@pytest.mark.parametrize("argv,message", [(["--precisions", "fp8"], "unknown precision"),
                                          (["--threads", "0"], "positive integer or 'auto'"),
                                          (["--new-tokens", "1"], "--new-tokens >= 2")])
def test_bad_settings_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        decode.main(argv)
    assert message in capsys.readouterr().err
