"""`python -m llminfer.bench prefill-decode`: its figures as pure functions on synthetic timings, a smoke run of the command line on a
tiny shape, the transformers contender's result type, and clear errors for bad input.

Speeds are not asserted here; they belong to the benchmark, not to a timed test.
"""
import json

import pytest
import torch

import llminfer
from llminfer import bench
from llminfer.bench import figures, prefill_decode
from llminfer.bench import report as bench_report
from llminfer.bench.measure import shape_config

CONTENDERS = {"llminfer (cache)", "llminfer (no cache)"}
SMOKE = ["--quick", "--shape", "tiny-capitals", "--no-transformers", "--device", "cpu", "--prompt-len", "16",
         "--contexts", "16,32", "--batch-sizes", "1,2"]


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert bench.main(["prefill-decode", *SMOKE, "--out", str(out)]) == 0
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
    tiny = shape_config("tiny-capitals")
    assert report["shape"]["name"] == "tiny-capitals" and report["dtype"] == "float32"
    assert report["shape"]["n_params"] == tiny.n_params()
    assert "random" in report["weights"] and "shape" in report["weights"]
    assert report["settings"]["quick"] is True
    assert len(report["contention"]["load_average_before"]) == 3


def test_report_holds_ceilings_prefill_and_decode(quick_report):
    report, _ = quick_report
    assert set(report["ceilings"]) == {"copy_bandwidth", "matvec_bandwidth", "matmul_flops"}
    assert all(_positive(c["rate"]) and c["what"] for c in report["ceilings"].values())
    prefill = report["prefill"]
    assert prefill["flops"] == llminfer.costs.prefill_flops(shape_config("tiny-capitals"), 16)
    assert prefill["flop_per_s"] == pytest.approx(prefill["flops"] / prefill["median_s"])
    assert prefill["mfu"] == pytest.approx(prefill["flop_per_s"] / prefill["matmul_flop_per_s_alongside"])
    assert prefill["mfu_vs_run_ceiling"] == pytest.approx(
        prefill["flop_per_s"] / report["ceilings"]["matmul_flops"]["rate"])
    assert [row["batch_size"] for row in report["decode"]] == [1, 2]
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
    assert report["same_greedy_tokens_as_transformers"] is None and report["transformers"] == "skipped"
    assert report["ratios"]["decode_vs_transformers_cache"] is None
    assert _positive(report["ratios"]["cache_vs_no_cache"]["paired_median"])
    assert [row["context_len"] for row in report["scaling"]] == [16, 32]
    for row in report["scaling"]:
        # on any machine the roofline sits between the two pure limits: recomputing reads at least the weights
        # (bytes_recompute / bytes_cached, just under 1) and costs at most its extra FLOPs (flop_speedup)
        lowest = row["bytes_recompute"] / row["bytes_cached"] * (1 - 1e-9)          # equal when both read-bound
        assert lowest <= row["roofline_speedup"] <= row["flop_speedup"] * (1 + 1e-9)     # equal when compute-bound
        assert row["bytes_recompute"] < row["bytes_cached"] and row["flops_recompute"] > row["flops_cached"]
        assert row["speedup"] == pytest.approx(row["recompute_s"] / row["cached_s"])
    short, longer = report["scaling"]
    assert 1 < short["flop_speedup"] < longer["flop_speedup"]     # recompute's extra work grows with context
    assert [t["target"] for t in report["targets"]] == [1.2, 0.8, 0.7]
    assert [t["met"] is None for t in report["targets"]] == [True, False, False]   # no transformers: no ratio


def test_table_names_each_contender(quick_report):
    report, _ = quick_report
    text = prefill_decode.table(report)
    assert all(name in text for name in CONTENDERS) and "MFU" in text and "MBU" in text


