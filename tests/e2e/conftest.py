"""Browser-test fixtures: a throw-away JupyterLab on 127.0.0.1 and headless Chromium driven by Playwright."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lab_driver import Lab

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("LLMINFER_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("LLMINFER_E2E_ARTIFACTS", REPO_ROOT / "e2e-artifacts")).resolve()
SERVER_START_TIMEOUT_S = 90
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--metrics-recording-only",
    "--safebrowsing-disable-auto-update",
]
# Lab front-end plugins that would talk to the internet or pop up dialogs unrelated to the handbook.
DISABLED_LAB_PLUGINS = {
    "@jupyterlab/apputils-extension:announcements": True,
    "@jupyterlab/extensionmanager-extension": True,
    "@jupyterlab/lsp-extension": True,
}


_RUN_STATE = {"used": False}  # set once this pytest run has written artifacts


def _free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _copy_handbook(dest: Path) -> Path:
    """Copies chapters/ (and data/, which notebooks read by relative path) into dest; returns the chapters copy."""
    chapters = dest / "chapters"
    shutil.copytree(REPO_ROOT / "chapters", chapters,
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    data = REPO_ROOT / "data"
    if data.is_dir():
        shutil.copytree(data, dest / "data", ignore=shutil.ignore_patterns("corpus", "*.tmp", "__pycache__"))
    return chapters


def _write_lab_config(config_dir: Path, settings_dir: Path) -> None:
    """Switches off the news pop-up and the extension manager, and keeps every cell in the page (no windowing)."""
    labconfig = config_dir / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(json.dumps({"disabledExtensions": DISABLED_LAB_PLUGINS}))
    notebook_settings = settings_dir / "@jupyterlab" / "notebook-extension"
    notebook_settings.mkdir(parents=True, exist_ok=True)
    (notebook_settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))


def _wait_for_status(base_url: str, token: str, proc: subprocess.Popen, log_path: Path) -> None:
    """Returns once GET /api/status answers 200; raises with the log's tail if the server dies or never answers."""
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    request = urllib.request.Request(f"{base_url}/api/status", headers={"Authorization": f"token {token}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"JupyterLab exited with code {proc.returncode} before it answered; "
                               f"log: {log_path}\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(request, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"JupyterLab did not answer /api/status within {SERVER_START_TIMEOUT_S} s; "
                       f"log: {log_path}\n{_tail(log_path)}")


def _tail(path: Path, n_chars: int = 3000) -> str:
    """Returns the last n_chars of a text file (empty if missing)."""
    try:
        return path.read_text(errors="replace")[-n_chars:]
    except OSError:
        return ""


def _stop_server(proc: subprocess.Popen, base_url: str, token: str) -> None:
    """Shuts JupyterLab and its kernels down: the REST shutdown first, then SIGTERM/SIGKILL to what is left."""
    import psutil

    try:
        family = [proc.pid] + [child.pid for child in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = [proc.pid]
    if proc.poll() is None:
        request = urllib.request.Request(f"{base_url}/api/shutdown", method="POST", data=b"",
                                         headers={"Authorization": f"token {token}"})
        try:
            urllib.request.urlopen(request, timeout=5).close()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
    # Kernels run in their own sessions, so the server's process group does not hold them: end each by its id.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid in family if psutil.pid_exists(pid)]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        _, still_alive = psutil.wait_procs([p for p in map(_process_or_none, alive) if p], timeout=5)
        if not still_alive and proc.poll() is not None:
            break
    proc.wait(timeout=5)


def _process_or_none(pid: int):
    """Returns psutil.Process(pid), or None if it has gone."""
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    """The folder for screenshots and the JupyterLab log (e2e-artifacts/ unless LLMINFER_E2E_ARTIFACTS is set)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for stale in [*ARTIFACTS.glob("FAILED-*.png"), ARTIFACTS / "jupyterlab.log"]:  # left by an earlier run
        stale.unlink(missing_ok=True)
    _RUN_STATE["used"] = True
    return ARTIFACTS


@pytest.fixture(scope="session")
def lab_root(tmp_path_factory) -> Path:
    """A private copy of the handbook that the server shows, so the committed notebooks stay untouched."""
    return _copy_handbook(tmp_path_factory.mktemp("handbook"))


@pytest.fixture(scope="session")
def jupyter_server(tmp_path_factory, lab_root, artifacts_dir):
    """Starts JupyterLab from this environment on 127.0.0.1; yields base_url, token, log, root; always stops it."""
    home = tmp_path_factory.mktemp("jupyter-home")
    env = dict(os.environ)
    env.update(
        JUPYTER_CONFIG_DIR=str(home / "config"),
        JUPYTER_DATA_DIR=str(home / "data"),
        JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(home / "lab-settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(home / "lab-workspaces"),
        IPYTHONDIR=str(home / "ipython"),
        MPLCONFIGDIR=str(home / "matplotlib"),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",  # kernels inherit this: nothing in the chapters under test may reach the hub
    )
    env.pop("JUPYTER_PATH", None)
    _write_lab_config(home / "config", home / "lab-settings")
    token = secrets.token_hex(24)
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "jupyter", "lab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--ServerApp.root_dir={lab_root}",
        f"--IdentityProvider.token={token}",
        "--ServerApp.allow_remote_access=False",
        "--LabApp.news_url=None",  # no announcements feed
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.extension_manager=readonly",
        "--ServerApp.terminals_enabled=False",
        "--ServerApp.jpserver_extensions=jupyter_lsp=False",
    ]
    if os.geteuid() == 0:  # CI containers run as root; Jupyter refuses that unless told
        cmd.append("--allow-root")
    log_path = artifacts_dir / "jupyterlab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=lab_root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_for_status(base_url, token, proc, log_path)
            yield {"base_url": base_url, "token": token, "log": log_path, "root": lab_root}
        finally:
            _stop_server(proc, base_url, token)


@pytest.fixture(scope="session")
def browser():
    """Headless system Chromium through Playwright; always closed."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}; install it with `apt-get install -y chromium` "
                    f"or set LLMINFER_CHROMIUM to its path")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


NOT_LOCALHOST_WS = re.compile(r"^(?!wss?://127\.0\.0\.1:).*")
LOCAL_PREFIXES = ("http://127.0.0.1:", "ws://127.0.0.1:", "data:", "blob:", "about:")


def _guard_network(context, blocked: list[str]) -> None:
    """Aborts every request and WebSocket that is not for 127.0.0.1, noting its URL in blocked."""
    def only_localhost(route) -> None:
        if route.request.url.startswith(LOCAL_PREFIXES):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort("blockedbyclient")

    def close_websocket(ws) -> None:
        blocked.append(ws.url)
        ws.close()

    context.route("**/*", only_localhost)
    context.route_web_socket(NOT_LOCALHOST_WS, close_websocket)


@pytest.fixture
def lab(request, browser, jupyter_server, artifacts_dir):
    """A fresh browser page on the test server, wrapped in the Lab driver; shuts its kernels down afterwards."""
    context = browser.new_context(viewport={"width": 1400, "height": 1500}, service_workers="block")
    page = context.new_page()
    page.set_default_timeout(30_000)
    driver = Lab(page, jupyter_server["base_url"], jupyter_server["token"], artifacts_dir)
    _guard_network(context, driver.blocked)
    request.node.stash[LAB_KEY] = driver
    try:
        yield driver
    finally:
        try:
            driver.shutdown_kernels()
        finally:
            if driver.blocked:
                print(f"e2e: blocked requests to {sorted(set(driver.blocked))}", file=sys.stderr)
            context.close()


LAB_KEY = pytest.StashKey[Lab]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failed test, saves a screenshot of the page and names it, with the JupyterLab log, in the report."""
    outcome = yield
    report = outcome.get_result()
    if report.when not in ("setup", "call") or not report.failed:
        return
    driver = item.stash.get(LAB_KEY, None)
    lines = [f"JupyterLab log: {ARTIFACTS / 'jupyterlab.log'}"]
    if driver is not None:
        shot = ARTIFACTS / f"FAILED-{item.name}.png"
        try:
            driver.page.screenshot(path=str(shot), full_page=True)
            lines.insert(0, f"screenshot: {shot}")
        except Exception as exc:  # the page may be gone; the log still helps
            lines.insert(0, f"screenshot failed: {exc!r}")
        try:
            dialogs = driver.page.locator(".jp-Dialog").all_inner_texts()
            lines += [f"open dialog: {text!r}" for text in dialogs]
        except Exception:  # the page may be gone
            pass
    report.sections.append(("e2e artifacts", "\n".join(lines)))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Prints where the screenshots and the JupyterLab log are."""
    if _RUN_STATE["used"] and ARTIFACTS.is_dir():
        files = sorted(p.name for p in ARTIFACTS.iterdir())
        terminalreporter.write_line(f"e2e artifacts in {ARTIFACTS}: {', '.join(files)}")
