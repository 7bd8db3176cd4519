"""Drives one JupyterLab page through Playwright: open a notebook, run it, find widgets, take screenshots."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

KERNEL_START_TIMEOUT_MS = 120_000
REPO_ROOT = Path(__file__).resolve().parents[2]
BOOK_WIDGETS = REPO_ROOT / "docs" / "book" / "widgets"  # the website shows each widget cell by this screenshot
PROMPT_NUMBERED = re.compile(r"^\[\d+\]:?$")

# Reads every code cell's prompt ("[ ]:", "[*]:", "[3]:") in the open notebook, in order.
_PROMPTS_JS = """
() => Array.from(document.querySelectorAll(
        '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell .jp-InputArea-prompt'))
       .map(el => el.textContent.trim())
"""

# The output text of every code cell in the open notebook, in order (for error messages).
_OUTPUTS_JS = """
() => Array.from(document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-CodeCell'))
       .map(cell => { const out = cell.querySelector('.jp-OutputArea'); return out ? out.innerText : ''; })
"""


class Lab:
    """One browser page on a JupyterLab server, with the actions a reader takes."""

    def __init__(self, page, base_url: str, token: str, artifacts_dir: Path):
        self.page = page
        self.base_url = base_url
        self.token = token
        self.artifacts_dir = Path(artifacts_dir)
        self.blocked: list[str] = []  # URLs the network guard refused (anything not on 127.0.0.1)
        self.dismissed: list[str] = []  # text of the dialogs accepted along the way
        self.notebook: str | None = None  # the notebook last opened, as a path under the server root

    # ----- server side -----------------------------------------------------------------
    def api(self, method: str, path: str):
        """Returns the decoded JSON of a REST call to the server (None for an empty body)."""
        request = urllib.request.Request(f"{self.base_url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def shutdown_kernels(self) -> None:
        """Shuts down every kernel the server runs, so the next test starts on a quiet machine."""
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}")

    # ----- opening ---------------------------------------------------------------------
    def open(self, notebook: str) -> None:
        """Opens notebook (a path under the server root) in a fresh workspace and waits for an idle kernel."""
        self.notebook = notebook
        url = f"{self.base_url}/lab/tree/{notebook}?reset&token={self.token}"
        self.page.goto(url)
        self.page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(state="visible",
                                                                                    timeout=60_000)
        # A "Select Kernel" dialog may come up when the kernel specs arrive late; accept its default (Python 3).
        deadline = time.monotonic() + KERNEL_START_TIMEOUT_MS / 1000
        while True:
            self.dismiss_dialogs()
            if self.kernel_name() not in (None, "", "No Kernel") and self.kernel_status() == "idle":
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{notebook}: no idle kernel after {KERNEL_START_TIMEOUT_MS / 1000:.0f} s "
                                     f"(kernel {self.kernel_name()!r}, status {self.kernel_status()!r})")
            self.page.wait_for_timeout(250)
        self.dismiss_dialogs()

    def kernel_name(self) -> str | None:
        """Returns the kernel name shown in the notebook toolbar ("No Kernel" when none)."""
        name = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-KernelName")
        return name.first.inner_text().strip() if name.count() else None

    def dismiss_dialogs(self) -> None:
        """Accepts any modal dialog (such as kernel selection) and closes pop-up notifications."""
        dialog_button = self.page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
        while dialog_button.count():
            self.dismissed.append(self.page.locator(".jp-Dialog").first.inner_text())
            print(f"e2e: accepted dialog {self.dismissed[-1]!r}")
            dialog_button.first.click()
            self.page.wait_for_timeout(200)
        for close in self.page.locator(".jp-Notification-Toast-Close, .Toastify__close-button").all():
            try:
                close.click(timeout=1000)
            except Exception:  # a toast may vanish on its own between count and click
                pass

    # ----- kernel and execution ----------------------------------------------------------
    def kernel_status(self) -> str | None:
        """Returns the status shown in the notebook toolbar (idle, busy, starting, ...)."""
        indicator = self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator")
        return indicator.first.get_attribute("data-status") if indicator.count() else None

    def wait_kernel_idle(self, timeout_ms: int = 60_000) -> None:
        """Returns once the open notebook's kernel reports idle."""
        self.page.wait_for_selector(
            ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator[data-status='idle']",
            state="attached", timeout=timeout_ms)

    def menu(self, menu: str, item: str) -> None:
        """Clicks a main-menu entry by its labels, e.g. ("Run", "Run All Cells")."""
        self.dismiss_dialogs()
        self.page.locator(".lm-MenuBar-item", has_text=re.compile(rf"^{re.escape(menu)}$")).first.click()
        label = self.page.locator(".lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}$"))
        label.first.click()
        self.page.locator(".lm-Menu").first.wait_for(state="hidden", timeout=5_000)

    def prompts(self) -> list[str]:
        """Returns every code cell's prompt text, in order."""
        return self.page.evaluate(_PROMPTS_JS)

    def run_all(self, timeout_ms: int = 180_000) -> None:
        """Clears outputs, runs all cells, waits until every code cell has run; raises with the failing output."""
        self.page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.click(
            position={"x": 5, "y": 5})
        self.menu("Edit", "Clear Outputs of All Cells")
        self.page.wait_for_function(f"() => ({_PROMPTS_JS})().every(p => !/\\d/.test(p))")
        for attempt in range(3):  # a click on a menu that is still closing can be lost; nothing ran then
            self.menu("Run", "Run All Cells")
            try:  # started: some cell is queued or has run
                self.page.wait_for_function(f"() => ({_PROMPTS_JS})().some(p => /\\*|\\d/.test(p))",
                                            timeout=10_000)
                break
            except PlaywrightTimeoutError:
                if attempt == 2:
                    raise
        # Finished: nothing queued and the kernel idle.
        self.page.wait_for_function(
            f"""() => !({_PROMPTS_JS})().some(p => p.includes('*')) &&
                     document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) '
                         + '.jp-Notebook-ExecutionIndicator[data-status="idle"]') !== null""",
            timeout=timeout_ms, polling=500)
        prompts = self.prompts()
        not_run = [i for i, p in enumerate(prompts) if not PROMPT_NUMBERED.match(p)]
        if not_run:
            ran = [i for i, p in enumerate(prompts) if PROMPT_NUMBERED.match(p)]
            last = ran[-1] if ran else 0
            output = self.page.evaluate(_OUTPUTS_JS)[last][-4000:]
            raise AssertionError(f"code cells {not_run} (counting code cells from 0) did not run; "
                                 f"the output of code cell {last}, the last that ran:\n{output}")

    # ----- widgets --------------------------------------------------------------------
    def widget(self, css_class: str, timeout_ms: int = 60_000, state: str = "visible"):
        """Returns the locator of the first rendered widget with this CSS class, once visible (or in `state`)."""
        locator = self.page.locator(
            f".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output .{css_class}").first
        locator.wait_for(state=state, timeout=timeout_ms)
        if state == "visible":
            locator.scroll_into_view_if_needed()
        return locator

    @staticmethod
    def output_of(locator):
        """Returns the output area (the whole rendered widget) that holds locator."""
        output_class = "contains(concat(' ', @class, ' '), ' jp-OutputArea-output ')"
        return locator.locator(f"xpath=ancestor::div[{output_class}][1]")

    @staticmethod
    def set_text(locator, value) -> None:
        """Replaces the text of an input (or contenteditable readout) and commits it with Enter."""
        locator.click()
        locator.press("ControlOrMeta+a")
        locator.press_sequentially(str(value))
        locator.press("Enter")

    def screenshot(self, name: str, locator=None) -> Path:
        """Saves a PNG of the page (or of one element) under the artifacts folder; returns its path."""
        path = self.artifacts_dir / f"{name}.png"
        (locator or self.page).screenshot(path=str(path))
        if locator is not None and self.notebook and (REPO_ROOT / "chapters" / self.notebook).is_file():
            self.save_book_shot(path, locator)
        return path

    def save_book_shot(self, shot: Path, locator) -> Path:
        """Copies a chapter widget's screenshot into docs/book/widgets/, named by its cell's id; returns the copy."""
        import importlib.util
        import shutil

        spec = importlib.util.spec_from_file_location("book_build", REPO_ROOT / "docs" / "book" / "build.py")
        book = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(book)
        index = locator.evaluate("""el => { const cell = el.closest('.jp-Cell');
            return Array.from(cell.closest('.jp-Notebook').querySelectorAll('.jp-Cell')).indexOf(cell); }""")
        chapter = REPO_ROOT / "chapters" / self.notebook
        cells = json.loads(chapter.read_text())["cells"]
        cell = cells[index]
        assert any(book.is_widget_output(output) for output in cell.get("outputs", [])), (
            f"{self.notebook}: cell {index} holds the widget in the browser but is not a widget cell in the "
            f"committed notebook; rerun `make notebooks` or check the chapter")
        BOOK_WIDGETS.mkdir(parents=True, exist_ok=True)
        copy = BOOK_WIDGETS / book.widget_shot_name(chapter.stem, cell.get("id", f"cell-{index:03d}"))
        shutil.copyfile(shot, copy)
        return copy
