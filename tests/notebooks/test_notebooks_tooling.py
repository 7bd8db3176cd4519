"""The notebook runner: executes in place, normalises outputs, reports failures without touching the file."""

import asyncio
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from llminfer import notebooks

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, cells) -> Path:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


def test_normalise_drops_widget_state_counts_from_one_and_scrubs_paths():
    repo = "/some/checkout/llminfer"
    nb = new_notebook(cells=[
        new_markdown_cell("# title"),
        new_code_cell("x = 1", execution_count=7, metadata={"execution": {"iopub.status.busy": "2026"},
                                                          "tags": ["keep"]}),
        new_code_cell("", execution_count=None),
        new_code_cell("x", execution_count=9, outputs=[
            new_output("execute_result", data={"text/plain": f"'{repo}/chapters'"}, execution_count=9),
            new_output("display_data", data={"text/plain": "VBox()",
                                             notebooks.WIDGET_VIEW_MIME: {"model_id": "abc"}}),
            new_output("display_data", data={notebooks.WIDGET_VIEW_MIME: {"model_id": "def"}}),
            new_output("stream", name="stdout", text=f"loaded {repo}/data/models/tiny\n"),
        ]),
    ])
    nb.metadata["widgets"] = {notebooks.WIDGET_STATE_MIME: {"state": {}}}
    nb.metadata["language_info"] = {"name": "python", "version": "3.12.3"}

    out = notebooks.normalise(nb, replacements=[(repo, "<repo>")])

    assert "widgets" not in out.metadata
    assert out.metadata["language_info"] == {"name": "python"}
    code = [c for c in out.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, None, 2]
    assert "execution" not in code[0].metadata and code[0].metadata["tags"] == ["keep"]
    outputs = code[2].outputs
    assert len(outputs) == 4
    assert outputs[0].execution_count == 2
    assert outputs[0].data["text/plain"] == "'<repo>/chapters'"
    for widget_output in outputs[1:3]:
        assert widget_output.data == {"text/plain": notebooks.WIDGET_PLACEHOLDER}
    assert outputs[3].text == "loaded <repo>/data/models/tiny\n"
    assert nb.cells[1].execution_count == 7, "normalise must not modify its input"
    nbformat.validate(out)


def test_path_replacements_put_longer_paths_first():
    pairs = notebooks.path_replacements(REPO)
    lengths = [len(path) for path, _ in pairs]
    assert lengths == sorted(lengths, reverse=True)
    assert (str(REPO), "<repo>") in pairs
    assert notebooks.scrub_text(f"{REPO}/x", pairs) == "<repo>/x"


def test_run_executes_in_place_in_the_notebook_folder(tmp_path):
    chapters = tmp_path / "chapters"
    chapters.mkdir()
    (chapters / "marker.txt").write_text("found me")
    path = _write(chapters / "00_tiny.ipynb", [
        new_markdown_cell("A tiny notebook."),
        new_code_cell("import os\nprint(open('marker.txt').read())"),
        new_code_cell("print(os.getcwd())"),
        new_code_cell("import ipywidgets\nipywidgets.IntSlider(value=3)"),
        new_code_cell("6 * 7"),
    ])

    run = notebooks.run_notebook(path, timeout=60)

    assert run["seconds"] > 0 and run["others_per_core"] >= 0 and run["own_per_core"] > 0
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == [1, 2, 3, 4]
    assert code[0].outputs[0].text == "found me\n"
    cwd_line = code[1].outputs[0].text
    assert str(tmp_path) not in cwd_line and cwd_line.endswith("/chapters\n")
    assert "widgets" not in nb.metadata
    assert [output.data for output in code[2].outputs] == [{"text/plain": notebooks.WIDGET_PLACEHOLDER}]
    assert code[3].outputs[0].data["text/plain"] == "42"
    assert code[3].outputs[0].execution_count == 4
    assert all("execution" not in c.metadata for c in code)


def test_main_reports_a_failing_notebook_and_leaves_it_unchanged(tmp_path, capsys):
    path = _write(tmp_path / "broken.ipynb", [new_code_cell("raise ValueError('boom')")])
    before = path.read_text()

    status = notebooks.main([str(path), "--timeout", "60", "--allow-busy"])

    assert status == 1
    assert path.read_text() == before
    assert "boom" in capsys.readouterr().err


def test_main_refuses_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        notebooks.main([str(tmp_path / "nope.ipynb")])
    assert "no such notebook" in capsys.readouterr().err


def test_progress_bars_leave_no_frozen_output_and_output_widgets_execute(tmp_path):
    # a notebook progress bar's saved text is its first state: "0%|", frozen on the page; normalise drops it
    nb = new_notebook(cells=[new_code_cell("x", execution_count=1, outputs=[
        new_output("display_data", data={"text/plain": "requests:   0%|          | 0/20 [00:00<?, ?it/s]",
                                         notebooks.WIDGET_VIEW_MIME: {"model_id": "p"}}),
        new_output("stream", name="stdout", text="done\n")])])
    assert [output.get("text") for output in notebooks.normalise(nb, replacements=[]).cells[0].outputs] == ["done\n"]

    # a recorded chapter: the bar's output is gone (so a chapter keeps bars out of the cells nbval compares)
    path = _write(tmp_path / "out.ipynb", [
        new_code_cell("from tqdm.auto import tqdm\nfor i in tqdm(range(3), desc='steps'):\n    pass\nprint('done')"),
        new_code_cell("import ipywidgets as w\nout = w.Output()\ndisplay(out)\nwith out:\n    print('inside')")])
    assert notebooks.main([str(path), "--allow-busy"]) == 0
    saved = nbformat.read(path, as_version=4)
    assert "widgets" not in saved.metadata
    bar_cell, widget_cell = saved.cells
    assert [output.get("text") for output in bar_cell.outputs] == ["done\n"], bar_cell.outputs
    assert widget_cell.outputs[0].data == {"text/plain": notebooks.WIDGET_PLACEHOLDER}