@pytest.mark.parametrize("argv, message", [
    (["--shape", "gpt-17"], "gpt-17"),
    (["--device", "cuda:99"], "cuda"),
    (["--shape", "llama-3-70b", "--device", "cpu", "--dtype", "float32"], "GiB"),
    (["--batch-sizes", "0,4"], "batch sizes [0, 4]"),
    (["--batch-sizes", "1,4096"], "from 1 to 1024"),
    (["--contexts", "100000"], "max_seq_len"),
    (["--new-tokens", "1"], "new_tokens=1"),
    (["--shape", "tiny-capitals", "--contexts", "4096"], "max_seq_len=128"),
    (["--shape", "tiny-capitals", "--out", "/proc/not-writable"], "is not a writable folder"),
])
def test_bad_input_is_refused_before_any_work(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(llminfer.device, "free_memory_bytes", lambda device: 16 * 2**30)   # whatever the host has
    monkeypatch.setattr(prefill_decode, "_measure", lambda *a: pytest.fail("measured before refusing"))
    assert bench.main(["prefill-decode", "--quick", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_batch_sizes_must_be_integers():
    with pytest.raises(SystemExit):
        prefill_decode.parse_args(["--batch-sizes", "one,four"])


def test_memory_estimate_grows_with_batch_and_the_transformers_copy():
    cfg = llminfer.get_preset("smollm2-135m")
    small = prefill_decode.Settings(batch_sizes=(1,), transformers=False)
    assert prefill_decode.estimate_bytes(cfg, torch.float32, small) >= cfg.n_params() * 4
    bigger = prefill_decode.Settings(batch_sizes=(1, 64), transformers=False)
    assert prefill_decode.estimate_bytes(cfg, torch.float32, bigger) > prefill_decode.estimate_bytes(cfg, torch.float32, small)
    with_hf = prefill_decode.Settings(batch_sizes=(1,), transformers=True)
    extra = prefill_decode.estimate_bytes(cfg, torch.float32, with_hf) - prefill_decode.estimate_bytes(cfg, torch.float32, small)
    assert extra == cfg.n_params() * 4


def test_device_slug_is_a_file_name():
    slug = bench_report.device_slug(torch.device("cpu"))
    assert slug.startswith("cpu") and slug.replace("-", "").isalnum()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quick_cuda_run_has_the_graph_contender_and_cuda_targets(tmp_path):
    assert bench.main(["prefill-decode", "--quick", "--device", "cuda", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert report["dtype"] == "bfloat16" and report["shape"]["name"] == "llama-3.2-1b"
    assert "llminfer (CUDA graphs)" in report["contenders"] and report["machine"]["gpu"]
    assert [t["target"] for t in report["targets"]] == [1.5, 0.6]


# ---- the figures: pure functions on synthetic timings ------------------------------------------

def test_decode_figures_by_hand():
    cfg = shape_config("tiny-capitals")
    # 3 decode steps after an 8-token prompt: they attend 9, 10 and 11 positions
    per_step = sum(llminfer.costs.decode_step_bytes(cfg, cached_len=n, dtype_bytes=4) for n in (8, 9, 10)) / 3
    row = figures.decode_figures(cfg, 4, [0.02, 0.01, 0.03], batch_size=1, prompt_len=8, new_tokens=4,
                                 matvec_rate=2 * per_step / 0.02, copy_rate=4 * per_step / 0.02)
    assert row["step_s"] == 0.02 and row["tokens_per_s"] == 50
    assert row["bytes_per_step"] == pytest.approx(per_step)
    assert row["mbu_matvec"] == pytest.approx(0.5) and row["mbu_copy"] == pytest.approx(0.25)


def test_prefill_figures_by_hand():
    cfg = shape_config("tiny-capitals")
    flops = llminfer.costs.prefill_flops(cfg, 16)
    row = figures.prefill_figures(cfg, 16, 1, seconds=0.5, matmul_rate_alongside=4 * flops, matmul_rate_run=8 * flops)
    assert row["flop_per_s"] == 2 * flops and row["tokens_per_s"] == 32
    assert row["mfu"] == 0.5 and row["mfu_vs_run_ceiling"] == 0.25


def test_a_utilisation_above_one_is_reported_as_above_the_probe():
    assert figures.utilisation(0.5, 1.0, "x") == 0.5
    assert figures.utilisation(14.8, 10.0, "decode MBU") == pytest.approx(1.48)     # returned, not refused
    assert figures.above_probe({"mbu": 0.9, "graph_mbu": 1.02, "none": None, "exact": 1.0}) == ["graph_mbu"]
    with pytest.raises(ValueError, match="ceiling of 0"):
        figures.utilisation(1.0, 0, "decode MBU")
    with pytest.raises(ValueError, match="cannot compare nan"):
        figures.utilisation(float("nan"), 1.0, "decode MBU")


def test_paired_ratio_and_roofline():
    ratio = figures.paired_ratio([1.0, 2.0, 4.0], [2.0, 2.0, 12.0])
    assert ratio["paired_median"] == 2.0 and ratio["of_medians"] == 1.0
    with pytest.raises(ValueError, match="same number of rounds"):
        figures.paired_ratio([1.0], [1.0, 2.0])
    rows = [{"flops_cached": 10.0, "bytes_cached": 100.0, "flops_recompute": 1000.0, "bytes_recompute": 100.0}]
    figures.add_roofline(rows, matmul_rate=10.0, bandwidth=100.0)     # cached: 1 s of bytes; recompute: 100 s of FLOPs
    assert rows[0]["roofline_speedup"] == 100.0


def _scaling_rows(cfg, contexts, elem):
    return [{"context_len": n, "flops_cached": llminfer.costs.decode_step_flops(cfg, cached_len=n),
             "flops_recompute": llminfer.costs.forward_flops(cfg, n + 1, 0, logits_positions=1),
             "bytes_cached": llminfer.costs.decode_step_bytes(cfg, cached_len=n, dtype_bytes=elem),
             "bytes_recompute": llminfer.costs.weight_bytes(cfg, elem)} for n in contexts]


@pytest.mark.parametrize("flops_per_byte", [1, 8, 30, 100, 300])    # an old CPU up to a GPU's matmul/bandwidth
@pytest.mark.parametrize("elem", [4, 2])
def test_the_roofline_says_the_cache_pays_at_long_context_on_any_machine(flops_per_byte, elem):
    cfg = llminfer.get_preset("smollm2-135m")
    rows = _scaling_rows(cfg, [16, 32, 128, 512, 2048], elem)
    figures.add_roofline(rows, matmul_rate=flops_per_byte * 1e9, bandwidth=1e9)
    for row in rows:
        lowest = row["bytes_recompute"] / row["bytes_cached"] * (1 - 1e-9)          # equal when both read-bound
        assert lowest <= row["roofline_speedup"] <= row["flops_recompute"] / row["flops_cached"] * (1 + 1e-9)
    # a short recompute costs about one weight read, like a cached step: on a machine with a high matmul rate
    # against its bandwidth the roofline puts it at 0.99 (no gain), never far below 1
    assert rows[0]["roofline_speedup"] > 0.98
    if flops_per_byte * elem > 2 * 17:     # 2 FLOPs a weight per position take less time than reading the weight
        assert rows[0]["roofline_speedup"] < 1.01
    assert rows[-1]["roofline_speedup"] > 3            # at 2048 positions recomputing costs several cached steps


def test_the_transformers_contender_returns_a_generation_result():
    from small_models import SMALL_CONFIGS, random_model
    from llminfer.bench import transformers_contender

    model = random_model(SMALL_CONFIGS["llama-gqa-tied"], seed=5)
    hf_model, note = transformers_contender.load_same_weights(model)
    assert "transformers" in note
    ids = torch.randint(0, 101, (1, 9), generator=torch.Generator().manual_seed(2))
    result = transformers_contender.generate(hf_model, ids, 6, use_cache=True)
    assert isinstance(result, llminfer.GenerationResult)
    assert result.token_ids == llminfer.generate(model, ids, max_new_tokens=6).token_ids
    assert len(result.itl_s) == 5 and result.tpot_s == pytest.approx((result.e2e_s - result.ttft_s) / 5)
