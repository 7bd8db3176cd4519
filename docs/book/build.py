"""`make book`: stage the committed chapters for Sphinx, build build/book/ with warnings as errors, check its links.

The committed notebooks are only read. Their copies under build/book-src/ lose the test machinery (the
`# NBVAL_*` marker lines, the placeholder that stands in for a widget's output), get their long code cells
collapsed, and show each widget as the screenshot the browser tests took of it (docs/book/widgets/).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BOOK_DIR = REPO_ROOT / "docs" / "book"
WIDGET_SHOTS = BOOK_DIR / "widgets"
CHAPTER_GLOBS = ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb")  # numbered chapters, then the appendix
NBVAL_LINE = re.compile(r"^\s*#\s*NBVAL_[A-Z_]+\s*$")
WIDGET_PLACEHOLDER = "Interactive widget: run this cell to use it."  # what llminfer.notebooks saves instead
LONG_CELL_LINES = 20  # code cells longer than this are shown collapsed
README_ROW = re.compile(r"^\|\s*`(?P<stem>[0-9A-Z][0-9]_\w+)`\s*\|\s*(?P<what>.*?)\s*\|\s*$")


def chapter_paths(chapters_dir: Path) -> list[Path]:
    """Returns the numbered chapters in order, then the appendix notebooks (A1_..., A2_...) in order."""
    return [path for pattern in CHAPTER_GLOBS for path in sorted(chapters_dir.glob(pattern))]


def widget_shot_name(stem: str, cell_id: str) -> str:
    """Returns the file name under docs/book/widgets/ of the screenshot of one widget cell. Used by tests/e2e."""
    return f"{stem}--{cell_id}.png"


def is_widget_output(output: dict) -> bool:
    """Returns True for the saved stand-in of a widget (a widget needs a live kernel to show)."""
    data = output.get("data", {})
    text = data.get("text/plain", "")
    text = "".join(text) if isinstance(text, list) else text
    return "application/vnd.jupyter.widget-view+json" in data or text.strip() == WIDGET_PLACEHOLDER


def strip_markers(source: str) -> str:
    """Returns a code cell's source without its `# NBVAL_*` lines (nbval's instructions, not the chapter's code)."""
    return "\n".join(line for line in source.split("\n") if not NBVAL_LINE.match(line)).strip("\n")


def widget_note(stem: str, cell_id: str, shots_dir: Path) -> tuple[dict, str | None]:
    """Returns the markdown cell shown under a widget cell, and the screenshot it shows (None when there is none)."""
    name = widget_shot_name(stem, cell_id)
    if (shots_dir / name).is_file():
        text = (f"![The widget working in JupyterLab, as the browser test drove it](../widgets/{name})\n\n"
                "*A screenshot: this widget is live in JupyterLab (run `make lab`, then this cell).*")
        shot = name
    else:
        text = "*An interactive widget: it is live in JupyterLab (run `make lab`, then this cell).*"
        shot = None
    return {"cell_type": "markdown", "id": f"{cell_id}-widget", "metadata": {}, "source": text}, shot


