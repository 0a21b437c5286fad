"""Emulated slow links on loopback: paced, chunked activation sends and their reassembly.

The stages use `LinkSender` / `LinkReceiver` (below): policy-scheduled, interleaved transfers.
`send_chunked_paced` / `recv_chunked` are the plain FIFO helpers (one tensor at a time).

A send of n bytes over a link of bandwidth B and latency L takes L + n / B: the sender waits L
once, then sends the tensor's bytes in chunks of at most `chunk_bytes`, sleeping chunk / B
before each. The receiver posts one receive per chunk straight into the pre-allocated tensor's
byte view, so the chunks reassemble bit-exactly before the stage computes.
"""
from __future__ import annotations

import time

import torch


def byte_chunks(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(a, min(nbytes, a + chunk_bytes)) for a in range(0, nbytes, chunk_bytes)] or [(0, 0)]


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def split(t: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    flat = flat_bytes(t)
    return [flat[a:b] for a, b in byte_chunks(flat.numel(), chunk_bytes)]


def reassemble(chunks: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    flat = flat_bytes(out)
    pos = 0
    for c in chunks:
        flat[pos:pos + c.numel()].copy_(c)
        pos += c.numel()
    if pos != flat.numel():
        raise ValueError(f"chunks carry {pos} bytes, the tensor has {flat.numel()}")
    return out


def send_chunked_paced(dist, t: torch.Tensor, dst: int, chunk_bytes: int, bandwidth_Bps: float | None,
                       latency_s: float) -> None:
    if latency_s:
        time.sleep(latency_s)
    for c in split(t, chunk_bytes):
        pace(c.numel(), bandwidth_Bps)
        dist.send(c, dst=dst)


def recv_chunked(dist, out: torch.Tensor, src: int, chunk_bytes: int) -> torch.Tensor:
    for c in split(out, chunk_bytes):  # views into `out`: received in place
        dist.recv(c, src=src)
    return out


# --- policy-scheduled links (schedule_transfer) ----------------------------------------------------
#
# When a run names link.bandwidth / link.latency, every activation a stage produces is queued at
# its outgoing link as a `LinkItem` (a PendingTransfer: .mb, .kind, .total_bytes, .remaining_bytes,
# .enqueued_s), and a sender thread asks the run's policy -- rebuilt in the stage process from its
# class and params -- `schedule_transfer(link, pending)` each time the link is free: which item and
# how many bytes go next (FIFO whole tensors by default; MoLink: decode first, just-in-time prefill
# chunks). Each transfer is framed by a header (mb id, byte offset, bytes, total bytes, whether a
# metadata blob follows, delivery time) so the receiver thread can reassemble interleaved
# micro-batches into per-micro-batch buffers.
#
# Link emulation: a transfer of n bytes occupies the link for n / B (the sender sleeps that long,
# in sub-chunks of at most `chunk_bytes`); its data is delivered L later (the header carries
# `ready = end of sending + L` on CLOCK_MONOTONIC, shared by the processes of one machine; the
# receiving stage does not compute on it before then -- bounded by L, so clock skew across
# machines can delay a delivery by at most L). So latency pipelines with other transfers, as on
# a real link, instead of occupying it.

UNPACED_BPS = 1e15  # what a policy is told of a link with latency but no bandwidth limit (finite: chunk sizes)
HEADER = 6  # mb_id, offset, nbytes, total_bytes, has_meta, ready_ns
PACE_SLICE_S = 0.25  # a paced sleep is cut into slices of at most this, each adding to `moved_bytes`


def pace(nbytes: int, bandwidth_Bps: float | None, progress=None) -> None:
    """Occupy the link for nbytes / B, reporting progress (bytes) at least every PACE_SLICE_S:
    a 10 kbps link moving a 100 KB activation takes 80 s, and the driver's hang check must see that
    bytes are still moving."""
    if not bandwidth_Bps:
        return
    left = nbytes / bandwidth_Bps
    while left > 0:
        dt = min(left, PACE_SLICE_S)
        time.sleep(dt)
        left -= dt
        if progress is not None:
            progress(dt * bandwidth_Bps)


class _MbRef:
    """What a transfer scheduler may look at of a micro-batch (MoLink: `.prefills` non-empty)."""

    __slots__ = ("mb_id", "kind", "prefills", "decodes")

    def __init__(self, mb_id: int, kind: str, prefills, decodes) -> None:
        self.mb_id, self.kind, self.prefills, self.decodes = mb_id, kind, prefills, decodes


class LinkItem:
    """An activation (or its rest) waiting at a link's sending end: a `PendingTransfer`."""

    __slots__ = ("mb", "total_bytes", "remaining_bytes", "enqueued_s", "flat", "meta", "first_sent_s")

    def __init__(self, mb: _MbRef, flat: torch.Tensor, meta: bytes | None, now: float) -> None:
        self.mb = mb
        self.flat = flat
        self.meta = meta
        self.total_bytes = int(flat.numel())
        self.remaining_bytes = self.total_bytes
        self.enqueued_s = now
        self.first_sent_s: float | None = None

    @property
    def kind(self) -> str:
        return self.mb.kind


class LinkSender:
    """The sending end of one link: a thread that sends what the policy picks, when the link is free.

    `events` collects (name, start, end, mb_id) spans for the driver: `queue:<kind>` from an
    item's enqueueing to its first byte on the link, `xfer:<kind>` per transfer.
    """

    def __init__(self, dist, src: int, dst: int, policy, bandwidth_Bps: float | None, latency_s: float,
                 chunk_bytes: int, device: str = "cpu", info=None) -> None:
        import threading

        self.dist, self.src, self.dst = dist, src, dst
        self.policy = policy
        self.bw = bandwidth_Bps
        self.lat = float(latency_s or 0.0)
        self.chunk = int(chunk_bytes)
        self.device = device
        self.info = info or (lambda now: {})
        self.pending: list[LinkItem] = []
        self.cv = threading.Condition()
        self.events: list[tuple] = []
        self.moved_bytes = 0.0  # bytes the paced link has carried so far (progress for the hang check)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="link-send", daemon=True)
        self.thread.start()

    def put(self, mb: _MbRef, payload: torch.Tensor, meta: bytes | None) -> None:
        if self.error is not None:
            raise RuntimeError(f"link {self.src}->{self.dst} sender failed: {self.error!r}") from self.error
        item = LinkItem(mb, flat_bytes(payload), meta, time.perf_counter())
        with self.cv:
            self.pending.append(item)
            self.cv.notify()

    def drain_events(self) -> list[tuple]:
        with self.cv:
            ev, self.events = self.events, []
        return ev

    def _choose(self) -> tuple[LinkItem, int]:
        from engine.core.policy import LinkState

        now = time.perf_counter()
        link = LinkState(self.src, self.dst, float(self.bw or UNPACED_BPS), self.lat, now, self.info(now))
        t = self.policy.schedule_transfer(link, list(self.pending))
        item, n = t.item, int(t.nbytes)
        if item not in self.pending:
            raise RuntimeError(f"schedule_transfer chose micro-batch {item.mb.mb_id}, which is not pending")
        if not 0 < n <= item.remaining_bytes:
            raise RuntimeError(f"schedule_transfer chose {n} bytes of micro-batch {item.mb.mb_id}, "
                               f"which has {item.remaining_bytes} left")
        return item, n

    def _run(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.pending:
                        self.cv.wait()
                    item, n = self._choose()
                self._send(item, n)
        except BaseException as exc:  # reported by the stage's next put()
            self.error = exc

    def _send(self, item: LinkItem, n: int) -> None:
        t0 = time.perf_counter()
        off = item.total_bytes - item.remaining_bytes
        meta = item.meta if off == 0 else None
        if item.first_sent_s is None:
            item.first_sent_s = t0
        data = item.flat[off:off + n]
        # occupy the link for n / B (and the metadata rounds' bytes), in sub-chunks
        pieces = [data[a:b] for a, b in byte_chunks(n, self.chunk)]
        ready = t0 + ((n + (len(meta) + 8 if meta else 0)) / self.bw if self.bw else 0.0) + self.lat
        hdr = torch.tensor([item.mb.mb_id, off, n, item.total_bytes, 1 if meta else 0, int(ready * 1e9)],
                           dtype=torch.long)
        dev = self.device
        self.dist.send(hdr.to(dev), dst=self.dst)
        if meta:
            self.dist.send(torch.tensor([len(meta)], dtype=torch.long).to(dev), dst=self.dst)
            self.dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(dev), dst=self.dst)
            pace(len(meta) + 8, self.bw, self._progress)
        for c in pieces:
            pace(c.numel(), self.bw, self._progress)
            self.dist.send(c, dst=self.dst)
        t1 = time.perf_counter()
        kind = "decode" if not item.mb.prefills else "prefill"
        with self.cv:
            item.remaining_bytes -= n
            if item.remaining_bytes == 0:
                self.pending.remove(item)
            if off == 0:
                self.events.append((f"queue:{kind}", item.enqueued_s, t0, item.mb.mb_id))
            self.events.append((f"xfer:{kind}", t0, t1, item.mb.mb_id))


    def _progress(self, nbytes: float) -> None:
        self.moved_bytes += nbytes


class LinkReceiver:
    """The receiving end: a thread that reassembles interleaved transfers per micro-batch.

    A complete micro-batch's (buffer, ready time, metadata shape) goes to `done[mb_id]`, and its id
    is pushed through `notify` (a zmq inproc PAIR socket the stage's main loop polls). The metadata
    blob is an authenticated `TensorMeta` (engine/torch_exec/wire/messages.py), read by `read_meta`.
    """

    def __init__(self, dist, src: int, device: str, chunk_bytes: int, notify_addr: str, zctx,
                 read_meta=None) -> None:
        import threading

        self.dist, self.src, self.device, self.chunk = dist, src, device, int(chunk_bytes)
        self.read_meta = read_meta
        self.notify_addr, self.zctx = notify_addr, zctx
        self.parts: dict[int, list] = {}  # mb id -> [buffer, bytes received, ready, shape]
        self.done: dict[int, tuple] = {}
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="link-recv", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import zmq

        out = self.zctx.socket(zmq.PAIR)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(self.notify_addr)
        try:
            hdr = torch.empty(HEADER, dtype=torch.long, device=self.device)
            while True:
                self.dist.recv(hdr, src=self.src)
                mb_id, off, n, total, has_meta, ready_ns = (int(v) for v in hdr.cpu().tolist())
                shape = None
                if has_meta:
                    size = torch.empty(1, dtype=torch.long, device=self.device)
                    self.dist.recv(size, src=self.src)
                    meta = torch.empty(int(size.cpu()), dtype=torch.uint8, device=self.device)
                    self.dist.recv(meta, src=self.src)
                    shape = self.read_meta(meta.cpu().numpy().tobytes())
                st = self.parts.get(mb_id)
                if st is None:
                    st = self.parts[mb_id] = [torch.empty(total, dtype=torch.uint8, device=self.device), 0, 0, None]
                if shape is not None:
                    st[3] = shape
                view = st[0][off:off + n]
                for a, b in byte_chunks(n, self.chunk):
                    self.dist.recv(view[a:b], src=self.src)
                st[1] += n
                st[2] = max(st[2], ready_ns)
                if st[1] == total:
                    del self.parts[mb_id]
                    with self.lock:
                        self.done[mb_id] = (st[0], st[2] / 1e9, st[3])
                    out.send(str(mb_id).encode())
        except BaseException as exc:
            self.error = exc
            try:
                out.send(b"error")
            except Exception:
                pass

    def take(self, mb_id: int):
        with self.lock:
            return self.done.pop(mb_id, None)

    def has(self, mb_id: int) -> bool:
        with self.lock:
            return mb_id in self.done


def link_policy(class_path: str, params: dict):
    """The run's policy for `schedule_transfer`, imported by its "module:qualname" (no import of
    `policies` here: the engine stays below the policies)."""
    import importlib

    from engine.core.policy import Policy

    if not class_path:
        return Policy()
    mod, _, qualname = class_path.partition(":")
    obj = importlib.import_module(mod)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not (isinstance(obj, type) and issubclass(obj, Policy)):
        raise RuntimeError(f"{class_path} is not an engine.core.policy.Policy")
    return obj.from_config(params)  # the link arrives with each LinkState
