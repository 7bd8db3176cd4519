"""The website (`make book`): how the chapters are staged and its links checked (plain tests), and the built
site in headless Chromium (marked e2e: run after `make book`; it is served from build/book/ on 127.0.0.1):
every page loads clean, every image decodes, search and previous/next work."""
from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import threading
from pathlib import Path
from urllib.parse import urljoin

import pytest

pytestmark = [pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
SITE = REPO_ROOT / "build" / "book"
CHAPTER_SHOT = REPO_ROOT / "docs" / "book" / "screenshots" / "04_kv_cache.png"  # refreshed by every passing run
CHAPTER_GLOBS = ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb")

# Every image on the page, once none is still loading: where it points and whether it decoded.
_IMAGES_JS = "() => Array.from(document.images).map(img => ({src: img.currentSrc || img.src, width: img.naturalWidth}))"
_CODE_JS = "() => Array.from(document.querySelectorAll('.cell_input')).map(el => el.textContent)"
_IMAGES_DONE_JS = "() => Array.from(document.images).every(img => img.complete)"


def chapter_stems() -> list[str]:
    """The committed chapters in reading order: numbered ones, then the appendix."""
    return [p.stem for pattern in CHAPTER_GLOBS for p in sorted((REPO_ROOT / "chapters").glob(pattern))]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files without logging each request."""

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def site_url():
    """Serves build/book/ on a free port of 127.0.0.1; yields its base URL; always stops the server."""
    if not (SITE / "index.html").is_file():
        pytest.fail(f"{SITE / 'index.html'} is missing; run `make book` first")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def page(browser):
    """A fresh page that may only reach 127.0.0.1 (no network here); notes page errors and blocked requests."""
    context = browser.new_context(viewport={"width": 1280, "height": 1000}, service_workers="block")
    new_page = context.new_page()
    new_page.set_default_timeout(30_000)
    new_page.errors, new_page.blocked = [], []

    def only_localhost(route) -> None:
        if route.request.url.startswith(("http://127.0.0.1:", "data:", "blob:", "about:")):
            route.continue_()
        else:  # e.g. MathJax from its CDN: blocked, so the test sees the page an offline reader sees
            new_page.blocked.append(route.request.url)
            route.abort("blockedbyclient")

    context.route("**/*", only_localhost)
    new_page.on("pageerror", lambda error: new_page.errors.append(str(error)))
    try:
        yield new_page
    finally:
        context.close()


def _load(name: str):
    """Imports docs/book/<name>.py by path (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"book_{name}", REPO_ROOT / "docs" / "book" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _code(source: str, outputs=(), cell_id: str | None = None) -> dict:
    """A code cell of an nbformat 4.5 notebook."""
    return {"cell_type": "code", "id": cell_id or f"c{abs(hash(source)) % 10**8}", "metadata": {},
            "execution_count": 1, "source": source, "outputs": list(outputs)}


def _notebook(title: str, *cells: dict) -> dict:
    """A notebook whose first cell is the markdown heading `# title`."""
    heading = {"cell_type": "markdown", "id": "h", "metadata": {}, "source": f"# {title}\n\nSome prose."}
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [heading, *cells]}


def test_staging_strips_markers_collapses_long_cells_shows_widget_shots_and_finds_the_appendix(tmp_path):
    book = _load("build")
    repo = tmp_path / "repo"
    (repo / "chapters").mkdir(parents=True)
    (repo / "llminfer").mkdir()
    (repo / "llminfer" / "model.py").write_text("x = 1\n")
    (repo / "README.md").write_text("# handbook\n\nIntro; start with `chapters/00_intro.ipynb`.\n\n"
                                    "## The chapters\n\n| chapter | what |\n| --- | --- |\n"
                                    "| `00_intro` | the start |\n")
    placeholder = {"output_type": "execute_result", "execution_count": 1, "metadata": {},
                   "data": {"text/plain": book.WIDGET_PLACEHOLDER}}
    long_source = "\n".join(f"a{i} = {i}" for i in range(book.LONG_CELL_LINES + 5))
    intro = _notebook("00 · Intro", _code("# NBVAL_IGNORE_OUTPUT\nprint(1)", cell_id="marked"),
                      _code(long_source, cell_id="long"), _code("# NBVAL_IGNORE_OUTPUT\nw()", [placeholder], "w1"),
                      _code("w()", [placeholder], "w2"))
    (repo / "chapters" / "00_intro.ipynb").write_text(json.dumps(intro))
    (repo / "chapters" / "A1_cpu_kernels.ipynb").write_text(json.dumps(_notebook("A1 · Kernels")))
    (repo / "chapters" / "notes.ipynb").write_text(json.dumps(_notebook("not a chapter")))
    shots = tmp_path / "shots"
    shots.mkdir()
    (shots / book.widget_shot_name("00_intro", "w1")).write_bytes(b"\x89PNG fake")
    (shots / "00_intro--gone.png").write_bytes(b"\x89PNG fake")

    summary = book.stage(tmp_path / "src", repo_root=repo, shots_dir=shots)

    assert summary["chapters"] == ["00_intro", "A1_cpu_kernels"]
    assert summary["widget_shots"] == ["00_intro--w1.png"]
    assert summary["widgets_without_shot"] == ["00_intro.ipynb cell w2"]
    assert summary["stale_shots"] == ["00_intro--gone.png"]
    staged = json.loads((tmp_path / "src" / "chapters" / "00_intro.ipynb").read_text())
    cells = {cell["id"]: cell for cell in staged["cells"]}
    assert cells["marked"]["source"] == "print(1)"
    assert cells["long"]["metadata"]["tags"] == ["hide-input"] and "tags" not in cells["marked"]["metadata"]
    assert cells["w1"]["outputs"] == [] and cells["w2"]["outputs"] == []
    assert "](../widgets/00_intro--w1.png)" in cells["w1-widget"]["source"]
    assert "live in JupyterLab" in cells["w2-widget"]["source"] and "![" not in cells["w2-widget"]["source"]
    assert (tmp_path / "src" / "widgets" / "00_intro--w1.png").is_file()
    assert (tmp_path / "src" / "llminfer" / "model.py").is_file()  # links into the package resolve
    assert json.loads((repo / "chapters" / "00_intro.ipynb").read_text()) == intro  # the chapter is untouched
    index = (tmp_path / "src" / "index.md").read_text()
    assert "[`00_intro`](chapters/00_intro.ipynb)" in index
    assert "| [00 · Intro](chapters/00_intro.ipynb) | the start |" in index
    appendix = index.index(":caption: Appendix (optional)")
    assert index.index(":caption: Chapters") < index.index("chapters/00_intro\n") < appendix
    assert appendix < index.index("chapters/A1_cpu_kernels\n")
    assert "notes" not in index


def test_link_check_fails_broken_internal_links_and_lists_external_ones(tmp_path):
    check = _load("check_links")
    (tmp_path / "chapters").mkdir()
    (tmp_path / "index.html").write_text('<a href="chapters/01.html#kv">ok</a> <a href="chapters/02.html">gone</a>'
                                         '<a href="https://arxiv.org/abs/2309.06180">paper</a><a href="#top">x</a>')
    (tmp_path / "chapters" / "01.html").write_text('<h2 id="kv">KV</h2><a href="../index.html#nowhere">back</a>'
                                                   '<img src="../_images/fig.png">')
    broken, external = check.check_site(tmp_path)
    assert external == ["https://arxiv.org/abs/2309.06180"]
    assert sorted(broken) == ["chapters/01.html: ../_images/fig.png (no such file)",
                              "chapters/01.html: ../index.html#nowhere (no such anchor)",
                              "index.html: #top (no such anchor)",
                              "index.html: chapters/02.html (no such file)"]


@pytest.mark.e2e
def test_every_chapter_has_a_page_in_order():
    stems = chapter_stems()
    assert stems and stems[0].startswith("00_"), stems
    missing = [stem for stem in stems if not (SITE / "chapters" / f"{stem}.html").is_file()]
    assert not missing, f"chapters without a page in {SITE}: {missing}; rerun `make book`"


@pytest.mark.e2e
@pytest.mark.parametrize("path", ["index.html", *[f"chapters/{stem}.html" for stem in chapter_stems()]])
def test_page_loads_without_errors_and_every_image_decodes(page, site_url, path):
    response = page.goto(urljoin(site_url, path), wait_until="load")
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    page.wait_for_function(_IMAGES_DONE_JS)
    images = page.evaluate(_IMAGES_JS)
    broken = [image["src"] for image in images if image["width"] <= 0]
    assert not broken, f"{path}: images that did not decode: {broken}"
    assert not page.errors, f"{path}: page errors: {page.errors}"
    if page.locator("article .math").count():  # MathJax comes from the site itself: formulas typeset offline
        page.locator("article mjx-container").first.wait_for(state="attached", timeout=60_000)
    assert not page.blocked, f"{path}: the page asked the network for {page.blocked}"
    text = page.inner_text("article")
    code = page.evaluate(_CODE_JS)  # collapsed cells too (the prose may name the markers; the code must not carry them)
    assert not [block for block in code if "NBVAL_" in block], f"{path}: nbval markers are showing"
    assert "Loading widget" not in text and "Interactive widget: run this cell" not in text, path
    if path.startswith("chapters/"):
        stem = Path(path).stem
        chapter = (REPO_ROOT / "chapters" / f"{stem}.ipynb").read_text()
        assert chapter.count('"image/png"') <= len(images), (
            f"{path}: the committed chapter has {chapter.count(chr(34) + 'image/png' + chr(34))} figures "
            f"but the page shows {len(images)} images")
        if "Interactive widget: run this cell to use it." in chapter:
            assert "live in JupyterLab" in text, f"{path}: a widget cell does not say where it runs"
    if path == "chapters/04_kv_cache.html":
        CHAPTER_SHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(CHAPTER_SHOT))
        assert CHAPTER_SHOT.stat().st_size > 10_000


