"""Re-execute the handbook's notebooks in place and normalise them (`python -m llminfer.notebooks FILES...`)."""

from __future__ import annotations

import argparse
import copy
import os
import queue
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from .timing import load_per_core

# Widget outputs carry random model ids and live state that means nothing once the kernel is gone.
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
# Cell metadata that changes on every run (timings) or only records how a reader left the view.
VOLATILE_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")
# Notebook-level metadata kept; everything else (widget state, machine-specific versions) is dropped.
# What a saved widget output says instead of its repr (the live widget needs a running kernel).
WIDGET_PLACEHOLDER = "Interactive widget: run this cell to use it."
WIDGET_REPR = re.compile(r"^[A-Z]\w*\(")  # e.g. "VBox(children=(...))"
# A notebook progress bar's saved text is its state when it was drawn ("requests:   0%|   | 0/20"), never its
# end: a frozen bar on the page. Such outputs are dropped; the live bar still shows while a cell runs.
PROGRESS_BAR = re.compile(r"^[^\n|]*\d+%\|")
KEPT_LANGUAGE_INFO = ("name", "mimetype", "file_extension", "pygments_lexer", "codemirror_mode", "nbconvert_exporter")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Outputs are recorded on a quiet machine: above this load per core, timings say more about the neighbours.
BUSY_PER_CORE = 0.5


class Busy(RuntimeError):
    """The machine was too busy to record a chapter's timings."""


def _cpu_ticks() -> tuple[int, int]:
    """Return (busy ticks, number of CPUs) summed over the machine's CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as stat:
        lines = stat.read().splitlines()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in lines[0].split()[1:9])
    return user + nice + system + irq + softirq + steal, sum(1 for line in lines if re.match(r"cpu\d+ ", line))


def _process_ticks() -> dict[int, tuple[int, int]]:
    """Return {pid: (parent pid, user + system ticks)} for every process whose stat can be read."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()   # after "pid (comm)", which may hold spaces
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    return table


class LoadMeter:
    """Measures the CPU that other processes used while this one (and the kernels it started) ran a chapter.

    The load average cannot tell: a chapter that keeps both cores busy raises it itself. So the meter samples the
    machine's busy time from /proc/stat and subtracts what this process and its descendants used.
    """

    def __init__(self, interval_s: float = 0.5):
        self.interval_s = interval_s
        self._first: dict[int, int] = {}
        self._last: dict[int, int] = {}
        self._started = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def _sample(self) -> None:
        table = _process_ticks()
        mine, frontier = set(), [os.getpid()]
        children: dict[int, list[int]] = {}
        for pid, (parent, _) in table.items():
            children.setdefault(parent, []).append(pid)
        while frontier:
            pid = frontier.pop()
            if pid in mine:
                continue
            mine.add(pid)
            frontier.extend(children.get(pid, []))
        for pid in mine:
            if pid in table:
                # a process first seen mid-run was born during it: all its ticks are the chapter's
                self._first.setdefault(pid, table[pid][1] if not self._started else 0)
                self._last[pid] = table[pid][1]
        self._started = True

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "LoadMeter":
        self._sample()
        self._busy0, self.cpus = _cpu_ticks()
        self._wall0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        busy, _ = _cpu_ticks()
        wall = self.wall_s = max(time.monotonic() - self._wall0, 1e-9)
        hz = os.sysconf("SC_CLK_TCK")
        own = sum(self._last[pid] - self._first.get(pid, 0) for pid in self._last)
        self.own_per_core = own / hz / wall / self.cpus
        self.others_per_core = max(0.0, (busy - self._busy0 - own) / hz / wall / self.cpus)


def wait_until_quiet(limit: float = BUSY_PER_CORE, wait_s: float = 300.0, poll_s: float = 5.0,
                     clock=time.monotonic, sleep=time.sleep, load=None) -> float:
    """Return the load per core once it is at most limit; raise Busy if it stays above it for wait_s seconds."""
    load = load or load_per_core
    deadline = clock() + wait_s
    while True:
        now_load = load()
        if now_load <= limit:
            return now_load
        if clock() >= deadline:
            raise Busy(f"load average {now_load:.2f} per core stayed above {limit} for {wait_s:.0f} s; stop the other "
                       f"jobs (or pass --allow-busy to record anyway, and say so)")
        sleep(poll_s)


def path_replacements(repo_root: Path | None = None) -> list[tuple[str, str]]:
    """Return (absolute path, placeholder) pairs to scrub from outputs, longest path first."""
    repo_root = Path(repo_root or REPO_ROOT).resolve()
    pairs = {
        str(repo_root): "<repo>",
        str(Path.home().resolve()): "~",
        str(Path(tempfile.gettempdir()).resolve()): "<tmp>",
    }
    # A bare "/" home or tmp would replace every slash; skip such degenerate entries.
    pairs = {path: tag for path, tag in pairs.items() if len(path) > 1}
    return sorted(pairs.items(), key=lambda pair: len(pair[0]), reverse=True)


def scrub_text(text: str, replacements: list[tuple[str, str]]) -> str:
    """Return text with every absolute path in replacements swapped for its placeholder."""
    for path, tag in replacements:
        text = text.replace(path, tag)
    return text


def _scrub(value, replacements):
    """Return value (str, list of str, dict) with paths scrubbed; other types unchanged."""
    if isinstance(value, str):
        return scrub_text(value, replacements)
    if isinstance(value, list):
        return [_scrub(item, replacements) for item in value]
    if isinstance(value, dict):
        return {key: _scrub(item, replacements) for key, item in value.items()}
    return value


