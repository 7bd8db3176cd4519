"""The benchmark's engine section: the engine's batched decode and one fast request, interleaved, as a report."""
from __future__ import annotations

import pytest

from llminfer import bench
from llminfer.bench.engine_decode import EngineSettings, engine_section, engine_table


def test_the_engine_section_reports_both_contenders_and_their_ratio():
    settings = EngineSettings(shape="tiny-capitals", requests=3, prompt_len=6, new_tokens=5, rounds=2, threads=1,
                              compile=False)
    report = engine_section(settings, log=lambda message: None)
    assert report["settings"]["requests"] == 3 and report["threads"] == 1
    assert len(report["single_round_tokens_per_s"]) == len(report["engine_round_tokens_per_s"]) == 2
    assert report["ratio"] == pytest.approx(report["engine_tokens_per_s"] / report["single_tokens_per_s"])
    assert [round(r, 9) for r in report["round_ratios"]] == [
        round(b / s, 9) for b, s in zip(report["engine_round_tokens_per_s"], report["single_round_tokens_per_s"])]
    # every round's decode steps with all three requests decoding: new_tokens - 1 of them (the first token
    # comes from the prefill), for the warm-up-free rounds
    assert report["engine_decode_steps_timed"] == 2 * (5 - 1)
    text = engine_table(report)
    assert "engine, 3 requests" in text and "one fast request" in text and "ratio" in text


@pytest.mark.parametrize("changes, message", [
    (dict(requests=0), r"requests=0 must be a positive integer"),
    (dict(new_tokens=2), r"new_tokens=2 must be an integer >= 3"),
    (dict(threads=0), r"threads=0 must be a positive integer or None"),
    (dict(dtype="float16"), r"dtype='float16' must be 'float32' or 'bfloat16'"),
])
def test_bad_settings_are_refused_before_anything_runs(changes, message):
    with pytest.raises(ValueError, match=message):
        engine_section(EngineSettings(**changes), log=lambda message: None)


def test_the_engine_command_refuses_bad_input_with_status_2(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["engine", "--repeats", "0"])
    assert stop.value.code == 2 and "--repeats 0 and --threads 1 must be positive integers" in capsys.readouterr().err


def test_the_engine_command_prints_the_targets_and_writes_its_report(tmp_path, capsys, monkeypatch):
    from llminfer.bench import engine

    found = {"machine": {"cpu": "test"}, "ratios": {"continuous_over_sequential": 3.5},
             "targets": {"continuous_over_sequential": {"target": 3.0, "measured": 3.5, "met": True},
                         "continuous_over_static": {"target": 1.5, "measured": 1.2, "met": False}}}
    monkeypatch.setattr(engine, "run", lambda device, repeats: dict(found, repeats=repeats))
    assert bench.main(["engine", "--device", "cpu", "--repeats", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "continuous_over_sequential: 3.50x (target 3.0x, met)" in printed
    assert "continuous_over_static: 1.20x (target 1.5x, short)" in printed
    (path,) = tmp_path.glob("engine-cpu*.json")
    import json
    assert json.loads(path.read_text())["repeats"] == 2
