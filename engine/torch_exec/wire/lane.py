"""The driver's private line to a spawned stage: a socketpair carrying length-prefixed wire frames.

Why: on the 2-core dev machine a launch and its sampled ids went through ZeroMQ over loopback
TCP, and each direction wakes three threads (the sender's ZeroMQ I/O thread, the receiver's I/O
thread, the receiver): a ping-pong of 100 bytes took 55-81 us against 10 us over a socketpair
(median of 2,000, load 9-13), and in a loaded run every extra wake-up can wait for a core.
A socketpair made by the driver before it starts a stage (the child end travels as a start
argument, like the run secret) wakes the reader directly and listens on nothing, so no other
process can reach it. Frames are the same HMAC-authenticated wire messages (wire/messages.py): 4 bytes of
length (little-endian), then the frame. External stages (`executor.launch=external`) keep
ZeroMQ; spawned ones use ZeroMQ for the start-up handshake and their lane from `Ready` on.

Waiting: on the same machine at load 15-20 (EEVDF scheduler, Linux 6.18) the driver, asleep in
one long poll while a forward ran, woke 3.5-4.5 ms after the stage's sampled ids were sent; polling
in 1 ms slices it woke after 0.17-0.26 ms (medians of 30 steps). So while micro-batches are in
flight the driver waits in `POLL_SLICE_S` slices (about 1,000 wake-ups a second, ~1-2% of a
core); sleeping until 80% of a micro-batch's expected time first lost most of the gain (forward
times vary too much on a loaded machine). A stage waits for its next launch in such slices for
`ACTIVE_WINDOW_S` after a micro-batch, then in long ones (an idle engine does not wake 1,000
times a second).

Sends block (a stage's messages are small, a launch at most a token budget's ids: far below the
socket buffers); reads take what has arrived and return whole frames.
"""
from __future__ import annotations

import select
import socket
import struct
from collections import deque

HEADER = struct.Struct("<I")
POLL_SLICE_S = 0.001
ACTIVE_WINDOW_S = 0.05
READ_BYTES = 1 << 20
MAX_FRAME_BYTES = 64 << 20  # a corrupt length ends the line instead of buffering without bound


class Stopped(Exception):
    """A stage's end: the driver said stop, or is gone (nobody to report to)."""


class LaneClosed(ConnectionError):
    """The other end is gone (process ended or closed its end)."""


class Lane:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(True)
        self.buf = bytearray()

    @staticmethod
    def pair() -> tuple["Lane", socket.socket]:
        """(this process's lane, the socket to hand to the child)."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return Lane(a), b

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, frame: bytes) -> None:
        try:
            self.sock.sendall(HEADER.pack(len(frame)) + frame)
        except OSError as exc:
            raise LaneClosed(f"the lane is closed ({exc})") from None

    def poll(self, timeout_s: float) -> bool:
        """A whole frame is waiting, or bytes arrived within `timeout_s` (then `frames()` may still be empty)."""
        if self._complete():
            return True
        return bool(select.select([self.sock], [], [], max(0.0, timeout_s))[0])

    def frames(self) -> list[bytes]:
        """Whole frames received so far (reads what is there without blocking)."""
        while True:
            try:
                chunk = self.sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise LaneClosed(f"the lane is closed ({exc})") from None
            if not chunk:
                if self._complete():
                    break
                raise LaneClosed("the other end closed the lane")
            self.buf += chunk
            if len(chunk) < READ_BYTES:
                break
        out = []
        while self._complete():
            n = HEADER.unpack_from(self.buf)[0]
            out.append(bytes(self.buf[HEADER.size:HEADER.size + n]))
            del self.buf[:HEADER.size + n]
        return out

    def _complete(self) -> bool:
        if len(self.buf) < HEADER.size:
            return False
        n = HEADER.unpack_from(self.buf)[0]
        if n > MAX_FRAME_BYTES:
            raise LaneClosed(f"a frame of {n} bytes announced: the lane is corrupt")
        return len(self.buf) >= HEADER.size + n

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class DriverLanes:
    """The driver's lanes, one per spawned stage; `on` from the stages' `Ready` (before it, and
    for external stages, messages go over the control socket)."""

    def __init__(self) -> None:
        self.lanes: dict[int, Lane] = {}
        self.fds: set[int] = set()
        self.on = False

    def add(self, stage: int, lane: Lane) -> None:
        self.lanes[stage] = lane
        self.fds.add(lane.fileno())

    def carries(self, stage: int) -> bool:
        return self.on and stage in self.lanes

    def messages(self, events, codec, drop) -> tuple[list, list[int]]:
        """Authentic messages from the lanes whose fds `events` names (every lane when None; zmq's
        poller names plain fds by number), and the stages whose lane is closed. A frame that fails
        the codec, or names another sender than the lane's stage, goes to `drop(stage, error)`."""
        out, closed = [], []
        for s, lane in self.lanes.items():
            if events is not None and lane.fileno() not in events:
                continue
            try:
                frames = lane.frames()
            except LaneClosed:
                closed.append(s)
                continue
            for frame in frames:
                try:
                    msg = codec.decode(frame)
                    if codec.last_sender != f"stage{s}":
                        raise ValueError(f"{codec.last_sender!r} on stage {s}'s lane")
                except ValueError as exc:  # wire.WireError is a ValueError
                    drop(f"stage {s}'s lane", exc)
                    continue
                out.append(msg)
        return out, closed

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()


class StageLine:
    """A stage's line to the driver: its ZeroMQ socket until `use_lane()` (after `Ready`), then
    its lane when it has one (spawned stages); external stages stay on ZeroMQ."""

    def __init__(self, sock, lane: Lane | None) -> None:
        self.sock, self.lane = sock, lane
        self.on = False
        self.inbox: deque[bytes] = deque()  # whole frames read from the lane, not yet handled

    def use_lane(self) -> None:
        self.on = self.lane is not None

    @property
    def pollable(self):
        """What a zmq.Poller watches for the driver's frames."""
        return self.lane if self.on else self.sock

    def send(self, frame: bytes) -> None:
        (self.lane if self.on else self.sock).send(frame)

    def frame(self, timeout_s: float) -> bytes | None:
        """The driver's next frame, waiting up to `timeout_s`; None if none came. Raises
        LaneClosed when the driver's end is gone."""
        if not self.on:
            import zmq

            return self.sock.recv() if self.sock.poll(int(timeout_s * 1000), zmq.POLLIN) else None
        if not self.inbox and self.lane.poll(timeout_s):
            self.inbox.extend(self.lane.frames())
        return self.inbox.popleft() if self.inbox else None
