"""One background loop drives the engine; request handlers feed it and read their tokens back. Chapter 11.

    loop = EngineLoop(engine, max_queued_requests=64).start()
    handle = await loop.add_request(prompt_ids, SamplingParams(max_new_tokens=16))
    async for update in handle:                     # token ids as the engine makes them
        ...
    loop.stop(drain_timeout_s=5)

The engine is not thread-safe and its steps are long, blocking computations, so it lives on its own
thread: every engine call (add_request, step, abort, stats) happens there and nowhere else. Any engine
that speaks the engine protocol (`llminfer.engine.protocol.Engine`) will do: an `LLMEngine`, or the
disaggregated pair of chapter 12, whose step collects what its workers sent. Handlers,
on the server's asyncio event loop, talk to it through an inbox (adds and aborts, taken between steps)
and get tokens back through per-request asyncio queues (`loop.call_soon_threadsafe`). This is the shape
of vLLM's AsyncLLM and of SGLang's scheduler loop, in one process.

What the loop guarantees:

- **Bounded queue.** A request is refused with `QueueFull` (HTTP 429) when `max_queued_requests`
  requests already wait to be scheduled, and with `EngineUnavailable` (503) once the loop stops or fails.
- **Abort within one step.** An abort is taken from the inbox before the next step runs, so the aborted
  request's KV blocks are back in the pool before the engine computes anything more.
  `abort_log` records, per abort, the engine's step count when it was asked for and when it was done.
- **One request fails alone.** A request whose step or sampling raises finishes with an error (the engine
  reruns the rest of its batch without it); if a whole step raises, the requests in the engine fail and the
  loop goes on, unless MAX_FAILED_STEPS steps in a row raise. Clients hear the exception's type, never its
  text or a traceback; the log has those.
- **Clean shutdown.** `stop(drain_timeout_s)` refuses new requests, lets the running ones finish for up
  to that long, then aborts the rest (their handlers see finish_reason "abort") and ends the thread.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..engine import Engine, PromptIds, RequestOutput, SamplingParams
from ..engine.protocol import protocol_gaps

__all__ = ["EngineLoop", "RequestHandle", "Update", "QueueFull", "EngineUnavailable", "AbortRecord",
           "MAX_FAILED_STEPS"]

log = logging.getLogger("llminfer.serve")

MAX_FAILED_STEPS = 3     # this many engine steps in a row that raise put the loop in its failed state


def client_message(exc: BaseException | str) -> str:
    """What a client is told about an engine failure: the exception's type, never its text, paths or traceback."""
    kind = exc if isinstance(exc, str) else type(exc).__name__
    return (f"the server failed while generating this request ({kind}); other requests are not affected, "
            "and the server log has the details")


class QueueFull(RuntimeError):
    """Too many requests already wait for the engine: HTTP 429. Chapter 11."""


class EngineUnavailable(RuntimeError):
    """The engine loop is stopping, stopped or failed: HTTP 503. Chapter 11."""


@dataclass
class Update:
    """What one engine step made for one request: new token ids, and whether (and why) it finished."""
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None      # "stop" (eos), "length", "abort", "error"; None while running
    output: RequestOutput | None = None   # the engine's record of the request, on the finishing update
    engine_time_s: float = 0.0            # the engine clock after the step that made these tokens
    error: str | None = None              # set if the engine failed on this request (a message for the client)


@dataclass(frozen=True)
class AbortRecord:
    """One abort: which request, the engine's step count when it was asked for and when it took effect."""
    request_id: int
    requested_at_step: int
    done_at_step: int
    was_running: bool
    blocks_used_after: int


class RequestHandle:
    """A request in the engine, as its handler sees it: an async iterator of Updates. Chapter 11."""

    def __init__(self, owner: "EngineLoop", loop: asyncio.AbstractEventLoop):
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[Update] = asyncio.Queue()
        self.request_id: int = -1
        self.engine_arrival_s: float = 0.0   # the engine clock when the request entered the engine
        self.finished = False

    def _push(self, update: Update) -> None:
        self._queue.put_nowait(update)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Update:
        if self.finished:
            raise StopAsyncIteration
        update = await self._queue.get()
        if update.finished or update.error is not None:
            self.finished = True
        return update

    def abort(self) -> None:
        """Asks the engine loop to stop this request (no-op once finished)."""
        if not self.finished and self.request_id >= 0:
            self._owner.abort(self.request_id)
            self.finished = True


