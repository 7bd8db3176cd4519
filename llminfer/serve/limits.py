"""What one connection may cost the server: time to send its headers and body, idle time, header bytes. Chapter 11.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`), concurrent connections (`limit_concurrency`,
503 above it) and the header size (h11's `max_incomplete_event_size`), but not how long a client may take
to send a request: a client that sends one header byte a second holds its connection for ever (the
"slowloris" attack). `timed_protocol` adds those two clocks to uvicorn's h11 protocol: from the moment the
server waits for a request's headers, they must be complete within `header_timeout_s`; once they are, the
body within `body_timeout_s`. A connection that misses either is closed.

h11 checks the header size only while the headers are incomplete in its buffer, so 100 KB of headers that
arrive in one read pass. The protocol counts a request's header bytes itself, however they arrive, and answers
more than MAX_HEADER_BYTES with a 431 before h11 parses them. uvicorn counts the connection it is deciding on
among the open ones, so its limit is set one above max_connections: max_connections connections are served.

    uvicorn.run(app, **uvicorn_options(config))     # the limits of a ServeConfig, as uvicorn options
"""
from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["timed_protocol", "uvicorn_options", "MAX_HEADER_BYTES"]

MAX_HEADER_BYTES = 64 * 1024     # the request line and headers together; more closes the connection (431)


class _TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for a request's headers and another for its body."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._deadline = None
        self._waiting_for = None
        self._head_bytes, self._head_tail = 0, b""     # the waiting request's header bytes so far, its last 3
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
        """False (after answering 431 and closing) once the waiting request's headers pass MAX_HEADER_BYTES."""
        seen = self._head_tail + data
        end = seen.find(b"\r\n\r\n")
        size = self._head_bytes - len(self._head_tail) + (end + 4 if end >= 0 else len(seen))
        if size > MAX_HEADER_BYTES:
            body = (b'{"error":{"message":"the request headers are larger than this server\'s limit of %d bytes",'
                    b'"type":"invalid_request_error","param":null,"code":"headers_too_large"}}' % MAX_HEADER_BYTES)
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
            self.transport.close()
            return False
        self._head_bytes, self._head_tail = (0, b"") if end >= 0 else (size, seen[-3:])
        return True

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and not self._headers_fit(data):
            return
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._arm("body", self.body_timeout_s)
        elif state is not h11.IDLE:          # the request is in (DONE), or the connection is ending
            self._disarm()

    def on_response_complete(self) -> None:
        self._head_bytes, self._head_tail = 0, b""
        super().on_response_complete()
        if not self.transport.is_closing():  # keep-alive: the next request's headers are on the clock again
            self._arm("headers", self.header_timeout_s)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing connections whose headers or body take longer than these. Chapter 11."""
    return type("TimedH11Protocol", (_TimedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s)})


def uvicorn_options(config) -> dict:
    """uvicorn.Config keyword arguments for a ServeConfig's connection limits. Chapter 11."""
    return dict(http=timed_protocol(config.header_timeout_s, config.body_timeout_s),
                timeout_keep_alive=max(1, int(round(config.keep_alive_timeout_s))),
                limit_concurrency=config.max_connections + 1, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
