"""nbval compares every committed output not marked NBVAL_IGNORE_OUTPUT, after chapters/sanitize.cfg, on whatever
machine runs the chapters (make test on a CPU, make test-gpu on CUDA). So no such output may name the device or a
measured time: this scans the committed outputs for device names, free memory and timings that neither an ignore
marker nor a sanitize rule covers. A cell whose numbers are published constants or a seeded workload, the same on
every machine, is allowed here by its id, with the reason."""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "chapters").glob("[0-9][0-9]_*.ipynb")) + sorted((ROOT / "chapters").glob("A[0-9]_*.ipynb"))

# (a GPU model named alone, as in a table of published specs, is a constant: this machine's is "NVIDIA ...")
DEVICE = re.compile(r"\b(cuda(:\d+)?|mps|NVIDIA|GeForce|Tesla|EPYC|Xeon|Ryzen|Core\(TM\))\b"
                    r"|\b\d+(\.\d+)? ?[GM]i?B free\b", re.I)
TIMING = re.compile(r"\b\d+(\.\d+)? ?(ms|µs|us|ns|s)\b|\b\d+(\.\d+)? ?(tokens|GFLOP|TFLOP|GB|MB|it)/s\b")
# cell id -> why its numbers are the same on every machine
SAME_EVERYWHERE = {
    "4820d3c2": "05: the seeded workload's arrival times, not a measurement",
    "1c712965": "10: published link and memory figures, with their sources",
    "af6d3d2b": "10: a projection from the published link figures",
    "61918664": "12: transfer times computed from the published link figures",
}


def _sanitizers() -> list[tuple[re.Pattern, str]]:
    config = configparser.ConfigParser()
    config.read(ROOT / "chapters" / "sanitize.cfg")
    return [(re.compile(config[name]["regex"]), config[name]["replace"]) for name in config.sections()]


def uncovered(nb, sanitizers) -> list[str]:
    """Lines of compared outputs that name a device, free memory or a timing after sanitizing: 'cell id: line'."""
    found = []
    for cell in nb.cells:
        if cell.cell_type != "code" or re.search(r"#\s*NBVAL_(IGNORE_OUTPUT|SKIP)", cell.source):
            continue
        if cell.get("id") in SAME_EVERYWHERE:
            continue
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            text = "".join(text) if isinstance(text, list) else text
            for regex, replace in sanitizers:
                text = regex.sub(replace, text)
            found += [f"{cell.get('id')}: {line}" for line in text.splitlines()
                      if DEVICE.search(line) or TIMING.search(line)]
    return found


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.stem for p in CHAPTERS])
def test_compared_outputs_name_no_device_and_no_timing(path):
    lines = uncovered(nbformat.read(path, 4), _sanitizers())
    assert not lines, (f"{path.name}: outputs nbval compares depend on the machine; mark the cell "
                       "# NBVAL_IGNORE_OUTPUT, start the line 'this machine:' or add a rule to chapters/sanitize.cfg:\n"
                       + "\n".join(lines[:20]))


def test_the_scan_finds_what_it_looks_for():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in ("a", "b", "# NBVAL_IGNORE_OUTPUT")])
    for cell, text in zip(nb.cells, ("prefill in 12.5 ms on cuda:0\n", "this machine: NVIDIA H100, 3.1 GiB free\n",
                                     "decode 41 tokens/s\n")):
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text)]
    lines = uncovered(nb, _sanitizers())
    assert lines == [f"{nb.cells[0].id}: prefill in 12.5 ms on cuda:0"]        # the others: sanitized, ignored
    assert SAME_EVERYWHERE.keys() <= {c.get("id") for p in CHAPTERS for c in nbformat.read(p, 4).cells}
