"""What one HTTP client may cost the server: body size, and how long it may take to send a request.

Without these a single client could hold the server: a 50 MB body was read whole into memory
(1.1 GB RSS) and parsed on the event loop (3.8 s during which no other request was served), and a
client that sends its headers or body one byte at a time kept a connection forever.

- `BodyLimit` (ASGI middleware) reads each request body itself before the app sees it: more than
  `serve.max_body_bytes` (declared in Content-Length, or counted as it arrives) is answered 413
  at once, and a body that stalls for `serve.body_timeout_s` between chunks is answered 408. Both
  close the connection. The app then gets the body in one piece.
- `GuardedH11Protocol` (uvicorn's h11 protocol) closes a connection whose request line and headers
  are not complete `serve.header_timeout_s` after its first byte (or after it opened). Idle
  keep-alive connections are closed by uvicorn after `serve.keep_alive_s`.
"""
from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from testbed.serve.protocol import ApiError


def _error(status: int, message: str) -> tuple[dict, dict]:
    body = json.dumps(ApiError(status, message).body()).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]}
    return start, {"type": "http.response.body", "body": body, "more_body": False}


class BodyLimit:
    """Read a request body within `max_bytes` and with no gap longer than `idle_s`, else 413/408."""

    def __init__(self, app, max_bytes: int, idle_s: float) -> None:
        self.app, self.max_bytes, self.idle_s = app, max_bytes, idle_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send, 413, f"the request body ({int(declared):,} bytes) exceeds "
                                          f"serve.max_body_bytes={self.max_bytes:,}")
            return
        body = await self._read(receive, send)
        if body is None:
            return
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # what comes after the body: the disconnect

        await self.app(scope, replay, send)

    async def _read(self, receive, send) -> bytes | None:
        """The whole body, or None once the client has been answered (413/408) or has gone."""
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except asyncio.TimeoutError:
                await self._refuse(send, 408, f"the request body stalled for serve.body_timeout_s={self.idle_s:g} s")
                return None
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, 413, f"the request body exceeds serve.max_body_bytes={self.max_bytes:,}")
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        start, body = _error(status, message)
        await send(start)
        await send(body)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's line and headers.

    The timer runs while the peer owes us a request head (h11's `their_state` is IDLE) and has
    sent part of it, or has sent nothing since the connection opened; uvicorn's own keep-alive
    timer covers the quiet gap between requests. At the deadline the connection is closed.
    """

    header_timeout_s: float = 10.0  # set per server by `guarded_protocol`

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_expired)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        waiting_for_head = self.conn.their_state is h11.IDLE
        if not waiting_for_head:
            self._cancel_head_timer()
        elif self._head_timer is None and data:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_expired)

    def connection_lost(self, exc) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout_s: float) -> type[GuardedH11Protocol]:
    """A protocol class carrying this server's header deadline (uvicorn builds one per connection)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})
