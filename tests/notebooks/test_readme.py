"""The README as the front door: its size, its one chapter table (which the website's index reads), its links, and
the performance records' generated tables (docs/performance/build.py) in step with data/benchmarks/."""
from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_BYTES = 15_000
CHAPTER_GLOBS = ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb")   # as docs/book/build.py finds the chapters
TABLE_HEADER = "| chapter | what it shows |"
ROW_STEM = re.compile(r"^\|\s*`(?P<stem>[0-9A-Z][0-9]_\w+)`\s*\|")
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def _load(path: Path, name: str):
    """Imports a script of docs/ by path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def chapter_stems() -> list[str]:
    """The committed chapters: numbered ones, then the appendix."""
    return [p.stem for pattern in CHAPTER_GLOBS for p in sorted((ROOT / "chapters").glob(pattern))]


def chapter_table(text: str) -> tuple[list[str], list[str]]:
    """Returns (the table's lines from its header to the first line that is not a row, every chapter row anywhere)."""
    lines = text.splitlines()
    assert lines.count(TABLE_HEADER) == 1, f"README.md needs exactly one chapter table headed {TABLE_HEADER!r}"
    start = lines.index(TABLE_HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end], [line for line in lines if ROW_STEM.match(line)]


def github_anchor(heading: str) -> str:
    """Returns the anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = CODE_SPAN.sub(lambda m: m.group(0)[1:-1], heading.strip().lower())
    text = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Returns the anchors of a markdown file's headings (outside code fences)."""
    found = set()
    for line in FENCE.sub("", markdown).splitlines():
        if line.startswith("#"):
            found.add(github_anchor(line.lstrip("#")))
    return found


def relative_links(text: str) -> list[str]:
    """Returns the links of some markdown that point inside the repository (not web addresses, not in code)."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    return [m["target"] for m in LINK.finditer(text) if not re.match(r"[a-z]+:", m["target"])]


def broken_links(path: Path) -> list[str]:
    """Returns each relative link of a markdown file whose file, or heading anchor in a markdown file, is missing."""
    broken = []
    for target in relative_links(path.read_text()):
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved.read_text()):
            broken.append(f"{target} (no heading with that anchor)")
    return broken


def test_readme_is_a_front_door_of_at_most_15000_bytes():
    size = len(README.read_bytes())
    assert size <= MAX_README_BYTES, (
        f"README.md is {size} bytes, over {MAX_README_BYTES}; move records to docs/performance/ and "
        "investigations to docs/investigations/")


def test_the_chapter_table_is_one_unbroken_table_with_a_row_for_every_chapter():
    table, rows = chapter_table(README.read_text())
    outside = [row for row in rows if row not in table]
    assert not outside, f"chapter rows after a break in the table (a blank or other line): {outside}"
    width = table[0].count("|")
    assert table[1] == "| --- | --- |" and all(line.count("|") == width for line in table), table
    listed = [ROW_STEM.match(row)["stem"] for row in table[2:]]
    assert listed == chapter_stems(), f"table rows {listed} differ from the chapters {chapter_stems()}"


def test_the_website_index_finds_a_description_for_every_chapter():
    book = _load(ROOT / "docs" / "book" / "build.py", "book_build")
    intro, descriptions = book.readme_parts(README.read_text())
    missing = [stem for stem in chapter_stems() if not descriptions.get(stem)]
    assert not missing, f"the website's index would list these chapters without a description: {missing}"
    # the first screen becomes the site's landing page, where a link into the repository has nothing to point at
    assert not relative_links(intro), "README's first screen (the website's landing page) links into the repository"


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    pages = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/*.md"))]
    assert len(relative_links(README.read_text())) >= 5  # the records, DESIGN.md, the screenshot, the model card, LICENSE
    broken = {page.relative_to(ROOT).as_posix(): links for page in pages if (links := broken_links(page))}
    assert not broken, f"links to missing files or headings: {broken}"


def test_a_broken_link_and_a_broken_table_are_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## The vLLM peer\n\n[ok](#the-vllm-peer) [gone](missing.md) [bad](page.md#nowhere) "
                    "[web](https://example.org/x) `[code](nope.md)`\n")
    assert broken_links(page) == ["missing.md (no such file)", "page.md#nowhere (no heading with that anchor)"]
    table, rows = chapter_table(f"{TABLE_HEADER}\n| --- | --- |\n| `00_a` | a |\n\n| `01_b` | b |\n")
    assert [row for row in rows if row not in table] == ["| `01_b` | b |"]


def test_the_performance_records_match_the_benchmark_reports():
    build = _load(ROOT / "docs" / "performance" / "build.py", "performance_build")
    stale = [path.relative_to(ROOT).as_posix() for path, prefix in build.targets()
             if build.render(path.read_text(), prefix) != path.read_text()]
    assert not stale, f"generated tables out of date in {stale}; run .venv/bin/python docs/performance/build.py"
    blocks = sum(len(build.BLOCK.findall(path.read_text())) for path, _ in build.targets())
    assert blocks >= len(build.CLASSES) * 4 + 1, "a record lost its generated tables"
