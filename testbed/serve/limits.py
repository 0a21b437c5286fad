"""What one HTTP client may cost the server: body size, and how long it may take to send a request.

Without these a single client could hold the server: a 50 MB body was read whole into memory
(1.1 GB RSS) and parsed on the event loop (3.8 s during which no other request was served), and a
client that sends its headers or body one byte at a time kept a connection forever.

- `BodyLimit` (ASGI middleware) reads each request body itself before the app sees it: more than
  `serve.max_body_bytes` (declared in Content-Length, or counted as it arrives) is answered 413
  at once, and a body not complete `serve.body_timeout_s` after the app began reading it is
  answered 408 (a deadline for the whole body: a limit between chunks never cut a body drip-fed
  one byte every 5 s, issue 38 item 10). Both close the connection. The app then gets the body
  in one piece.
- `GuardedH11Protocol` (uvicorn's h11 protocol) closes a connection whose request line and headers
  are not complete `serve.header_timeout_s` after its first byte (or after it opened), and answers
  429 and closes a new connection from an address that already holds
  `serve.max_connections_per_client` (slow clients cannot pile up connections instead). Idle
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
    """Read a request body within `max_bytes` and `deadline_s` seconds, else 413/408."""

    def __init__(self, app, max_bytes: int, deadline_s: float) -> None:
        self.app, self.max_bytes, self.deadline_s = app, max_bytes, deadline_s

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
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.deadline_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                await self._refuse(send, 408, f"the request body was not complete within "
                                              f"serve.body_timeout_s={self.deadline_s:g} s")
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
    max_per_client: int = 512
    per_client: dict = {}  # peer address -> open connections; `guarded_protocol` gives each server its own

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = None
        self._peer = (transport.get_extra_info("peername") or ("?",))[0]
        if self.per_client.get(self._peer, 0) >= self.max_per_client:
            self._peer = None
            start, body = _error(429, f"this address holds serve.max_connections_per_client="
                                      f"{self.max_per_client} connections already; close one first")
            head = b"".join(k + b": " + v + b"\r\n" for k, v in start["headers"])
            transport.write(b"HTTP/1.1 429 Too Many Requests\r\n" + head + b"\r\n" + body["body"])
            transport.close()
            return
        self.per_client[self._peer] = self.per_client.get(self._peer, 0) + 1
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
        if self._peer is not None:
            left = self.per_client.get(self._peer, 1) - 1
            if left > 0:
                self.per_client[self._peer] = left
            else:
                self.per_client.pop(self._peer, None)
            self._peer = None
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout_s: float, max_per_client: int) -> type[GuardedH11Protocol]:
    """A protocol class carrying this server's header deadline and connection cap (uvicorn
    builds one instance per connection; the count per address is shared by the class)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s,
                                                              "max_per_client": max_per_client, "per_client": {}})
