"""The load generator: its figures equal figures recomputed from its raw per-request timestamps."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

import llminfer
from llminfer.engine import LLMEngine
from llminfer.serve import bench
from llminfer.serve.server import OpenAIServer, ServeConfig, ServerThread, build_app

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny-capitals"


@pytest.fixture(scope="module")
def server():
    model, tokenizer = llminfer.load_pretrained(MODEL)
    state = OpenAIServer(model, tokenizer, ServeConfig(model_name=MODEL),
                         engine=LLMEngine(model, num_blocks=96, max_num_seqs=8))
    with ServerThread(build_app(server=state)) as thread:
        yield thread


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile, written out (the 'linear' method of Hyndman and Fan's type 7)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def test_figures_equal_those_recomputed_from_raw_timestamps(server, tmp_path):
    requests = bench.workload_requests(10, vocab_size=1024, seed=3, prompt_median=8, max_prompt=16,
                                       output_median=6, max_output=10)
    slo = {"ttft": 0.25, "tpot": 0.03}
    result = bench.run_benchmark(server.url + "/v1", MODEL, requests, request_rate=40.0, seed=1, slo=slo,
                                 return_timings=True)
    from llminfer.bench.report import publish        # the benchmarks' one writer: JSON (NaN as null) and the plot

    json_path, png_path = publish(result.to_json(), tmp_path, "serve_bench", plot=lambda _: bench.plot_result(result))
    assert png_path.stat().st_size > 1000
    saved = json.loads(json_path.read_text())
    raw, summary = saved["requests"], saved["summary"]
    assert len(raw) == 10 and all(r["success"] for r in raw)
    for r, request in zip(raw, requests):
        assert r["output_tokens"] == request.max_tokens == len(r["chunk_s"])        # ignore_eos: exact lengths
        assert r["prompt_tokens"] == len(request.prompt)

    ttft = [r["chunk_s"][0] - r["send_s"] for r in raw]
    itl = [b - a for r in raw for a, b in zip(r["chunk_s"], r["chunk_s"][1:])]
    tpot = [(r["chunk_s"][-1] - r["chunk_s"][0]) / (r["output_tokens"] - 1) for r in raw if r["output_tokens"] > 1]
    e2e = [r["end_s"] - r["send_s"] for r in raw]
    duration = max(r["end_s"] for r in raw) - min(r["send_s"] for r in raw)
    good = sum(1 for r, t in zip(raw, ttft) if t <= slo["ttft"] and (
        r["output_tokens"] < 2 or (r["chunk_s"][-1] - r["chunk_s"][0]) / (r["output_tokens"] - 1) <= slo["tpot"]))
    assert summary["duration_s"] == pytest.approx(duration, abs=1e-12)
    assert summary["output_throughput"] == pytest.approx(sum(r["output_tokens"] for r in raw) / duration)
    assert summary["request_throughput"] == pytest.approx(10 / duration)
    assert summary["goodput"] == pytest.approx(good / duration) and summary["good_requests"] == good
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        assert summary[f"{name}_mean_s"] == pytest.approx(sum(values) / len(values), abs=1e-12)
        for q in (50, 90, 99):
            # 10 requests hold a median, not a p90 or p99 (two values must lie beyond a tail percentile)
            if len(values) * (1 - q / 100) >= 2 or q == 50:
                assert summary[f"{name}_p{q}_s"] == pytest.approx(quantile(values, q), abs=1e-12), (name, q)
            else:
                assert summary[f"{name}_p{q}_s"] is None, (name, q, len(values))      # NaN, written as JSON null
    # the sends followed the Poisson schedule drawn from the seed
    offsets = bench.arrival_offsets(10, 40.0, seed=1)
    sends = [r["send_s"] - raw[0]["send_s"] for r in raw]
    assert all(s >= o - 1e-3 for s, o in zip(sends, offsets))
    # the server's own view: its engine saw the first token no later than the client did
    for r in raw:
        timings = r["server_timings"]
        assert 0 <= timings["engine_ttft_s"] <= r["chunk_s"][0] - r["send_s"]
        assert len(timings["engine_itl_s"]) == r["output_tokens"] - 1


def test_fixed_concurrency_caps_requests_in_flight(server):
    requests = bench.workload_requests(8, seed=4, prompt_median=6, max_prompt=12, output_median=6, max_output=8)
    result = bench.run_benchmark(server.url + "/v1", MODEL, requests, max_concurrency=2)
    records = result.records
    assert len(records) == 8 and all(r.success for r in records)
    assert bench.max_in_flight(records) == 2 == result.summary["max_in_flight"]


def test_requests_in_flight_from_hand_made_timestamps():
    def rec(send, end):
        return bench.RequestRecord(index=0, send_s=send, end_s=end, success=end == end)

    # 0: [0, 3), 1: [1, 2), 2: [2, 5) (sent as 1 ends), 3: [2.5, 4), 4 failed without an end
    records = [rec(0, 3), rec(1, 2), rec(2, 5), rec(2.5, 4), rec(0.5, float("nan"))]
    assert bench.max_in_flight(records) == 3                 # at 2.5: requests 0, 2 and 3
    assert bench.max_in_flight(records[:2]) == 2 and bench.max_in_flight([]) == 0
    assert bench.summarize(records)["max_in_flight"] == 3


def test_runs_are_bounded_in_time(server):
    requests = bench.workload_requests(20, seed=5, prompt_median=4, max_prompt=8, output_median=4, max_output=4)
    start = time.monotonic()
    result = bench.run_benchmark(server.url + "/v1", MODEL, requests, request_rate=2.0, duration_limit_s=1.0)
    assert time.monotonic() - start < 10
    assert 1 <= len(result.records) < 20                      # later arrivals were never sent


def test_poisson_arrivals_have_the_stated_rate():
    offsets = np.array(bench.arrival_offsets(4000, 8.0, seed=0))
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.08)               # exponential: CV 1
    bursty = np.diff(bench.arrival_offsets(4000, 8.0, burstiness=0.25, seed=0))
    assert bursty.mean() == pytest.approx(1 / 8.0, rel=0.1) and bursty.std() / bursty.mean() > 1.6
    assert bench.arrival_offsets(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        bench.arrival_offsets(3, 0.0)


def test_command_line_writes_json_and_plot(server, tmp_path, capsys):
    from llminfer.bench import main as bench_main

    code = bench_main(["serve", "--base-url", server.url + "/v1", "--model", MODEL, "--num-prompts", "4", "--request-rate",
                       "20", "--max-prompt", "8", "--prompt-median", "4", "--max-output", "6", "--output-median",
                       "4", "--goodput", "ttft:500", "tpot:100", "--out", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "goodput" in printed and "TTFT" in printed
    saved = json.loads((tmp_path / "serve_bench.json").read_text())
    assert saved["settings"]["slo_s"] == {"ttft": 0.5, "tpot": 0.1} and saved["summary"]["completed"] == 4
    assert (tmp_path / "serve_bench.png").is_file()


def test_dataset_files_and_goodput_targets_are_checked(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "The capital of France", "max_tokens": 4}\n{"prompt": [5, 6, 7]}\n')
    rows = bench.file_requests(path, default_max_tokens=3)
    assert rows == [bench.BenchRequest("The capital of France", 4), bench.BenchRequest([5, 6, 7], 3)]
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="non-empty"):
        bench.file_requests(path)
    from llminfer.bench.serve import parse_goodput

    assert parse_goodput(["ttft:250", "e2e:2000"]) == {"ttft": 0.25, "e2e": 2.0}
    for bad in (["ttft"], ["latency:5"], ["tpot:-1"], ["tpot:fast"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