def stage_notebook(path: Path, shots_dir: Path) -> tuple[dict, list[str], list[str]]:
    """Returns the notebook as the book shows it, the widget screenshots it uses, and its widget cells lacking one."""
    nb = json.loads(path.read_text())
    cells, used, missing = [], [], []
    for index, cell in enumerate(nb["cells"]):
        cell = dict(cell)
        cell.setdefault("id", f"cell-{index:03d}")
        if cell["cell_type"] != "code":
            cells.append(cell)
            continue
        source = strip_markers("".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"])
        cell["source"] = source
        outputs = cell.get("outputs", [])
        widget = any(is_widget_output(output) for output in outputs)
        cell["outputs"] = [output for output in outputs if not is_widget_output(output)]
        metadata = dict(cell.get("metadata", {}))
        tags = list(metadata.get("tags", []))
        if source.count("\n") + 1 > LONG_CELL_LINES and "hide-input" not in tags:
            tags.append("hide-input")
        if tags:
            metadata["tags"] = tags
        cell["metadata"] = metadata
        cells.append(cell)
        if widget:
            note, shot = widget_note(path.stem, cell["id"], shots_dir)
            cells.append(note)
            (used if shot else missing).append(shot or cell["id"])
    nb["cells"] = cells
    return nb, used, missing


def chapter_title(nb: dict, stem: str) -> str:
    """Returns the text of the notebook's first `# ` heading (the stem if it has none)."""
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            for line in source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return stem


def readme_parts(readme: str) -> tuple[str, dict[str, str]]:
    """Returns the README's first screen (up to its first `## ` heading) and its chapter table, stem -> description."""
    intro = readme.split("\n## ", 1)[0].rstrip()
    rows = {}
    for line in readme.splitlines():
        match = README_ROW.match(line)
        if match:
            rows[match["stem"]] = match["what"]
    return intro, rows


def index_page(readme: str, chapters: list[tuple[str, str]]) -> str:
    """Returns index.md: the README's first screen, the chapter list linked to the pages, and the table of contents."""
    intro, descriptions = readme_parts(readme)
    for stem, _ in chapters:  # the README names notebooks as code; on the site they are pages
        intro = intro.replace(f"`chapters/{stem}.ipynb`", f"[`{stem}`](chapters/{stem}.ipynb)")
    lines = [intro, "", "## The chapters", "",
             "Each page shows the chapter's committed outputs; to run it and move its widgets, "
             "open it with `make lab`.", "", "| chapter | what it shows |", "| --- | --- |"]
    for stem, title in chapters:
        lines.append(f"| [{title}](chapters/{stem}.ipynb) | {descriptions.get(stem, '')} |")
    numbered = [stem for stem, _ in chapters if stem[0].isdigit()]
    appendix = [stem for stem, _ in chapters if not stem[0].isdigit()]
    lines += ["", "```{toctree}", ":hidden:", ":caption: Chapters", ""]
    lines += [f"chapters/{stem}" for stem in numbered] + ["```", ""]
    if appendix:
        lines += ["```{toctree}", ":hidden:", ":caption: Appendix (optional)", ""]
        lines += [f"chapters/{stem}" for stem in appendix] + ["```", ""]
    return "\n".join(lines)


def stage(src_dir: Path, repo_root: Path = REPO_ROOT, shots_dir: Path = WIDGET_SHOTS) -> dict:
    """Fills src_dir with index.md, the staged chapters, the widget screenshots and the package source; a summary."""
    if src_dir.exists():
        shutil.rmtree(src_dir)
    (src_dir / "chapters").mkdir(parents=True)
    (src_dir / "widgets").mkdir()
    paths = chapter_paths(repo_root / "chapters")
    if not paths:
        raise SystemExit(f"no chapters matching {CHAPTER_GLOBS} in {repo_root / 'chapters'}")
    chapters, used, missing = [], [], []
    for path in paths:
        nb, shots, lacking = stage_notebook(path, shots_dir)
        (src_dir / "chapters" / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False))
        chapters.append((path.stem, chapter_title(nb, path.stem)))
        used += shots
        missing += [f"{path.name} cell {cell_id}" for cell_id in lacking]
    for name in used:
        shutil.copyfile(shots_dir / name, src_dir / "widgets" / name)
    # links from a chapter into the package (../llminfer/x.py) resolve to a copy of the source, served as is
    shutil.copytree(repo_root / "llminfer", src_dir / "llminfer",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.safetensors", "*.bin", "*.gguf"))
    (src_dir / "index.md").write_text(index_page((repo_root / "README.md").read_text(), chapters))
    stale = sorted({p.name for p in shots_dir.glob("*.png")} - set(used)) if shots_dir.is_dir() else []
    return {"chapters": [stem for stem, _ in chapters], "widget_shots": used, "widgets_without_shot": missing,
            "stale_shots": stale}


def main(argv: list[str] | None = None) -> int:
    """Stages, builds and link-checks the book; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "book")
    args = parser.parse_args(argv)
    build_root = args.out.parent
    src_dir, doctrees = build_root / "book-src", build_root / "book-doctrees"
    started = time.perf_counter()
    summary = stage(src_dir)
    print(f"book: {len(summary['chapters'])} chapters, {len(summary['widget_shots'])} widget screenshots")
    for item in summary["widgets_without_shot"]:
        print(f"book: no screenshot for the widget in {item} (the page says it is live in JupyterLab); "
              f"`make test-e2e` saves one into docs/book/widgets/")
    for name in summary["stale_shots"]:
        print(f"book: docs/book/widgets/{name} matches no widget cell now; rerun `make test-e2e` and delete it")
    if args.out.exists():
        shutil.rmtree(args.out)
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
           "-c", str(BOOK_DIR), "-d", str(doctrees), str(src_dir), str(args.out)]
    status = subprocess.call(cmd, cwd=REPO_ROOT)
    if status:
        print(f"book: sphinx-build failed (status {status}); warnings count as errors", file=sys.stderr)
        return status
    from check_links import check_site

    broken, external = check_site(args.out)
    (build_root / "book-external-links.txt").write_text("".join(f"{url}\n" for url in external))
    print(f"book: {len(external)} external links, not checked (no network here); "
          f"listed in {build_root / 'book-external-links.txt'}")
    for problem in broken:
        print(f"book: broken link: {problem}", file=sys.stderr)
    pages = [page for page in args.out.rglob("*.html") if "_static" not in page.relative_to(args.out).parts]
    chapters = [page for page in pages if page.parent.name == "chapters"]
    print(f"book: {len(pages)} HTML pages ({len(chapters)} chapters) in {args.out} "
          f"in {time.perf_counter() - started:.1f} s")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.path.insert(0, str(BOOK_DIR))
    raise SystemExit(main())
