"""uvicorn's h11 protocol with the connection bounds of ``serving/connections.py``.

A subclass passed to uvicorn as its ``http`` protocol (no patch of uvicorn itself): a header
deadline from each connection's opening and from each answer on it, and the oldest connection
still waiting for its request headers closed when a new one reaches the socket limit.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxexp_mlflow.serving.connections import header_timeout, max_connections

_TIMEOUT_ANSWER = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: 41\r\n\r\nThe request headers did not arrive whole."
)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and idle connections evicted first
    (``JAXEXP_HEADER_TIMEOUT_S``, ``JAXEXP_MAX_CONNECTIONS``: read when a connection opens)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timeout = header_timeout()
        self._max_connections = max_connections()
        self._header_timer: asyncio.TimerHandle | None = None
        self._opened = 0.0

    def _waiting(self) -> bool:
        """Whether no request is in progress: the connection waits for request headers."""
        return self.conn.their_state is h11.IDLE and (
            self.cycle is None or self.cycle.response_complete
        )

    def _arm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self._header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._waiting() and not self.transport.is_closing():
            self._drop(answer=self.conn.their_state is h11.IDLE)

    def _drop(self, *, answer: bool) -> None:
        if answer:
            self.transport.write(_TIMEOUT_ANSWER)
        self.transport.close()
        # counted out now, not when the loop reports the socket closed: a request arriving
        # meanwhile is measured against the connections that remain
        self.connections.discard(self)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._opened = self.loop.time()
        self._arm()
        open_ = list(self.connections)
        excess = len(open_) - self._max_connections + 1  # uvicorn answers 503 at the limit
        if excess > 0:
            idle = [
                c
                for c in open_
                if isinstance(c, GuardedH11Protocol)
                and c is not self
                and c._waiting()
                and not c.transport.is_closing()
            ]
            for c in sorted(idle, key=lambda c: c._opened)[:excess]:
                c._drop(answer=True)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's headers have the same deadline