@pytest.mark.e2e
def test_search_for_kv_cache_finds_chapter_04(page, site_url):
    page.goto(urljoin(site_url, "search.html?q=KV+cache"), wait_until="load")
    hit = page.locator("#search-results a[href*='04_kv_cache']").first
    hit.wait_for(state="attached", timeout=60_000)
    titles = page.locator("#search-results li").all_inner_texts()
    assert any("KV cache" in title for title in titles), titles
    assert not page.errors, page.errors


@pytest.mark.e2e
def test_next_and_previous_walk_the_chapters_in_order(page, site_url):
    expected = ["index", *chapter_stems()]
    page.goto(urljoin(site_url, "index.html"), wait_until="load")
    walked = ["index"]
    while True:
        forward = page.locator("a.right-next")
        if not forward.count():
            break
        forward.first.click()
        page.wait_for_load_state("load")
        walked.append(Path(page.url.split("#")[0]).stem)
        assert len(walked) <= len(expected), f"next walked past the last chapter: {walked}"
    assert walked == expected, f"next walked {walked}, expected {expected}"
    back = [walked[-1]]
    while True:
        backward = page.locator("a.left-prev")
        if not backward.count():
            break
        backward.first.click()
        page.wait_for_load_state("load")
        back.append(Path(page.url.split("#")[0]).stem)
        assert len(back) <= len(expected), f"previous walked past the first page: {back}"
    assert back == expected[::-1], f"previous walked {back}, expected {expected[::-1]}"
    assert not page.errors, page.errors


