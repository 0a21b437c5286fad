"""The paced-link half of a stage process (worker.py `_Stage` mixes it in): what runs when the run
names link.bandwidth / link.latency and P > 1.

A stage's activations are queued at its outgoing link and a sender thread sends what the run's
policy picks with `schedule_transfer` (the policy is rebuilt from the "module:qualname" and params
in `StageInit`, imported by name and checked to be an `engine.core.policy.Policy`:
`transfer.link_policy`; the link arrives with each `LinkState`), chunk by chunk; a receiver thread
reassembles each micro-batch's chunks (interleaved: a decode may overtake a prefill's remaining
chunks), see transfer.py. A stage behind such a link runs the micro-batches whose activations are
complete (`run_linked`), in launch order among them, so micro-batches may finish out of launch
order (the driver accepts that then). This is token-safe: the micro-batches in flight hold
disjoint sequences. Link spans (`queue:<kind>`, `xfer:<kind>`) and the bytes moved so far go to
the driver as `LinkEvents`, traced on track `link<s>`.
"""
from __future__ import annotations

import time

import engine.torch_exec.wire.messages as wire
from engine.torch_exec.wire.lane import Stopped
from engine.torch_exec.wire.tables import StageLaunch
from engine.torch_exec.stage.orphan import IDLE_POLL_S, parent_gone
from engine.torch_exec.wire.messages import SpanRec


class LinkedStage:
    """Methods of `_Stage` (worker.py) for policy-scheduled links; they read its state."""

    def run_linked(self) -> None:
        """Main loop of a stage > 0 behind a policy-scheduled link: micro-batches run in the order
        their activations complete (a decode may overtake a prefill still on the link), launch
        order among those complete. Token-safe: micro-batches in flight hold disjoint sequences,
        and each one's KV writes and reads touch only its own sequences' blocks."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.line.pollable, zmq.POLLIN)
        poller.register(self.notify, zmq.POLLIN)
        known: dict[int, StageLaunch] = {}  # mb id -> its message, launch order (dicts keep insertion order)
        t_wait = time.perf_counter()
        while True:
            ready = next((m for i, m in known.items() if self.link_in.has(i)), None)
            if ready is not None:
                del known[ready.mb_id]
                ahead = next(iter(known.values()), None) if self.look_ahead else None
                self.step(ready, t_wait, ahead)
                t_wait = time.perf_counter()
                continue
            self.flush_link_events()
            events = dict(poller.poll(int(IDLE_POLL_S * 1000)))
            if self.notify in events:
                self.check_receiver()
            self.take_control(known)  # also frames an earlier read left in the inbox
            if not events and parent_gone(self.parent_pid):
                raise Stopped()

    def check_receiver(self) -> None:
        import zmq

        while self.notify.poll(0, zmq.POLLIN):
            if self.notify.recv() == b"error":
                raise RuntimeError(f"link {self.stage - 1}->{self.stage} receiver failed: "
                                   f"{self.link_in.error!r}") from self.link_in.error

    def take_control(self, known: dict) -> None:
        while (frame := self.frame(0)) is not None:
            msg = self.read(frame)
            if isinstance(msg, wire.Ping):
                self.pong()
            elif isinstance(msg, StageLaunch):
                known[msg.mb_id] = msg
            elif msg is not None:
                raise RuntimeError(f"unexpected message {msg._wire_tag!r}")

    def flush_link_events(self) -> None:
        if self.link_out is None:
            return
        if self.link_out.error is not None:
            raise RuntimeError(f"link {self.stage}->{self.stage + 1} sender failed: "
                               f"{self.link_out.error!r}") from self.link_out.error
        ev = self.link_out.drain_events()
        moved = int(self.link_out.moved_bytes)
        if ev or moved > self._moved_reported:
            self._moved_reported = moved
            self.send(wire.LinkEvents(self.stage, [wire.LinkSpan(*e) for e in ev], moved))

    def setup_links(self, init: wire.StageInit) -> None:
        """Paced links: activations go through a policy-scheduled sender thread (transfer.py)."""
        import engine.torch_exec.stage.transfer as transfer

        comm_dev = "cpu" if (self.transfer_via_cpu or self.device == "cpu") else self.device
        if not self.last:
            policy = transfer.link_policy(init.policy_class, init.policy_params)
            self.link_out = transfer.LinkSender(self.dist, self.stage, self.stage + 1, policy, self.bw,
                                                self.lat, self.chunk, comm_dev, self.link_info)
        if not self.first:
            import zmq

            self.izctx = zmq.Context()  # never terminated: the receiver thread may sit in recv
            addr = f"inproc://link-recv-{self.stage}"
            self.notify = self.izctx.socket(zmq.PAIR)
            self.notify.setsockopt(zmq.LINGER, 0)
            self.notify.bind(addr)
            self.link_in = transfer.LinkReceiver(self.dist, self.stage - 1, comm_dev, self.chunk, addr,
                                                 self.izctx, self.read_meta)

    def link_info(self, now: float) -> dict:
        """What the sending stage knows for the policy's idle-time prediction (LinkState.info)."""
        info: dict = {"upstream_busy": False}
        start, kind = self.fwd_start, self.fwd_kind
        if start is not None:
            info["upstream_busy"] = True
            info["upstream_end_s"] = start + self.fwd_ema.get(kind, 0.0)
        elif len(self.decode_starts) >= 2:
            ds = self.decode_starts
            period = (ds[-1] - ds[0]) / (len(ds) - 1)
            if ds[-1] + period > now:
                info["next_decode_s"] = ds[-1] + period
        return info

    def take_linked(self, mb_id: int, buf):
        flat, ready_s, shape = self.link_in.take(mb_id)
        if shape is not None and tuple(shape) != tuple(buf.shape):
            raise RuntimeError(f"metadata says {shape}, schedule says {tuple(buf.shape)}")
        if flat.numel() != buf.numel() * buf.element_size():
            raise RuntimeError(f"micro-batch {mb_id}: {flat.numel()} bytes arrived, the schedule "
                               f"needs {buf.numel() * buf.element_size()}")
        buf = flat.view(buf.dtype).view(buf.shape)
        late = ready_s - time.perf_counter()
        if late > 0:
            time.sleep(min(late, self.lat))  # the link's latency: delivered L after sending
        return buf

    def send_paced(self, msg: StageLaunch, out, spans: list) -> None:
        from engine.torch_exec.stage.transfer import _MbRef

        t3 = time.perf_counter()
        payload = (out.cpu() if self.transfer_via_cpu else out).contiguous()
        meta = None if self.aware else self.meta_blob(payload)
        self.link_out.put(_MbRef(msg.mb_id, msg.kind, msg.prefills, msg.decodes), payload, meta)
        spans.append(SpanRec("send", t3, time.perf_counter(), True))
        self.flush_link_events()
        self.send(wire.Spans(self.stage, msg.mb_id, spans))
