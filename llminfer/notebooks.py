"""Re-execute the handbook's notebooks in place and normalise them (`python -m llminfer.notebooks FILES...`)."""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

# Widget outputs carry random model ids and live state that means nothing once the kernel is gone.
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
# Cell metadata that changes on every run (timings) or only records how a reader left the view.
VOLATILE_CELL_METADATA = ("execution", "collapsed", "scrolled", "ExecuteTime")
# Notebook-level metadata kept; everything else (widget state, machine-specific versions) is dropped.
# What a saved widget output says instead of its repr (the live widget needs a running kernel).
WIDGET_PLACEHOLDER = "Interactive widget: run this cell to use it."
WIDGET_REPR = re.compile(r"^[A-Z]\w*\(")  # e.g. "VBox(children=(...))"
KEPT_LANGUAGE_INFO = ("name", "mimetype", "file_extension", "pygments_lexer", "codemirror_mode", "nbconvert_exporter")

REPO_ROOT = Path(__file__).resolve().parent.parent


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
                    # a progress bar's text ("100%|███| 8/8") is worth keeping; a widget's repr is not
                    text = "".join(output.data.get("text/plain", ""))
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


def execute(nb: nbformat.NotebookNode, cwd: Path, timeout: int = 600, kernel_name: str = "python3",
            allow_errors: bool = False) -> nbformat.NotebookNode:
    """Return nb executed top to bottom in a fresh kernel whose working directory is cwd."""
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name, allow_errors=allow_errors,
                            record_timing=False, store_widget_state=True,  # Output widgets need it; normalise drops it
                            resources={"metadata": {"path": str(cwd)}})
    client.execute()
    return nb


def run_notebook(path: Path, timeout: int = 600, kernel_name: str = "python3", allow_errors: bool = False) -> float:
    """Re-execute the notebook at path, normalise it, write it back; return the wall time in seconds."""
    path = Path(path).resolve()
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    execute(nb, cwd=path.parent, timeout=timeout, kernel_name=kernel_name, allow_errors=allow_errors)
    elapsed = time.perf_counter() - start
    nb = normalise(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    """Execute each notebook named on the command line; return the exit status (1 if any failed)."""
    parser = argparse.ArgumentParser(prog="python -m llminfer.notebooks", description=__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="notebooks to re-execute in place")
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed per cell (default 600)")
    parser.add_argument("--kernel", default="python3", help="kernel name (default python3)")
    parser.add_argument("--allow-errors", action="store_true", help="keep going past a failing cell")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}; pass paths such as chapters/00_getting_started.ipynb")
    failed = []
    for path in args.files:
        try:
            elapsed = run_notebook(path, timeout=args.timeout, kernel_name=args.kernel, allow_errors=args.allow_errors)
        except CellExecutionError as err:
            failed.append(str(path))
            print(f"{path}: FAILED (notebook left unchanged)\n{err}", file=sys.stderr)
            continue
        print(f"{path}: {elapsed:.1f} s", flush=True)
    if failed:
        print(f"{len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
