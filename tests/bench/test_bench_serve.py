"""`python -m llminfer.bench serve --compare vllm` (llminfer.bench.serve): the plan and figures on synthetic records,
the llminfer side end to end on the real model, and refusals before anything starts. Chapter 11."""
from __future__ import annotations

import math
import sys

import pytest

from llminfer import bench, timing
from llminfer.bench import serve as compare
from llminfer.serve import bench as load, peer
from llminfer.serve.bench import RequestRecord

pytestmark = pytest.mark.timeout(900)


def _record(index, send, ttft, tpot, tokens, success=True):
    chunks = [send + ttft + i * tpot for i in range(tokens)] if success else []
    return RequestRecord(index, send, 10, tokens, chunks, (chunks[-1] if chunks else send) + 0.001,
                         tokens if success else 0, "x", success, "" if success else "boom")


# --- the plan -----------------------------------------------------------------------------------------------------

def test_rounds_alternate_which_server_goes_first():
    assert timing.round_order(("llminfer", "vllm"), 3, alternate=True) == [
        ["llminfer", "vllm"], ["vllm", "llminfer"], ["llminfer", "vllm"]]
    assert timing.round_order(["a", "b", "c"], 2, alternate=True) == [["a", "b", "c"], ["c", "b", "a"]]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="rounds must be a positive integer"):
            timing.round_order(("a", "b"), bad, alternate=True)


def test_a_point_pools_its_rounds_tokens_over_their_summed_durations():
    first = {"duration_s": 2.0, "records": [_record(0, 0.0, 0.1, 0.02, 24), _record(1, 0.0, 0.3, 0.04, 24)]}
    second = {"duration_s": 4.0, "records": [vars(_record(0, 0.0, 0.2, 0.03, 24)), vars(_record(1, 0, 0, 0, 0, False))]}
    point = compare.aggregate([first, second])
    assert (point["requests"], point["completed"], point["failed"], point["output_tokens"]) == (4, 3, 1, 72)
    assert point["output_throughput"] == pytest.approx(72 / 6.0)          # not the mean of 24 and 6 tokens/s
    assert point["round_output_throughput"] == pytest.approx([24.0, 6.0])
    assert point["ttft_p50_s"] == pytest.approx(0.2)                      # the median of all three successes
    assert point["tpot_p50_s"] == pytest.approx(0.03)
    assert math.isnan(point["ttft_p99_s"])                                # too few requests for a p99
    with pytest.raises(ValueError, match="no runs"):
        compare.aggregate([])


def test_points_group_runs_by_server_dtype_and_concurrency():
    runs = [{"server": s, "dtype": "float32", "concurrency": c, "round": r, "duration_s": d,
             "records": [vars(_record(0, 0.0, ttft, 0.05, 10))]}
            for s, c, r, d, ttft in [("llminfer", 1, 0, 1.0, 0.1), ("llminfer", 1, 1, 1.0, 0.3),
                                     ("vllm", 1, 0, 2.0, 0.4), ("vllm", 1, 1, 2.0, 0.4), ("vllm", 4, 0, 1.0, 0.5)]]
    points = compare.points_of(runs)
    assert set(points) == {"llminfer", "vllm"} and set(points["vllm"]["float32"]) == {"1", "4"}
    assert points["llminfer"]["float32"]["1"]["output_throughput"] == pytest.approx(10.0)
    assert points["vllm"]["float32"]["1"]["output_throughput"] == pytest.approx(5.0)
    table = compare.ratios(points)
    assert set(table["float32"]) == {"1"}                                 # only levels both servers ran
    assert table["float32"]["1"]["output_throughput"] == pytest.approx(2.0)
    assert table["float32"]["1"]["ttft_p50"] == pytest.approx(0.4 / 0.2)
    assert compare.verdict(table) == {"float32": {"throughput_target_met": True, "ttft_no_worse": True,
                                               "min_throughput_ratio": pytest.approx(2.0)}}
    slower = {"float32": {"1": {"output_throughput": 1.1, "ttft_p50": 1.5, "tpot_p50": 1.0},
                          "8": {"output_throughput": 1.5, "ttft_p50": 0.9, "tpot_p50": 1.0}}}
    assert compare.verdict(slower)["float32"] == {"throughput_target_met": False, "ttft_no_worse": False,
                                               "min_throughput_ratio": 1.1}


