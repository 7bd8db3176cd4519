"""A server as a child process, started and always stopped: for notebooks, tests and the peer comparison. Chapter 11.

    with ServerProcess(["--model", "tiny-capitals", "--threads", "1"]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="none")

`ChildProcess` holds the lifecycle that every server run as a child shares (this module's `ServerProcess`, which
runs `python -m llminfer.serve`, and `llminfer.serve.peer.VLLMProcess`, which runs vLLM's): it starts the command
in a session of its own on 127.0.0.1 and a free port, with its output in a log file, and waits until GET /health
answers. On stop it sends its signals in turn (for this server SIGINT, uvicorn's graceful shutdown in which
in-flight requests drain, then SIGTERM, then SIGKILL) until the process has ended, then kills whatever it left
in its session. A child that exits, or never answers, before it is ready is stopped the same way, and the error
ends with its log. A finaliser stops it too if the object is dropped or the interpreter exits, so a notebook
that is interrupted leaves no server behind.
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

__all__ = ["ChildProcess", "ServerProcess", "ChildNotReady", "ChildTimedOut", "free_port", "wait_until_healthy",
           "ServerExited"]

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


class ChildNotReady(RuntimeError):
    """A child server exited, or never answered /health, before it was ready; the message ends with its log. Chapter 11."""


class ChildTimedOut(ChildNotReady, TimeoutError):
    """A child server did not answer /health within its startup timeout (a TimeoutError too). Chapter 11."""


StopSteps = tuple[tuple[int, float], ...]       # (signal, seconds to wait for the exit after it), in order


def _end(process: subprocess.Popen, stop_steps: StopSteps, signal_group: bool) -> None:
    """Sends each of stop_steps' signals (to the process, or to its whole group) until it exits, then SIGKILL to
    what is left in its group: processes it started that outlived it."""
    for sig, wait_s in stop_steps:
        if process.poll() is not None:
            break
        try:
            if signal_group:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ChildProcess:
    """A server's command as a child process in a session of its own, on 127.0.0.1:port, with its output in a log
    file: start() waits until /health answers 200, stop() ends it and what it started. Chapter 11.

    stop_steps: the signals stop() sends in turn, each with the seconds to wait for the exit, until the process
    has ended (to the whole process group where signal_group is set); whatever is left in its group is killed
    after. start() raises ChildNotReady (a RuntimeError) if the process exits before it is ready, ChildTimedOut (a
    RuntimeError and a TimeoutError) if /health has not answered 200 within startup_timeout_s; either way the
    process and its group are stopped first and the message ends with the log's tail. log_path: where the log is
    kept (None: a temporary file, removed at stop once its text is read).
    """

    name = "the child process"         # how messages name it
    health_interval_s = 0.1            # between GET /health requests while it starts

    def __init__(self, command: list[str], port: int, startup_timeout_s: float, stop_steps: StopSteps,
                 env: dict | None = None, log_path: str | Path | None = None, signal_group: bool = False):
        self.command = list(command)
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.stop_steps = tuple(stop_steps)
        self.env = env
        self.log_path = Path(log_path) if log_path is not None else None
        self.signal_group = signal_group
        self.startup_s = float("nan")   # process start to the first 200 from /health
        self.process: subprocess.Popen | None = None
        self._temporary_log: Path | None = None
        self._log_text = ""             # a temporary log's text, once the file is gone
        self._finalizer = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI base URL: what `openai.OpenAI(base_url=...)` takes."""
        return self.url + "/v1"

    def log(self) -> str:
        """What the process has written to stdout and stderr so far."""
        path = self.log_path or self._temporary_log
        if path is None or not path.is_file():
            return self._log_text
        return path.read_text(errors="replace")

    def log_tail(self, chars: int = 3000) -> str:
        """The last chars characters of the log."""
        return self.log()[-chars:]

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self):
        """Starts the process and waits for /health; returns self (see the class for what it raises)."""
        if self.process is not None:
            raise RuntimeError(f"this {type(self).__name__} was already started; make a new one")
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "w")
        else:
            log = tempfile.NamedTemporaryFile("w", prefix="llminfer-child-", suffix=".log", delete=False)
            self._temporary_log = Path(log.name)
        started = time.perf_counter()
        with log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self._finalizer = weakref.finalize(self, _end, self.process, self.stop_steps, self.signal_group)
        try:
            wait_until_healthy(self.url, self.process, self.startup_timeout_s, interval_s=self.health_interval_s)
        except ServerExited as exc:
            self.stop()
            raise ChildNotReady(f"{self.name} exited with code {exc.returncode} before it was ready; "
                                f"{self._log_ends()}") from None
        except TimeoutError:
            self.stop()
            raise ChildTimedOut(f"{self.name} did not answer /health within {self.startup_timeout_s:g} s; "
                                f"{self._log_ends()}") from None
        except BaseException:           # an interrupt while waiting: nothing is left running either
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started
        return self

    def _log_ends(self) -> str:
        where = f" ({self.log_path})" if self.log_path is not None else ""
        return f"its log{where} ends:\n{self.log_tail()}"

    def stop(self) -> int | None:
        """Ends the process (stop_steps' signals in turn) and what it left in its group; returns the exit code."""
        if self.process is None:
            return None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        _end(self.process, self.stop_steps, self.signal_group)
        if self._temporary_log is not None and self._temporary_log.is_file():
            self._log_text = self._temporary_log.read_text(errors="replace")
            self._temporary_log.unlink(missing_ok=True)
        return self.process.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class ServerProcess(ChildProcess):
    """`python -m llminfer.serve ARGS` on 127.0.0.1:free port; started by start(), ended by stop(). Chapter 11.

    stop() sends SIGINT (uvicorn's graceful shutdown: in-flight requests drain for drain_timeout_s), then
    SIGTERM, then SIGKILL; start() raises a RuntimeError that ends with the server's log if it is not ready."""

    name = "the server"

    def __init__(self, args: list[str] | None = None, port: int | None = None, startup_timeout_s: float = 120.0,
                 drain_timeout_s: float = 5.0, env: dict | None = None):
        args = list(args or [])
        for flag in ("--host", "--port", "--drain-timeout"):
            if flag in args:
                raise ValueError(f"pass {flag} through ServerProcess's own arguments, not in args")
        port = port or free_port()
        command = [sys.executable, "-m", "llminfer.serve", "--host", LOOPBACK, "--port", str(port),
                   "--drain-timeout", str(drain_timeout_s), "--log-level", "warning", *args]
        stop_steps = ((signal.SIGINT, drain_timeout_s + 2), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0))
        super().__init__(command, port, startup_timeout_s, stop_steps, env={**os.environ, **(env or {})})
        self.drain_timeout_s = drain_timeout_s