@pytest.mark.e2e  # needs requirements-book.txt (installed by `make book`)
@pytest.mark.parametrize("target, builds", [("01_next.ipynb#a-section", True), ("../llminfer/model.py", True),
                                            ("99_missing.ipynb", False), ("01_next.ipynb#no-such-section", False),
                                            ("../llminfer/missing.py", False)])
def test_chapter_and_package_links_resolve_and_a_broken_one_fails_the_build(tmp_path, target, builds):
    import subprocess
    import sys

    book = _load("build")
    repo = tmp_path / "repo"
    (repo / "chapters").mkdir(parents=True)
    (repo / "llminfer").mkdir()
    (repo / "llminfer" / "model.py").write_text("x = 1\n")
    (repo / "README.md").write_text("# handbook\n\nIntro.\n")
    link = {"cell_type": "markdown", "id": "link", "metadata": {}, "source": f"Read [this]({target})."}
    (repo / "chapters" / "00_intro.ipynb").write_text(json.dumps(_notebook("00 · Intro", link)))
    (repo / "chapters" / "01_next.ipynb").write_text(json.dumps(_notebook("01 · Next", {
        "cell_type": "markdown", "id": "s", "metadata": {}, "source": "## A section\n\nText."})))
    book.stage(tmp_path / "src", repo_root=repo, shots_dir=tmp_path / "no-shots")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-n", "-q", "-b", "html", "-c", str(book.BOOK_DIR),
                             "-d", str(tmp_path / "doctrees"), str(tmp_path / "src"), str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=240)
    assert (result.returncode == 0) == builds, result.stderr[-2000:]
    if builds:
        broken, _ = _load("check_links").check_site(tmp_path / "out")
        assert not broken, broken