def test_the_figure_and_table_draw_from_the_points_alone(tmp_path):
    runs = [{"server": s, "dtype": d, "concurrency": c, "round": 0, "duration_s": 1.0,
             "records": [vars(_record(i, 0.0, 0.1, 0.05, 8)) for i in range(3)]}
            for s in ("llminfer", "vllm") for d in ("float32", "bfloat16") for c in (1, 4)]
    points = compare.points_of(runs)
    report = {"machine": {"cpu": "test CPU", "slug": "cpu-test"}, "points": points, "ratios": compare.ratios(points),
              "settings": {"model": "m", "output_tokens": 8, "dtypes": ["float32", "bfloat16"], "concurrency": [1, 4]},
              "startup_s": {"vllm": {"float32": [50.0, 60.0]}}, "rss_peak_bytes": {"vllm": {"float32": [2**31]}},
              "runs": runs}
    text = compare.table(report)
    assert "bfloat16     4 vllm" in text and "1.00x tok/s" in text and "startup   55.0 s" in text
    json_path, png_path = compare.save(report, tmp_path)
    assert json_path.name == "serve-vs-vllm-cpu-test.json" and png_path.stat().st_size > 10_000


def test_bad_comparison_settings_are_refused_before_anything_starts(capsys):
    with pytest.raises(SystemExit):
        bench.main(["serve", "--compare", "vllm", "--concurrency", "0"])
    assert "--concurrency levels must be >= 1" in capsys.readouterr().err


# --- the llminfer side, for real -----------------------------------------------------------------------------------

def test_the_llminfer_side_runs_end_to_end_on_the_real_model(tmp_path):
    import llminfer
    folder = peer.peer_checkpoint(tmp_path / "smollm2")
    assert (folder / ".complete").is_file() and peer.peer_checkpoint(folder) == folder      # written once
    report = compare.compare(dtypes=("float32",), concurrency=(1, 3), num_prompts=3, rounds=1, output_tokens=5,
                          threads=1, warmup=1, folder=folder, servers=("llminfer",), log=lambda line: None)
    points = report["points"]["llminfer"]["float32"]
    assert set(points) == {"1", "3"} and report["ratios"] == {}
    assert all(p["completed"] == p["requests"] == 3 and p["output_tokens"] == 15 for p in points.values())
    assert len(report["startup_s"]["llminfer"]["float32"]) == 1 and report["rss_peak_bytes"]["llminfer"]["float32"][0] \
        > 300 * 2**20                                                     # the model's 540 MB of float32 weights
    # the server's greedy text (fast path, chunked prefill, batched) is llminfer.generate's
    model, tokenizer = llminfer.load_pretrained(folder, dtype=None)
    requests = load.workload_requests(3, seed=0)
    for run in report["runs"]:
        for record in run["records"]:
            prompt = requests[record["index"]].prompt
            expected = llminfer.generate(model, prompt, max_new_tokens=5).token_ids
            assert record["text"] == tokenizer.decode(expected), (run["concurrency"], record["index"])


def test_a_server_that_does_not_start_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    import shutil

    from llminfer.checkpoint import model_folder
    folder = tmp_path / "model"
    shutil.copytree(model_folder("tiny-capitals"), folder)
    (folder / ".complete").write_text("tiny-capitals\n")                 # peer_checkpoint takes it as written
    monkeypatch.setattr(peer, "vllm_python", lambda root=None: sys.executable)    # a Python without vllm
    report = compare.compare(dtypes=("float32",), concurrency=(1,), num_prompts=1, rounds=2, folder=folder,
                          servers=("vllm",), log=lambda line: None)
    assert [(f["server"], f["round"]) for f in report["failures"]] == [("vllm", 0), ("vllm", 1)]
    assert "No module named" in report["failures"][0]["error"]
    assert report["runs"] == [] and report["points"] == {} and report["verdict"] == {}
