"""make test-gpu's CPU-side logic: which steps run and in what order, the refusal without CUDA, the time budget,
the chapters step's bookkeeping and the one report folder."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llminfer import bench
from llminfer.bench import gpu_check
from llminfer.bench.gpu_check import StepResult

ROOT = Path(__file__).resolve().parents[2]


def test_steps_are_chosen_by_name_and_always_run_in_the_checks_order():
    assert gpu_check.select_steps(None) == ["pytest", "flex", "graphs", "chapters", "bench"]
    assert gpu_check.select_steps("") == list(gpu_check.STEPS)
    assert gpu_check.select_steps("bench, flex") == ["flex", "bench"]
    with pytest.raises(ValueError, match=r"unknown step\(s\) 'flexx'.*choose from pytest, flex, graphs"):
        gpu_check.select_steps("flexx,graphs")


def test_without_cuda_the_check_is_refused_with_what_to_do():
    assert gpu_check.cuda_refusal(True, 1, "2.13.0", "12.8") is None
    cpu_only = gpu_check.cuda_refusal(False, 0, "2.13.0+cpu", None)
    assert "needs an NVIDIA GPU" in cpu_only and "CPU-only build" in cpu_only and "make test" in cpu_only
    hidden = gpu_check.cuda_refusal(True, 0, "2.13.0", "12.8")
    assert "no CUDA device is visible" in hidden and "CUDA_VISIBLE_DEVICES" in hidden


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_command_refuses_on_this_machine_before_creating_anything(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "llminfer.bench", "gpu", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert re.search(r"error: make test-gpu needs an NVIDIA GPU.*torch\.cuda\.is_available\(\) is False",
                     done.stderr)
    assert not out.exists()


def test_bad_arguments_exit_2_with_one_line(capsys):
    assert bench.main(["gpu", "--steps", "nbval"]) == 2
    assert "unknown step(s) 'nbval'" in capsys.readouterr().err
    assert bench.main(["gpu", "--budget-s", "0"]) == 2
    assert "budget_s must be positive" in capsys.readouterr().err


def test_the_budget_caps_each_step_and_keeps_the_whole_under_ten_minutes():
    limits = gpu_check.step_budgets(list(gpu_check.STEPS), gpu_check.DEFAULT_BUDGET_S)
    assert sum(limits.values()) <= gpu_check.DEFAULT_BUDGET_S < 600
    halved = gpu_check.step_budgets(list(gpu_check.STEPS), sum(gpu_check.STEP_LIMIT_S.values()) / 2)
    assert all(halved[s] == pytest.approx(gpu_check.STEP_LIMIT_S[s] / 2) for s in gpu_check.STEPS)
    assert gpu_check.step_budgets(["flex"], 1000) == {"flex": gpu_check.STEP_LIMIT_S["flex"]}


def _fake_runners(monkeypatch, outcomes, calls, seconds=None):
    for name in gpu_check.STEPS:
        def runner(out, limit_s, _name=name):
            calls.append((_name, limit_s))
            assert (out / "report.json").exists() == bool(calls[:-1])      # written after every earlier step
            if seconds:
                clock[0] += seconds
            return StepResult(_name, outcomes.get(_name, "passed"), 1.5, f"{_name} ran", {"n": len(calls)})
        monkeypatch.setitem(gpu_check.RUNNERS, name, runner)
    clock = [0.0]
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(gpu_check, "machine_facts", lambda: {"gpu": "a test GPU", "torch": "x"})


def test_the_check_runs_the_chosen_steps_in_order_and_writes_one_report(tmp_path, monkeypatch):
    calls = []
    _fake_runners(monkeypatch, {"graphs": "failed"}, calls)
    results = gpu_check.run_check(tmp_path / "out", ["flex", "graphs", "bench"], 300)
    assert [c[0] for c in calls] == ["flex", "graphs", "bench"]
    assert [r.status for r in results] == ["passed", "failed", "passed"]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["passed"] is False and report["machine"]["gpu"] == "a test GPU"
    assert [s["name"] for s in report["steps"]] == ["flex", "graphs", "bench"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| graphs | failed | 1.5 | graphs ran |" in summary and "2 of 3 steps passed." in summary


def test_steps_past_the_budget_are_skipped_and_say_so(tmp_path, monkeypatch):
    calls = []
    _fake_runners(monkeypatch, {}, calls, seconds=200)        # every step takes 200 s of a 450 s budget
    results = gpu_check.run_check(tmp_path, list(gpu_check.STEPS), 450)
    assert [c[0] for c in calls] == ["pytest", "flex", "graphs"]
    assert calls[2][1] == pytest.approx(min(gpu_check.step_budgets(list(gpu_check.STEPS), 450)["graphs"], 50))
    assert [r.status for r in results[3:]] == ["skipped", "skipped"]
    assert results[3].detail == "no time left in the budget"
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is True      # skipped is not failed


def test_the_chapters_step_runs_every_chapter_and_names_the_ones_that_fail(tmp_path, monkeypatch):
    seen = []

    def fake_run(command, log, limit_s, env=None):
        seen.append(command[-1])
        assert command[command.index("--nbval-sanitize-with") + 1] == "chapters/sanitize.cfg"   # strict nbval
        log.write_text("log")
        return ("failed" if command[-1].endswith("06_paged_attention.ipynb") else "passed"), 2.0, 0
    monkeypatch.setattr(gpu_check, "_run", fake_run)
    result = gpu_check._chapters_step(tmp_path, 100, workers=3)
    chapters = gpu_check.chapter_paths()
    assert sorted(seen) == sorted(str(p.relative_to(ROOT)) for p in chapters)
    assert [p.name for p in chapters][:2] == ["00_getting_started.ipynb", "01_prefill_and_decode.ipynb"]
    assert chapters[-1].name.startswith("A")                           # the appendices after the numbered ones
    assert result.status == "failed" and result.detail.endswith("not: 06_paged_attention.ipynb")
    assert result.figures["chapters"]["05_batching.ipynb"] == {"status": "passed", "seconds": 2.0}


def test_an_inner_step_fails_when_its_figures_say_so(tmp_path, monkeypatch):
    def fake_run(command, log, limit_s, env=None):
        assert command[-4:] == ["--inner", "flex", "--out", str(tmp_path)]
        (tmp_path / "flex.json").write_text(json.dumps({"ok": False, "failures": ["no step reached 128 queries"]}))
        return "passed", 3.0, 0
    monkeypatch.setattr(gpu_check, "_run", fake_run)
    result = gpu_check._inner_step("flex", tmp_path, 60)
    assert result.status == "failed" and result.detail == "no step reached 128 queries"
    assert result.figures["failures"] == ["no step reached 128 queries"]


def test_the_default_folder_is_one_per_run_under_data_benchmarks():
    import datetime
    when = datetime.datetime(2026, 12, 1, 22, 5, 9, tzinfo=datetime.timezone.utc)
    assert gpu_check.default_out(when) == ROOT / "data" / "benchmarks" / "gpu-check-20261201-220509"


def test_make_has_the_target():
    text = (ROOT / "Makefile").read_text()
    assert re.search(r"^test-gpu:.*\n\t\$\(PY\) -m llminfer\.bench gpu", text, re.M)
