"""The server as a child process, started and always stopped: for notebooks and tests. Chapter 11.

    with ServerProcess(["--model", "tiny-capitals", "--threads", "1"]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")

It runs `python -m llminfer.serve` on 127.0.0.1 and a free port, waits until GET /health answers, and
on stop sends SIGINT (uvicorn's graceful shutdown: in-flight requests drain), then SIGTERM, then
SIGKILL if the process still lives. A finaliser stops it too if the object is dropped or the
interpreter exits, so a notebook that is interrupted leaves no server behind.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path

__all__ = ["ServerProcess", "free_port", "wait_until_healthy", "ServerExited"]

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class ServerExited(RuntimeError):
    """The server's process ended before its /health answered. Chapter 11."""

    def __init__(self, returncode: int | None):
        super().__init__(f"the server exited with code {returncode} before it was ready")
        self.returncode = returncode


def wait_until_healthy(url: str, process: subprocess.Popen, timeout_s: float, interval_s: float = 0.1,
                       request_timeout_s: float = 2.0) -> float:
    """Polls GET url/health until it answers 200; returns the seconds that took. Chapter 11.

    Raises ServerExited (a RuntimeError, with the exit code) if process ends first, and TimeoutError once
    timeout_s have passed without a 200; it stops nothing (the caller decides what to do with the process).
    """
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        if process.poll() is not None:
            raise ServerExited(process.returncode)
        try:
            with urllib.request.urlopen(url + "/health", timeout=request_timeout_s) as response:
                if response.status == 200:
                    return time.monotonic() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass                               # not listening yet, or not healthy yet (an HTTPError is a URLError)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 within {timeout_s:g} s")
        time.sleep(interval_s)


def _stop(process: subprocess.Popen, grace_s: float) -> None:
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            process.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


class ServerProcess:
    """`python -m llminfer.serve ARGS` on 127.0.0.1:free port; started by start(), ended by stop(). Chapter 11."""

    def __init__(self, args: list[str] | None = None, port: int | None = None, startup_timeout_s: float = 120.0,
                 drain_timeout_s: float = 5.0, env: dict | None = None):
        args = list(args or [])
        for flag in ("--host", "--port", "--drain-timeout"):
            if flag in args:
                raise ValueError(f"pass {flag} through ServerProcess's own arguments, not in args")
        self.port = port or free_port()
        self.drain_timeout_s = drain_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.command = [sys.executable, "-m", "llminfer.serve", "--host", LOOPBACK, "--port", str(self.port),
                        "--drain-timeout", str(drain_timeout_s), "--log-level", "warning", *args]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None
        self._log = None
        self._log_text = ""
        self._finalizer = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL: what `openai.OpenAI(base_url=...)` takes."""
        return self.url + "/v1"

    def log(self) -> str:
        """What the server has written to stderr and stdout so far."""
        if self._log is None or self._log.closed:
            return self._log_text
        self._log.flush()
        return Path(self._log.name).read_text(errors="replace")

    def start(self) -> "ServerProcess":
        if self.process is not None:
            raise RuntimeError("this ServerProcess was already started; make a new one")
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llminfer-serve-", suffix=".log", delete=False)
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                        stdin=subprocess.DEVNULL)
        self._finalizer = weakref.finalize(self, _stop, self.process, self.drain_timeout_s + 2)
        try:
            wait_until_healthy(self.url, self.process, self.startup_timeout_s)
        except ServerExited as exc:
            log = self.log()
            self.stop()
            raise RuntimeError(f"{exc}:\n{log[-3000:]}") from None
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"the server did not answer /health within {self.startup_timeout_s} s; "
                               f"its log:\n{self.log()[-3000:]}") from None
        return self

    def stop(self) -> int | None:
        """Graceful stop (SIGINT), then harder ones; returns the exit code."""
        if self.process is None:
            return None
        if self._finalizer is not None:
            self._finalizer.detach()
        _stop(self.process, self.drain_timeout_s + 2)
        if self._log is not None and not self._log.closed:
            self._log_text = self.log()
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
        return self.process.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
