"""What one connection may cost the server: time to send its headers and body, idle time, header bytes. Chapter 11.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`), concurrent connections (`limit_concurrency`,
503 above it) and the header size (h11's `max_incomplete_event_size`), but not how long a client may take
to send a request: a client that sends one header byte a second holds its connection for ever (the
"slowloris" attack). `timed_protocol` adds those two clocks to uvicorn's h11 protocol: from the moment the
server waits for a request's headers, they must be complete within `header_timeout_s`; once they are, the
body within `body_timeout_s`. A connection that misses either is closed.

h11 checks the header size only while the headers are incomplete in its buffer, so 100 KB of headers that
arrive in one read pass. The protocol counts a request's header bytes itself, however they arrive, and answers
more than MAX_HEADER_BYTES with a 431 before h11 parses them. A request whose Content-Length passes the body
limit is answered 413 from its headers alone: its body never reaches h11 or the app, and what the client sends
of it anyway is dropped as it arrives (read into one shared buffer and counted, no parsing, at most DISCARD_RATE
bytes a second), so that the client reads the 413 rather than a reset, until it is all in, DISCARD_BYTES have
passed or the body's deadline, and the connection closes. Four clients each sending bodies of the limit's size
cost the event loop next to nothing, and wait on their full sockets rather than take the machine's CPUs. The
app may refuse a request while its body is still arriving (`jsonscan`: too many values, counted per chunk): it calls
the scope's REFUSE_BODY extension, and the protocol answers at once and drops the rest of the declared body the same
way. uvicorn counts the connection it is deciding on among the open ones, so its limit is set one above
max_connections: max_connections connections are served.

    uvicorn.run(app, **uvicorn_options(config))     # the limits of a ServeConfig, as uvicorn options
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from http import HTTPStatus

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["timed_protocol", "uvicorn_options", "body_too_large", "MAX_HEADER_BYTES", "DISCARD_BYTES", "REFUSE_BODY"]

MAX_HEADER_BYTES = 64 * 1024     # the request line and headers together; more closes the connection (431)
DISCARD_BYTES = 64 * 2**20       # of a refused body, at most this much is read and dropped before closing
DISCARD_RATE = 16 * 2**20        # bytes a second: how fast a refused body is read (4 s for DISCARD_BYTES)
REFUSE_BODY = "llminfer.refuse_body"  # scope["extensions"][REFUSE_BODY](status, error body): answer, drop the rest
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*(\d{1,30})[ \t]*(?=\r\n)", re.IGNORECASE)
log = logging.getLogger("llminfer.serve")


def body_too_large(limit: int) -> tuple[str, str]:
    """The 413's message and code, for a body over limit bytes: the one wording the protocol and the app use."""
    return (f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes); "
            "send a smaller request", "request_too_large")


