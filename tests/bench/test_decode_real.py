"""The real-weights decode benchmark's logic: token comparison, aggregation, interleaving, the file's bytes by
type and its argument checks (no timing is asserted)."""
from __future__ import annotations

import pytest

from llminfer import bench
from llminfer.bench import decode_real
from llminfer.generate import GenerationResult


def _result(tokens, gaps, ttft=0.5):
    return GenerationResult(list(tokens), ttft, list(gaps), ttft + sum(gaps), 4)


def test_compare_tokens_finds_where_two_runs_part():
    assert decode_real.compare_tokens([1, 2, 3], [1, 2, 3]) == {"same": True, "first_difference": None,
                                                              "common_prefix": 3, "agreement": 1.0}
    parted = decode_real.compare_tokens([1, 2, 3, 4], [1, 2, 9, 4])
    assert parted["same"] is False and parted["first_difference"] == 2 and parted["common_prefix"] == 2
    assert parted["agreement"] == 0.75                      # position 3 agrees again after the split
    shorter = decode_real.compare_tokens([1, 2, 3], [1, 2])
    assert shorter["same"] is False and shorter["first_difference"] == 2 and shorter["agreement"] == 2 / 3
    assert decode_real.compare_tokens([5], [6])["first_difference"] == 0


def test_summarise_takes_the_median_gap_over_every_round():
    rounds = [_result([1, 2, 3, 1], [0.1, 0.2, 0.3], ttft=1.0), _result([1, 2, 3, 1], [0.4, 0.5, 0.6], ttft=3.0)]
    row = decode_real.summarise(rounds)
    assert row["tokens_per_s"] == pytest.approx(1 / 0.35)   # median of the six gaps
    assert row["round_tokens_per_s"] == pytest.approx([1 / 0.2, 1 / 0.5])
    assert row["ttft_median_s"] == pytest.approx(2.0)
    assert row["distinct_tokens"] == 3 and row["rounds"] == 2


def test_summarise_refuses_what_it_cannot_time():
    with pytest.raises(ValueError, match="at least one"):
        decode_real.summarise([])
    with pytest.raises(ValueError, match="2 new tokens"):
        decode_real.summarise([_result([1], [])])


def test_file_bytes_by_type_adds_up_the_header():
    from llminfer import gguf_reader

    path = gguf_reader.installed_gguf("smollm2-135m-instruct")
    header = gguf_reader.read_header(path)
    by_type = decode_real.file_bytes_by_type(path)
    assert set(by_type) == {t.type_name for t in header.tensors.values()}
    q4_1_values = sum(t.shape[0] * t.shape[1] for t in header.tensors.values() if t.type_name == "Q4_1")
    assert by_type["Q4_1"] == q4_1_values * 20 // 32          # 16 bytes of nibbles + fp16 scale and minimum per 32
    assert sum(by_type.values()) < path.stat().st_size


@pytest.mark.parametrize("argv, message", [(["--formats", "q4_0"], "unknown ['q4_0']"),
                                           (["--new-tokens", "1"], "--new-tokens 1 must be >= 2"),
                                           (["--threads", "0"], "--threads 0 must be a positive integer")])
def test_bad_arguments_are_refused_before_any_work(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(decode_real, "run", lambda args: pytest.fail("ran before refusing"))
    with pytest.raises(SystemExit):
        bench.main(["real", *argv])
    assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="neither an installed model"):
        decode_real._path("no-such-model")


def test_a_short_run_writes_its_report(tmp_path, capsys):
    code = bench.main(["real", "--formats", "q4_1", "--new-tokens", "3", "--repeats", "1", "--threads", "1",
                        "--no-compile", "--no-llama-cpp", "--out", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("decode-real-*.json")
    import json

    report = json.loads(path.read_text())
    row = report["contenders"]["llminfer q4_1"]
    assert set(report["contenders"]) == {"llminfer q4_1"} and report["token_agreement"] == {}
    assert row["bytes_per_token"] > sum(report["file_bytes_by_type"].values())   # the file's bytes plus the K/V
    assert row["ceiling_bytes_per_s"] >= report["bandwidth"]["ceiling_bytes_per_s"]
    assert row["mbu"] == pytest.approx(row["bytes_per_token"] * row["tokens_per_s"] / row["ceiling_bytes_per_s"])
    # the ceiling is the best of the decode benchmark's probes, the native streaming reads among them
    band = report["bandwidth"]
    assert band["ceiling_bytes_per_s"] == max(band["by_probe"].values()) > 0
    assert {"matvec", "read"} < set(band["by_probe"]) and "native streaming read" in band["what"]
    assert report["settings"]["prompt_tokens"] > 20 and report["settings"]["threads"] == 1
    assert "llminfer q4_1" in capsys.readouterr().out