class _LateChannel:
    """A channel whose wait sees a message only when it starts or when it times out (a missed wake-up)."""

    def __init__(self, arrives_s):
        self.arrives = None if arrives_s is None else time.monotonic() + arrives_s
        self.waits = []

    def _here(self):
        return self.arrives is not None and time.monotonic() >= self.arrives

    async def get_msg(self, timeout=None):
        self.waits.append(timeout)
        if self._here():
            return {"msg": 1}
        await asyncio.sleep(timeout)                # never woken by the arrival itself
        if self._here():
            return {"msg": 1}
        raise queue.Empty


def test_channel_waits_in_slices_see_a_message_soon_after_it_arrives():
    channel = _LateChannel(arrives_s=0.3)
    notebooks.poll_in_slices(channel, slice_s=0.1)
    start = time.monotonic()
    assert asyncio.run(channel.get_msg(timeout=30)) == {"msg": 1}
    assert time.monotonic() - start < 2.0           # not at the 30 s timeout
    assert max(channel.waits) <= 0.1 and len(channel.waits) >= 3
    # nothing arrives: Empty at the caller's timeout, not before
    silent = _LateChannel(arrives_s=None)
    notebooks.poll_in_slices(silent, slice_s=0.1)
    start = time.monotonic()
    with pytest.raises(queue.Empty):
        asyncio.run(silent.get_msg(timeout=0.5))
    assert 0.5 <= time.monotonic() - start < 2.0
    # no timeout: it keeps waiting until the message comes
    later = _LateChannel(arrives_s=0.4)
    notebooks.poll_in_slices(later, slice_s=0.1)
    assert asyncio.run(later.get_msg()) == {"msg": 1}
    assert all(wait == 0.1 for wait in later.waits)


def test_load_meter_counts_its_own_children_as_its_own():
    burn = "import time\nend = time.process_time() + 1.5\nwhile time.process_time() < end: pass"
    with notebooks.LoadMeter(interval_s=0.1) as meter:
        subprocess.run([sys.executable, "-c", burn], check=True)
    # the child burned 1.5 CPU-seconds, however long the machine's load made it take
    wall_cpus = meter.cpus
    assert meter.own_per_core * wall_cpus > 0, meter.own_per_core
    own_cpu_s = meter.own_per_core * wall_cpus * meter.wall_s
    assert own_cpu_s >= 1.2, f"the meter saw {own_cpu_s:.2f} CPU-s of the 1.5 its child used"


def test_load_meter_sees_a_process_that_is_not_its_own():
    # a burner started by a shell that exits at once: it belongs to init, not to this process
    burn = f"{sys.executable} -c 'import time\nend = time.time() + 4\nwhile time.time() < end: pass' &"
    subprocess.run(["sh", "-c", burn], check=True)
    time.sleep(0.3)
    with notebooks.LoadMeter(interval_s=0.2) as meter:
        time.sleep(2.0)
    assert meter.others_per_core * meter.cpus >= 0.5, meter.others_per_core
    assert meter.own_per_core * meter.cpus < 0.5, meter.own_per_core


def test_wait_until_quiet_waits_then_refuses_saying_why():
    clock = iter(range(1000))
    loads = iter([2.0, 1.0, 0.4])
    assert notebooks.wait_until_quiet(wait_s=60, poll_s=1, clock=lambda: next(clock), sleep=lambda s: None,
                                      load=lambda: next(loads)) == 0.4
    clock = iter(range(1000))
    with pytest.raises(notebooks.Busy, match=r"load average 0\.90 per core stayed above 0\.5 for 3 s.*--allow-busy"):
        notebooks.wait_until_quiet(wait_s=3, poll_s=1, clock=lambda: next(clock), sleep=lambda s: None,
                                   load=lambda: 0.9)


def test_a_chapter_run_beside_other_work_is_not_written(tmp_path, monkeypatch):
    class NoisyNeighbours(notebooks.LoadMeter):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.others_per_core = 0.9

    monkeypatch.setattr(notebooks, "LoadMeter", NoisyNeighbours)
    monkeypatch.setattr(notebooks, "load_per_core", lambda: 0.1)
    path = _write(tmp_path / "01_timed.ipynb", [new_code_cell("1 + 1")])
    before = path.read_text()
    with pytest.raises(notebooks.Busy, match=r"other processes used 0\.90 of each CPU while 01_timed.ipynb ran"):
        notebooks.run_notebook(path, timeout=60, allow_busy=False)
    assert path.read_text() == before
    run = notebooks.run_notebook(path, timeout=60, allow_busy=True)
    assert run["others_per_core"] == 0.9 and path.read_text() != before
