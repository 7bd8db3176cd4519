"""The benchmark's command line: the JSON's structure after --quick, and clear errors for bad input.

Speeds are not asserted here; they belong to the benchmark, not to a timed test.
"""
import json

import pytest
import torch

import llminfer
from llminfer import bench, bench_report

CONTENDERS = {"llminfer (cache)", "llminfer (no cache)", "transformers (cache)", "transformers (no cache)"}


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench.main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 2, files
    json_file = next(out.glob("*.json"))
    return json.loads(json_file.read_text()), json_file


def _positive(value):
    return isinstance(value, (int, float)) and value > 0


def test_quick_run_writes_json_and_png_beside_it(quick_report):
    report, json_file = quick_report
    assert json_file.stem == report["device_name"] and report["device_name"].startswith("cpu")
    png = json_file.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_describes_machine_shape_and_random_weights(quick_report):
    report, _ = quick_report
    machine = report["machine"]
    assert machine["torch"] == torch.__version__ and machine["cpu_cores"] >= 1 and machine["cpu"]
    assert report["shape"]["name"] == "smollm2-135m" and report["dtype"] == "float32"
    assert report["shape"]["n_params"] == llminfer.get_preset("smollm2-135m").n_params()
    assert "random" in report["weights"] and "shape" in report["weights"]
    assert report["settings"]["quick"] is True
    assert len(report["contention"]["load_average_before"]) == 3


def test_report_holds_ceilings_prefill_and_decode(quick_report):
    report, _ = quick_report
    assert set(report["ceilings"]) == {"copy_bandwidth", "matvec_bandwidth", "matmul_flops"}
    assert all(_positive(c["rate"]) and c["what"] for c in report["ceilings"].values())
    prefill = report["prefill"]
    assert prefill["flops"] == llminfer.costs.prefill_flops(llminfer.get_preset("smollm2-135m"), 32)
    assert prefill["flop_per_s"] == pytest.approx(prefill["flops"] / prefill["median_s"])
    assert prefill["mfu"] == pytest.approx(prefill["flop_per_s"] / prefill["matmul_flop_per_s_alongside"])
    assert prefill["mfu_vs_run_ceiling"] == pytest.approx(
        prefill["flop_per_s"] / report["ceilings"]["matmul_flops"]["rate"])
    assert [row["batch_size"] for row in report["decode"]] == [1, 4]
    for row in report["decode"]:
        assert row["tokens_per_s"] == pytest.approx(row["batch_size"] / row["step_s"])
        assert row["bytes_per_token"] == pytest.approx(row["bytes_per_step"] / row["batch_size"])
        assert row["mbu_matvec"] == pytest.approx(row["bytes_per_s"] / row["matvec_bytes_per_s_alongside"])
        assert _positive(row["mbu_matvec_vs_run_ceiling"]) and _positive(row["mbu_copy"])


def test_report_holds_every_contender_and_the_scaling(quick_report):
    report, _ = quick_report
    assert set(report["contenders"]) == CONTENDERS
    for entry in report["contenders"].values():
        assert _positive(entry["tokens_per_s"]) and len(entry["repeat_medians_s"]) == 2
    assert report["contenders"]["llminfer (cache)"]["new_tokens"] == 8
    assert report["same_greedy_tokens_as_transformers"] in (True, False)
    assert _positive(report["ratios"]["decode_vs_transformers_cache"]["paired_median"])
    assert [row["context_len"] for row in report["scaling"]] == [32, 64]
    for row in report["scaling"]:
        assert row["flop_speedup"] > row["roofline_speedup"] > 1
        assert row["speedup"] == pytest.approx(row["recompute_s"] / row["cached_s"])
    assert [t["target"] for t in report["targets"]] == [1.2, 0.8, 0.7]
    assert all(isinstance(t["met"], bool) for t in report["targets"])


def test_table_names_each_contender(quick_report):
    report, _ = quick_report
    text = bench_report.table(report)
    assert all(name in text for name in CONTENDERS) and "MFU" in text and "MBU" in text


@pytest.mark.parametrize("argv, message", [
    (["--shape", "gpt-17"], "gpt-17"),
    (["--device", "cuda:99"], "cuda"),
    (["--shape", "llama-3-70b", "--device", "cpu", "--dtype", "float32"], "GiB"),
    (["--batch-sizes", "0,4"], "batch sizes [0, 4]"),
    (["--batch-sizes", "1,4096"], "from 1 to 1024"),
    (["--contexts", "100000"], "max_seq_len"),
    (["--new-tokens", "1"], "new_tokens=1"),
])
def test_bad_input_is_refused_before_any_work(argv, message, tmp_path, capsys):
    assert bench.main(["--quick", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_batch_sizes_must_be_integers():
    with pytest.raises(SystemExit):
        bench.parse_args(["--batch-sizes", "one,four"])


def test_memory_estimate_grows_with_batch_and_the_transformers_copy():
    cfg = llminfer.get_preset("smollm2-135m")
    small = bench.Settings(batch_sizes=(1,), transformers=False)
    assert bench.estimate_bytes(cfg, torch.float32, small) >= cfg.n_params() * 4
    bigger = bench.Settings(batch_sizes=(1, 64), transformers=False)
    assert bench.estimate_bytes(cfg, torch.float32, bigger) > bench.estimate_bytes(cfg, torch.float32, small)
    with_hf = bench.Settings(batch_sizes=(1,), transformers=True)
    extra = bench.estimate_bytes(cfg, torch.float32, with_hf) - bench.estimate_bytes(cfg, torch.float32, small)
    assert extra == cfg.n_params() * 4


def test_device_slug_is_a_file_name():
    slug = bench_report.device_slug(torch.device("cpu"))
    assert slug.startswith("cpu") and slug.replace("-", "").isalnum()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_cuda_run_has_the_graph_contender_and_cuda_targets(tmp_path):
    assert bench.main(["--quick", "--device", "cuda", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert report["dtype"] == "bfloat16" and report["shape"]["name"] == "llama-3.2-1b"
    assert "llminfer (CUDA graphs)" in report["contenders"] and report["machine"]["gpu"]
    assert [t["target"] for t in report["targets"]] == [1.5, 0.6]