def _response(status: bytes, message: str, code: str, error: dict | None = None) -> bytes:
    """A complete HTTP/1.1 response carrying an OpenAI-style error (error, or one made of message and code), closing
    the connection."""
    error = error or {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    body = json.dumps(error).encode()
    return (b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
            % (status, len(body), body))


class _TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers and another for its body."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_body_bytes: int | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._deadline = None
        self._waiting_for = None
        self._head = b""                 # the waiting request's bytes so far, up to the end of its headers
        self._discard = 0                # a refused body's bytes still to drop before closing (by a _Discard)
        self._body_left = None           # the waiting request's declared body bytes not yet received
        super().connection_made(transport)
        self._arm("headers", self.header_timeout_s)

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._waiting_for = what
        self._deadline = self.loop.call_later(seconds, self._expired, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, None

    def _expired(self, what: str) -> None:
        if self._waiting_for == what and not self.transport.is_closing():
            self.transport.close()           # the client took too long: its connection goes

    def _headers_fit(self, data: bytes) -> bool:
        """False (after answering and closing) once the waiting request's headers pass MAX_HEADER_BYTES (431),
        or once they are complete and declare a body over max_body_bytes (413, its body then dropped)."""
        start = max(len(self._head) - 3, 0)
        self._head += data
        end = self._head.find(b"\r\n\r\n", start)
        size = end + 4 if end >= 0 else len(self._head)
        if size > MAX_HEADER_BYTES:
            self._refuse(b"431 Request Header Fields Too Large", f"the request headers are larger than this "
                         f"server's limit of {MAX_HEADER_BYTES} bytes", "headers_too_large")
            return False
        if end < 0:
            return True
        body_so_far, head, self._head = len(self._head) - size, self._head[:size], b""
        declared = _CONTENT_LENGTH.search(head)
        self._body_left = int(declared[1]) - body_so_far if declared else None
        if self.max_body_bytes is not None and declared and int(declared[1]) > self.max_body_bytes:
            self._discard = min(int(declared[1]), DISCARD_BYTES) - body_so_far
            self._refuse(b"413 Content Too Large", *body_too_large(self.max_body_bytes), keep_reading=True)
            return False
        return True

    def _refuse(self, status: bytes, message: str, code: str, keep_reading: bool = False,
                error: dict | None = None) -> None:
        """Answers status with an error body and closes; with keep_reading, only once the body is dropped."""
        if error is None:                # the app logs its own refusals
            log.info("refused a request from its headers: %s %s", status.decode(), message[:200])
        self.transport.write(_response(status, message, code, error))
        if keep_reading and self._discard > 0:
            self._arm("discard", self.body_timeout_s)
            self.transport.set_protocol(_Discard(self, self._discard))
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:
            if not self._headers_fit(data):
                return
        elif self._body_left is not None:
            self._body_left -= len(data)
        super().data_received(data)
        if self.cycle is not None and REFUSE_BODY not in self.cycle.scope.setdefault("extensions", {}):
            self.cycle.scope["extensions"][REFUSE_BODY] = self._refuse_body
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._arm("body", self.body_timeout_s)
        elif state is not h11.IDLE:          # the request is in (DONE), or the connection is ending
            self._disarm()

    def _refuse_body(self, status: int, error: dict) -> None:
        """The app's refusal of the request whose body is arriving: answered now (the app's own response is then not
        sent), the rest of the declared body dropped as it comes, then the connection closed."""
        cycle, left = self.cycle, self._body_left
        if cycle is None or cycle.response_started or self.transport.is_closing():
            return
        cycle.disconnected = True        # uvicorn sends nothing more for this request
        self._discard = 0 if left is None or self.conn.their_state is not h11.SEND_BODY else min(left, DISCARD_BYTES)
        self.flow.resume_reading()
        self._refuse(b"%d %s" % (status, HTTPStatus(status).phrase.encode()), "", "", keep_reading=True, error=error)

    def on_response_complete(self) -> None:
        self._head = b""
        super().on_response_complete()
        if not self.transport.is_closing():  # keep-alive: the next request's headers are on the clock again
            self._arm("headers", self.header_timeout_s)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class _Discard(asyncio.BufferedProtocol):
    """What reads a refused body: its bytes land in one buffer that every connection shares and are only counted (no
    object per read, no parsing); once `left` of them are in, the connection closes. Chapter 11.

    It reads at most DISCARD_RATE bytes a second (reading pauses while it is ahead): a client that sends bad bodies
    back to back then spends its time waiting on a full socket, not sending, and leaves the machine's CPUs to the
    other requests. It still reads its answer once its body is in (4 MiB: a quarter of a second)."""

    _buffer = memoryview(bytearray(256 * 1024))

    def __init__(self, owner: _TimedH11Protocol, left: int):
        self.owner, self.left, self.read, self.start = owner, left, 0, owner.loop.time()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.left, self.read = self.left - nbytes, self.read + nbytes
        transport = self.owner.transport
        if self.left <= 0:
            self.owner._disarm()
            transport.close()
            return
        ahead = self.read / DISCARD_RATE - (self.owner.loop.time() - self.start)
        if ahead > 0.005:
            transport.pause_reading()
            self.owner.loop.call_later(ahead, lambda: transport.is_closing() or transport.resume_reading())

    def eof_received(self) -> bool:
        return False                     # the client stopped sending: close

    def connection_lost(self, exc) -> None:
        self.owner.connection_lost(exc)  # uvicorn's bookkeeping of its connections


def timed_protocol(header_timeout_s: float, body_timeout_s: float, max_body_bytes: int | None = None) -> type:
    """uvicorn's h11 protocol, closing connections whose headers or body take longer than these, and answering
    413 from the headers to a declared body over max_body_bytes. Chapter 11."""
    return type("TimedH11Protocol", (_TimedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s),
                 "max_body_bytes": max_body_bytes})


def uvicorn_options(config) -> dict:
    """uvicorn.Config keyword arguments for a ServeConfig's connection limits. Chapter 11."""
    return dict(http=timed_protocol(config.header_timeout_s, config.body_timeout_s, config.max_request_bytes),
                timeout_keep_alive=max(1, int(round(config.keep_alive_timeout_s))),
                limit_concurrency=config.max_connections + 1, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
