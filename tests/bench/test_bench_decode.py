"""`python -m llminfer.bench decode`, the decode-by-precision benchmark of chapter 08, as a short smoke run."""
from __future__ import annotations

import json

import pytest
import torch

from llminfer import bench, device
from llminfer.bench import decode


def test_a_short_run_writes_its_report(tmp_path, capsys, monkeypatch):
    from llminfer import cpu as kernels

    assert kernels.load(), kernels.why_unavailable()
    monkeypatch.delenv(kernels.PREFILL_ENV, raising=False)         # the kernels' own prefill path
    # the plain model's prefill computes the last position's logits only, as a prefill does
    from llminfer.model import Transformer
    shapes = []
    real_forward = Transformer.forward

    def forward(self, ids, *args, **kwargs):
        out = real_forward(self, ids, *args, **kwargs)
        shapes.append((ids.shape[1], out.shape[1], kwargs.get("cache") is not None))
        return out

    monkeypatch.setattr(Transformer, "forward", forward)
    code = bench.main(["decode", "--precisions", "fp32,int8", "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1",
                        "--threads", "1", "--no-compile", "--no-transformers", "--no-llama-cpp",
                        "--out", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("decode-*.json")
    report = json.loads(path.read_text())
    band = report["bandwidth"]
    # the ceiling is the best of the probes, all measured in the run (the last the native streaming reads)
    assert band["ceiling_bytes_per_s"] == max(band["matvec_bytes_per_s"], band["read_bytes_per_s"],
                                              band["native_read_bytes_per_s"]) > 0
    assert "native streaming read" in band["what"] and "2 MiB pages" in band["what"]
    # one native probe per load width this process runs (the widest is not always the fastest), the best reported
    by_width = band["native_read_by_width"]
    widths = sorted(int(what.split(", ")[1].split("-byte")[0]) for what in by_width)
    features = kernels.isa_features()
    assert widths == sorted([w for w, level in ((64, "avx512"), (32, "avx2")) if level in features] or [8])
    assert band["native_read_bytes_per_s"] == max(by_width.values())
    # each format's decode loops, as the kernels' static table chose them here, are in the report
    assert report["kernels"]["matvec"] == {name: {"level": level} for name, level in kernels.decode_loops().items()}
    # the kernels' level and, per precision, the prefill on the measured path, on both paths and on the plain model
    assert report["kernels"]["isa"] == kernels.isa()
    prefill = report["prefill"]["by_precision"]
    assert set(prefill) == {"fp32", "int8"}
    rates = report["prefill"]["matmul_flop_per_s_alongside"]
    assert set(rates) == {"float32", "int8"} and rates["float32"] == report["prefill"]["sgemm_flop_per_s_alongside"] > 0
    # float32's yardstick is the best of torch's square matmul and the native kernel's, square and on a layer's
    # products; int8's own products by the blocked kernel are a fourth probe, which int8's yardstick takes too
    probes = report["prefill"]["matmul_flop_per_s_by_probe"]
    assert len(probes) == 4 and sum("native blocked kernel" in what for what in probes) == 3
    (int8_probe,) = [what for what in probes if what.endswith("blocked kernel, int8")]
    assert rates["int8"] == probes[int8_probe] > 0
    assert rates["float32"] == max(rate for what, rate in probes.items() if what != int8_probe)
    yardstick = {"fp32": rates["float32"], "int8": max(rates["float32"], rates["int8"])}
    # each precision's prefill took the kernels' path: the blocked kernel wherever the vector loops run
    vector = kernels.isa() != "portable"
    for name, entry in prefill.items():
        assert entry["measured_path"] == ("blocked" if vector else "torch")
        assert entry["mfu_against_flop_per_s"] == yardstick[name]
        assert entry["chosen_mfu"] == pytest.approx(report["prefill"]["flops"] / entry["chosen_s"] / yardstick[name])
        assert all(entry[f"{path}_s"] > 0 for path in ("chosen", "blocked", "torch", "plain"))
    # every forward over the 8-token prompt, the plain model's without a cache among them, returned one position
    prompts = [(logits, cached) for tokens, logits, cached in shapes if tokens == 8]
    assert (1, False) in prompts and all(logits == 1 for logits, _ in prompts)
    rows = report["contenders"]
    assert {"llminfer fast fp32", "llminfer fast int8", "llminfer eager fp32"} <= set(rows)
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["same_tokens_as_warmup"]
        # against the memory's ceiling, or, for bytes a cache can hold part of, a streaming read of those bytes
        assert row["ceiling_bytes_per_s"] >= band["ceiling_bytes_per_s"]
        assert row["mbu"] == pytest.approx(row["bytes_per_token"] * row["tokens_per_s"] / row["ceiling_bytes_per_s"])
    footprints = band["footprint_read_bytes_per_s_by_mib"]
    for row in rows.values():
        size = str(max(1, round(row["bytes_per_token"] / 2**20)))
        if size in footprints:
            assert row["ceiling_bytes_per_s"] == max(band["ceiling_bytes_per_s"], footprints[size])
        else:
            assert row["ceiling_bytes_per_s"] == band["ceiling_bytes_per_s"]
    # int8 reads about a quarter of the float32 bytes
    assert 3.5 < rows["llminfer fast fp32"]["bytes_per_token"] / rows["llminfer fast int8"]["bytes_per_token"] < 4.1
    assert "bandwidth ceiling" in capsys.readouterr().out
    # the read probe streams from huge pages where the weights are on them, and the file says which CPU class ran
    assert "MiB float32" in band["what"]
    assert path.name == f"decode-{report['slug']}.json"
    assert report["slug"] == device.cpu_slug()
    assert ("-avx512" in report["slug"]) == ("avx512f" in report["cpu_flags"])
    assert report["slug"].endswith("-amx") == ("amx_tile" in report["cpu_flags"])


@pytest.mark.parametrize("argv,message", [(["--precisions", "fp8"], "unknown precision"),
                                          (["--threads", "0"], "positive integer or 'auto'"),
                                          (["--new-tokens", "1"], "--new-tokens >= 2")])
def test_bad_settings_are_refused_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(["decode", *argv])
    assert message in capsys.readouterr().err


def test_help_shows_the_whole_description(capsys):
    with pytest.raises(SystemExit):
        bench.main(["decode", "--help"])
    out = capsys.readouterr().out
    # the whole docstring, its last sentence included (a first line cut mid-sentence was all it showed)
    lines = decode.__doc__.strip().splitlines()
    assert lines[1].startswith("measured bandwidth, in one interleaved run.")
    assert all(line in out for line in lines[:2] + lines[-2:])


def _report(**extra) -> dict:
    report = {"machine": {"cpu": "test"}, "settings": {"threads": 1, "shape": "x"}, "load_average_before": 0,
              "load_average_after": 0, "kernels": {"isa": "avx2", "features": ["avx2"]}, "slug": "test",
              "bandwidth": {"ceiling_bytes_per_s": 10e9, "matvec_bytes_per_s": 9e9, "read_bytes_per_s": 10e9,
                            "native_read_bytes_per_s": 8e9},
              "contenders": {"llminfer fast fp32": {"tokens_per_s": 30.0, "bytes_per_token": 5e8, "mbu": 1.5,
                                                    "compile_s": None}},
              "ratios": {}}
    return dict(report, **extra)


def test_a_contender_above_the_ceiling_stops_the_benchmark_and_records_nothing(tmp_path, monkeypatch, capsys):
    report = _report(ceiling_exceeded={"llminfer fast fp32": 15e9})
    monkeypatch.setattr(decode, "run", lambda args: report)
    assert bench.main(["decode", "--out", str(tmp_path)]) == 1
    assert "STOPPED: llminfer fast fp32 streamed 15.0 GB/s above its ceiling (10.0 GB/s)" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_a_prefill_above_the_matmul_ceiling_stops_the_benchmark_and_records_nothing(tmp_path, monkeypatch, capsys):
    report = _report(matmul_ceiling_exceeded={"fp32 prefill, chosen": 140e9})
    monkeypatch.setattr(decode, "run", lambda args: report)
    assert bench.main(["decode", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "STOPPED: fp32 prefill, chosen ran at 140 GFLOP/s, above the fastest matmul sampled alongside" in out
    assert not list(tmp_path.iterdir())


def test_the_bandwidth_ceiling_is_the_fastest_sample_of_any_probe():
    from llminfer.bench.decode import BandwidthCeiling

    ceiling = BandwidthCeiling(1 << 20)
    ceiling.warm(1)
    ceiling.sample(2)
    assert ceiling.samples_per_probe() == 2
    work = {label: probe.work for label, probe in ceiling.probes.items()}
    # hand-set times: "read" has the fastest single sample, "matvec" the fastest median
    for label in ceiling.samples:
        ceiling.samples[label] = [1.0, 1.0, 1.0]
    ceiling.samples["matvec"] = [0.5, 0.5, 0.6]
    ceiling.samples["read"] = [2.0, 0.25, 2.0]
    assert ceiling.rates()["read"] == work["read"] / 0.25 and ceiling.medians()["read"] == work["read"] / 2.0
    assert ceiling.medians()["matvec"] == work["matvec"] / 0.5
    assert ceiling.best() == max(work[label] / min(times) for label, times in ceiling.samples.items())


def test_a_footprint_a_cache_can_hold_gets_its_own_streaming_read_as_its_ceiling(monkeypatch):
    from llminfer.bench import measure as bench                 # the measurement layer's BandwidthCeiling

    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 8 << 20)     # a 8 MiB cache: 32 MiB is beyond it
    ceiling = bench.BandwidthCeiling(1 << 20, footprints=[3 << 20, 3 << 20, 40 << 20])
    assert sorted(ceiling.footprints) == [3]                     # one probe per size, none beyond the cache's reach
    assert ceiling.footprints[3].work == 3 << 20                 # a read of the footprint's own bytes
    ceiling.warm(1)
    ceiling.sample(2)
    assert len(ceiling.samples["footprint read, 3 MiB"]) == 2
    assert "footprint read, 3 MiB" not in ceiling.rates()        # not part of the memory's ceiling
    for label in ceiling.samples:
        ceiling.samples[label] = [1.0]
    ceiling.samples["footprint read, 3 MiB"] = [1e-6]            # the cache-sized read, far faster
    memory = ceiling.best()
    assert ceiling.for_bytes(3 << 20) == (3 << 20) / 1e-6 > memory
    assert ceiling.for_bytes(40 << 20) == memory                  # beyond the cache: the memory's ceiling
    ceiling.samples["footprint read, 3 MiB"] = [1e3]             # slower than the memory's: the faster one counts
    assert ceiling.for_bytes(3 << 20) == memory
    with pytest.raises(ValueError, match=r"no streaming read of 5 MiB.*footprints: \[3\] MiB"):
        ceiling.for_bytes(5 << 20)


def test_the_matmul_ceiling_is_the_fastest_sample_and_the_median_rate_stays_the_median():
    from llminfer.timing import CeilingProbe

    probe = CeilingProbe(lambda: None, 12.0, "twelve units of work", "cpu")
    times = [4.0, 2.0, 3.0]
    assert probe.peak_rate_of(times) == 6.0 and probe.rate_of(times) == 4.0