class EngineLoop:
    """The engine on a background thread: an inbox for requests and aborts, queues for their tokens. Chapter 11."""

    def __init__(self, engine: Engine, max_queued_requests: int = 128, on_step=None, on_finish=None):
        gaps = protocol_gaps(engine)
        if gaps:
            raise TypeError(f"{type(engine).__name__} does not speak the engine protocol (llminfer.engine.protocol."
                            f"Engine): {'; '.join(gaps)}; pass an LLMEngine or a DisaggregatedEngine")
        if not isinstance(max_queued_requests, int) or isinstance(max_queued_requests, bool) \
                or max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be a positive integer, got {max_queued_requests!r}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.on_step = on_step              # on_step(num_new_tokens, stats), on the engine thread
        self.on_finish = on_finish          # on_finish(RequestOutput), on the engine thread
        self._inbox: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._handles: dict[int, RequestHandle] = {}       # engine thread only
        self._pending_adds = 0
        self._thread: threading.Thread | None = None
        self._stop_deadline: float | None = None
        self.state = "new"                  # new, running, draining, stopped, failed
        self.error: str | None = None
        self.stats = engine.stats           # a snapshot, replaced after every step (read from any thread)
        self.abort_log: list[AbortRecord] = []
        self.steps = 0

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> "EngineLoop":
        if self.state != "new":
            raise RuntimeError(f"the engine loop was already started (state {self.state!r}); make a new one")
        self.state = "running"
        self._thread = threading.Thread(target=self._run, name="llminfer-engine-loop", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        """Refuses new requests; lets running ones finish for up to drain_timeout_s, aborts the rest; joins."""
        if self.state in ("new", "stopped", "failed") or self._thread is None:
            self.state = "stopped" if self.state == "new" else self.state
            return
        with self._lock:
            self.state = "draining"
            self._stop_deadline = time.monotonic() + max(0.0, drain_timeout_s)
        self._wake.set()
        self._thread.join(join_timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"the engine loop did not stop within {join_timeout_s} s (a step is still running)")

    @property
    def accepting(self) -> bool:
        return self.state == "running"

    @property
    def num_queued(self) -> int:
        """Requests not yet running: in the inbox, or waiting in the engine's queue."""
        return self._pending_adds + self.stats.num_waiting

    # --- called from the event loop --------------------------------------------------------------------

    async def add_request(self, prompt_ids: list[int] | PromptIds, params: SamplingParams,
                          constraint=None) -> RequestHandle:
        """Hands a request to the engine; returns its handle. ValueError (the engine's checks), QueueFull,
        EngineUnavailable. Ids already checked (a PromptIds, as the server passes them) go to the engine as they are,
        and it does not check them again. constraint: a fresh structured.Constraint for this request alone
        (chapter 13), passed on to the engine's add_request."""
        loop = asyncio.get_running_loop()
        handle = RequestHandle(self, loop)
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.state != "running":
                raise EngineUnavailable(f"the engine is {self.state}" + (f": {self.error}" if self.error else "")
                                        + "; retry later")
            if self._pending_adds + self.stats.num_waiting >= self.max_queued_requests:
                raise QueueFull(f"{self._pending_adds + self.stats.num_waiting} requests already wait for the "
                                f"engine (max_queued_requests={self.max_queued_requests}); retry later")
            self._pending_adds += 1
            prompt = prompt_ids if isinstance(prompt_ids, PromptIds) else list(prompt_ids)   # checked ids: as they are
            self._inbox.append(("add", prompt, params, constraint, handle, future))
        self._wake.set()
        try:
            handle.request_id = await asyncio.wrap_future(future)
        except asyncio.CancelledError:      # the client left while the request was in the inbox
            future.add_done_callback(self._abort_when_added)
            raise
        return handle

    def _abort_when_added(self, future: concurrent.futures.Future) -> None:
        if not future.cancelled() and future.exception() is None:
            self.abort(future.result())

    def abort(self, request_id: int) -> None:
        """Queues an abort (thread-safe); it takes effect before the engine's next step."""
        with self._lock:
            self._inbox.append(("abort", request_id, self.steps))
        self._wake.set()

    # --- the engine thread -----------------------------------------------------------------------------

    def _deliver(self, handle: RequestHandle, update: Update) -> None:
        try:
            handle._loop.call_soon_threadsafe(handle._push, update)
        except RuntimeError:                # the event loop is closed: nobody is listening any more
            pass

    def _take_inbox(self) -> None:
        changed, taken = False, 0
        while True:
            with self._lock:
                if not self._inbox:
                    if changed:          # the queue length that add_request checks includes these now, so they
                        self.stats = self.engine.stats       # stop counting as pending in the same moment
                        self._pending_adds -= taken
                    return
                changed = True
                item = self._inbox.popleft()
                taken += item[0] == "add"
            if item[0] == "add":
                _, prompt, params, constraint, handle, future = item
                if not future.set_running_or_notify_cancel():
                    continue                   # its handler was cancelled before the engine saw it
                if self.state not in ("running",):
                    future.set_exception(EngineUnavailable(f"the engine is {self.state}; retry later"))
                    continue
                try:
                    arrival = self.engine.clock()
                    structured = {} if constraint is None else {"constraint": constraint}
                    request_id = self.engine.add_request(prompt, params, arrival_time=arrival, **structured)
                except Exception as exc:      # the engine's own checks (ValueError) go back to the handler
                    future.set_exception(exc)
                    continue
                handle.engine_arrival_s = arrival
                self._handles[request_id] = handle
                future.set_result(request_id)
            else:
                _, request_id, asked_at = item
                handle = self._handles.pop(request_id, None)
                if handle is None:
                    continue                   # already finished and delivered
                was_running = self.engine.abort(request_id)
                output = self.engine.pop_output(request_id)
                if self.on_finish is not None:
                    self.on_finish(output)
                self.stats = self.engine.stats
                self.abort_log.append(AbortRecord(request_id, asked_at, self.steps, was_running,
                                                  self.stats.blocks_used))

    def _finish(self, request_id: int, tokens: list[int], now: float) -> None:
        output = self.engine.pop_output(request_id)
        handle = self._handles.pop(request_id, None)
        if self.on_finish is not None:
            self.on_finish(output)
        if handle is not None:
            error = None
            if output.finish_reason == "error":
                error = client_message((output.error or "Exception").split(":")[0])
            self._deliver(handle, Update(tokens, True, output.finish_reason, output, now, error))

    def _abort_everything(self, reason: str | None = None) -> None:
        for request_id in list(self._handles):
            handle = self._handles.pop(request_id)
            output = None
            if self.engine.abort(request_id):
                output = self.engine.pop_output(request_id)
                if self.on_finish is not None:
                    self.on_finish(output)
            self._deliver(handle, Update([], True, "abort", output, self.engine.clock(), reason))
        self.stats = self.engine.stats

    def _run(self) -> None:
        failed_steps = 0
        try:
            while True:
                self._wake.clear()
                self._take_inbox()
                if self.state == "draining":
                    if not self.engine.has_unfinished() or time.monotonic() >= self._stop_deadline:
                        self._take_inbox()
                        self._abort_everything()
                        self.state = "stopped"
                        return
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    continue
                try:
                    events = self.engine.step()
                    failed_steps = 0
                except Exception as exc:            # not one request's fault: those in the engine fail, not the loop
                    failed_steps += 1
                    log.error("engine step failed (%d in a row)", failed_steps, exc_info=exc)
                    if failed_steps >= MAX_FAILED_STEPS:
                        raise
                    self._abort_everything(client_message(exc))
                    continue
                now = self.engine.clock()
                self.steps += 1
                made: dict[int, list[int]] = {}
                finished = []
                for event in events:
                    tokens = made.setdefault(event.request_id, [])
                    if event.token_id is not None:
                        tokens.append(event.token_id)
                    if event.finished:
                        finished.append(event.request_id)
                for request_id in finished:
                    self._finish(request_id, made.pop(request_id), now)
                for request_id, tokens in made.items():
                    handle = self._handles.get(request_id)
                    if handle is not None:
                        self._deliver(handle, Update(tokens, False, None, None, now))
                self.stats = self.engine.stats
                if self.on_step is not None:
                    self.on_step(sum(e.token_id is not None for e in events), self.stats)
        except BaseException as exc:            # a bug or an out-of-memory: every waiting handler hears of it
            log.critical("the engine loop failed", exc_info=exc)
            self.error = f"it stopped after an internal error ({type(exc).__name__}; the server log has the details)"
            self.state = "failed"
            try:
                self._abort_everything(self.error)
            except Exception:
                for handle in self._handles.values():
                    self._deliver(handle, Update([], True, "abort", None, 0.0, self.error))
                self._handles.clear()
            with self._lock:
                while self._inbox:
                    item = self._inbox.popleft()
                    if item[0] == "add":
                        self._pending_adds -= 1
                        if item[-1].set_running_or_notify_cancel():
                            item[-1].set_exception(EngineUnavailable(f"the engine failed: {self.error}"))