def normalise(nb: nbformat.NotebookNode, replacements: list[tuple[str, str]] | None = None) -> nbformat.NotebookNode:
    """Return a copy of nb with no widget state, counts from 1, no volatile metadata and no absolute paths."""
    nb = copy.deepcopy(nb)
    replacements = path_replacements() if replacements is None else replacements
    nb.metadata.pop("widgets", None)
    language_info = nb.metadata.get("language_info")
    if language_info is not None:
        nb.metadata["language_info"] = {k: v for k, v in language_info.items() if k in KEPT_LANGUAGE_INFO}
    count = 0
    for cell in nb.cells:
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        has_run = cell.execution_count is not None or bool(cell.outputs)
        count += has_run
        cell.execution_count = count if has_run else None
        outputs = []
        for output in cell.outputs:
            if "data" in output:
                output.data.pop(WIDGET_STATE_MIME, None)
                if output.data.pop(WIDGET_VIEW_MIME, None) is not None:
                    text = "".join(output.data.get("text/plain", ""))
                    if PROGRESS_BAR.match(text):
                        continue
                    keep = text and not WIDGET_REPR.match(text)
                    output.data = nbformat.from_dict({"text/plain": text if keep else WIDGET_PLACEHOLDER})
                output.data = nbformat.from_dict(_scrub(dict(output.data), replacements))
            if output.get("output_type") == "execute_result":
                output.execution_count = count
            for key in ("text", "traceback", "evalue"):
                if key in output:
                    output[key] = _scrub(output[key], replacements)
            outputs.append(output)
        cell.outputs = outputs
    return nb


# How long one wait on a kernel channel lasts before it looks at the socket again
POLL_SLICE_S = 0.25


def poll_in_slices(channel, slice_s: float = POLL_SLICE_S) -> None:
    """Makes an async kernel-client channel wait for a message in waits of at most slice_s seconds, each looking at
    the socket afresh, up to the caller's timeout (queue.Empty after it; none: for ever). A wait on the socket can
    miss a message that has arrived and see it only when the wait times out: in three full test runs of nine
    (ipykernel 7.4 and 6.31 alike), the execute reply of a one-cell notebook with an Output widget was read at
    about 601 s, just past the cell's 600 s timeout, and the cell then passed."""
    get_msg = channel.get_msg

    async def sliced(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = slice_s if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(timeout=min(slice_s, left))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    channel.get_msg = sliced


class _Client(NotebookClient):
    """nbclient's client, its shell and IOPub channels waiting in slices (`poll_in_slices`)."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        for channel in (kc.shell_channel, kc.iopub_channel):
            poll_in_slices(channel)
        return kc


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600, kernel_name: str = "python3",
            allow_errors: bool = False) -> nbformat.NotebookNode:
    """Return nb executed top to bottom in a fresh kernel whose working directory is cwd."""
    client = _Client(nb, timeout=timeout, kernel_name=kernel_name, allow_errors=allow_errors,
                     record_timing=False, store_widget_state=True,  # Output widgets need it; normalise drops it
                     resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def run_notebook(path: Path, timeout: int = 600, kernel_name: str = "python3", allow_errors: bool = False,
                 allow_busy: bool = True, wait_s: float = 300.0) -> dict:
    """Re-execute the notebook at path, normalise it, write it back; return its wall time and the load it met.

    Unless allow_busy, it first waits for the machine to be quiet, and refuses (Busy, file untouched) when other
    processes used more than BUSY_PER_CORE of the CPUs while the chapter ran.
    """
    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    before = load_per_core() if allow_busy else wait_until_quiet(wait_s=wait_s)
    start = time.perf_counter()
    with LoadMeter() as meter:
        execute(nb, cwd=path.parent, timeout=timeout, kernel_name=kernel_name, allow_errors=allow_errors)
    elapsed = time.perf_counter() - start
    run = {"seconds": elapsed, "load_before_per_core": before, "others_per_core": meter.others_per_core,
           "own_per_core": meter.own_per_core}
    if not allow_busy and meter.others_per_core > BUSY_PER_CORE:
        raise Busy(f"other processes used {meter.others_per_core:.2f} of each CPU while {path.name} ran (limit "
                   f"{BUSY_PER_CORE}); its outputs were not written. Stop the other jobs and run it again, or pass "
                   f"--allow-busy")
    nb = normalise(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return run


def main(argv: list[str] | None = None) -> int:
    """Execute each notebook named on the command line; return the exit status (1 if any failed)."""
    parser = argparse.ArgumentParser(prog="python -m llminfer.notebooks", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="notebooks to re-execute in place")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--kernel", default="python3", help="kernel name (default python3)")
    parser.add_argument("--allow-errors", action="store_true", help="keep going past a failing cell")
    parser.add_argument("--allow-busy", action="store_true",
                        help=f"record even when the load is above {BUSY_PER_CORE} per core (timings will show it)")
    parser.add_argument("--wait", type=float, default=300.0,
                        help="seconds to wait for a quiet machine before each chapter (default 300)")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}; pass paths such as chapters/00_getting_started.ipynb")
    failed = []
    for path in args.files:
        try:
            run = run_notebook(path, timeout=args.timeout, kernel_name=args.kernel, allow_errors=args.allow_errors,
                               allow_busy=args.allow_busy, wait_s=args.wait)
        except (CellExecutionError, Busy) as err:
            failed.append(str(path))
            print(f"{path}: FAILED (notebook left unchanged)\n{err}", file=sys.stderr)
            continue
        print(f"{path}: {run['seconds']:.1f} s, load before {run['load_before_per_core']:.2f} per core, other "
              f"processes {run['others_per_core']:.2f} per core while it ran", flush=True)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
