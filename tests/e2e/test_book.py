"""The website (`make book`) in headless Chromium: every page loads clean, every image decodes, search and
previous/next work. Run after `make book`; the site is served from build/book/ on 127.0.0.1."""
from __future__ import annotations

import functools
import http.server
import threading
from pathlib import Path
from urllib.parse import urljoin

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

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


def test_every_chapter_has_a_page_in_order():
    stems = chapter_stems()
    assert stems and stems[0].startswith("00_"), stems
    missing = [stem for stem in stems if not (SITE / "chapters" / f"{stem}.html").is_file()]
    assert not missing, f"chapters without a page in {SITE}: {missing}; rerun `make book`"


@pytest.mark.parametrize("path", ["index.html", *[f"chapters/{stem}.html" for stem in chapter_stems()]])
def test_page_loads_without_errors_and_every_image_decodes(page, site_url, path):
    response = page.goto(urljoin(site_url, path), wait_until="load")
    assert response is not None and response.ok, f"{path}: HTTP {response and response.status}"
    page.wait_for_function(_IMAGES_DONE_JS)
    images = page.evaluate(_IMAGES_JS)
    broken = [image["src"] for image in images if image["width"] <= 0]
    assert not broken, f"{path}: images that did not decode: {broken}"
    assert not page.errors, f"{path}: page errors: {page.errors}"
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


def test_search_for_kv_cache_finds_chapter_04(page, site_url):
    page.goto(urljoin(site_url, "search.html?q=KV+cache"), wait_until="load")
    hit = page.locator("#search-results a[href*='04_kv_cache']").first
    hit.wait_for(state="attached", timeout=60_000)
    titles = page.locator("#search-results li").all_inner_texts()
    assert any("KV cache" in title for title in titles), titles
    assert not page.errors, page.errors


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
