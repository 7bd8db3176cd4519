"""What one connection may cost the server: time to send its headers and body, idle time, header bytes. Chapter 11.

uvicorn bounds idle keep-alive connections (`timeout_keep_alive`), concurrent connections (`limit_concurrency`,
503 above it) and the header size (h11's `max_incomplete_event_size`), but not how long a client may take
to send a request: a client that sends one header byte a second holds its connection for ever (the
"slowloris" attack). `timed_protocol` adds those two clocks to uvicorn's h11 protocol: from the moment the
server waits for a request's headers, they must be complete within `header_timeout_s`; once they are, the
body within `body_timeout_s`. A connection that misses either is closed.

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

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._arm("body", self.body_timeout_s)
        elif state is not h11.IDLE:          # the request is in (DONE), or the connection is ending
            self._disarm()

    def on_response_complete(self) -> None:
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
                limit_concurrency=config.max_connections, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
