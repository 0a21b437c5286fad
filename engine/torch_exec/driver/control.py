"""The driver's control socket: a ZeroMQ ROUTER that speaks only authenticated wire messages.

Binds `executor.zmq_host` (127.0.0.1 unless the user names an address, with a warning naming the
port then). Every received frame goes through `wire.Codec.decode` (MAC first, then schema); one
that fails -- a port scanner, a stray client, a pickle -- is dropped, logged (the first
`LOGGED_DROPS`) and counted in `dropped`, and never reaches the engine.

No peer chooses its own ZeroMQ identity (a local process could take `stage1` before the real
stage connected): each sender name (`stage<i>`, signed into every frame) is bound to the
connection of its first authentic frame, frames naming it from another connection are dropped,
and the driver addresses a stage through that binding (`peer`). A message larger than
`MAX_FRAME_BYTES` is refused by ZeroMQ from its header, before it is buffered (700 MB
unauthenticated frames had raised the driver's memory from 249 MB to 3.6 GB); the largest
legitimate message to the driver is a few hundred kB.
"""
from __future__ import annotations

import logging

import engine.torch_exec.wire.messages as wire
from engine.torch_exec.wire.addresses import warn_exposed

LOGGED_DROPS = 10
MAX_FRAME_BYTES = 16 << 20  # a stray client cannot make the driver buffer more than this per message
log = logging.getLogger(__name__)


class ControlSocket:
    """ROUTER + codec; `recv()` returns authentic messages only."""

    def __init__(self, codec: wire.Codec, host: str, port: int = 0) -> None:
        import zmq

        self.codec = codec
        self.dropped = 0
        self.peers: dict[str, bytes] = {}  # sender name -> the connection that speaks for it
        self.ctx = zmq.Context()
        self.sock = sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self.port = port
        warn_exposed(f"the driver's control socket (executor.zmq_host, port {port})", host, port)
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "*") else host
        self.address = f"tcp://{connect_host}:{port}"

    def peer(self, name: str) -> bytes:
        """The connection of sender `name` (KeyError until it has spoken)."""
        return self.peers[name]

    def send(self, name: str, msg, nonblocking: bool = False) -> None:
        import zmq

        self.sock.send_multipart([self.peer(name), self.codec.encode(msg, to=name)],
                                 flags=zmq.NOBLOCK if nonblocking else 0)

    def send_raw(self, name: str, frame: bytes) -> None:
        """An already encoded message (the same launch goes to every stage)."""
        self.sock.send_multipart([self.peer(name), frame])

    def recv(self):
        """The next authentic message, None when none is waiting."""
        import zmq

        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                if len(frames) != 2:
                    raise wire.WireError(f"{len(frames) - 1} frames; a message is one")
                msg = self.codec.decode(frames[1])
                sender = self.codec.last_sender
                if self.peers.setdefault(sender, frames[0]) != frames[0]:
                    raise wire.WireError(f"{sender!r} already speaks from another connection")
                return msg
            except wire.WireError as exc:
                self.drop(frames[0][:32], exc)

    def drop(self, source, exc: Exception) -> None:
        """Count (and log the first `LOGGED_DROPS` of) the frames that failed the codec, here or on a
        stage's lane (wire/lane.py)."""
        self.dropped += 1
        if self.dropped <= LOGGED_DROPS:
            log.warning("dropped a frame from %r on the control line: %s", source, exc)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
