"""A pipeline stage process: control messages from the driver, activations over torch.distributed.

Lifecycle (all waits bounded): connect a DEALER socket (identity `stage<s>`) to the driver's
ROUTER and say `Hello`; receive `StageInit` (checkpoint, layer range, KV pool size, rendezvous,
sampling); load this stage's tensors; join the process group (world = the P stages; the driver
is not a member; engine/torch_exec/stage/rendezvous.py); say `Ready`; from then on a spawned stage
talks to the driver over its own socketpair (wire/lane.py; external stages stay on ZeroMQ); answer
`Ping`s with this process's clock; then serve `Launch` messages in order until `Stop`. Every message is a typed,
HMAC-authenticated msgpack frame (engine/torch_exec/wire/messages.py); a frame that fails the check is
dropped and logged, never decoded.

Launches carry block tables as deltas; each is resolved into whole tables when it arrives
(wire/tables.py). Per micro-batch, stage s: wait for its metadata (span `wait`), build index tensors (`prepare`),
stage > 0 receives the previous stage's hidden states (`recv`), runs its layers (`forward:<kind>`),
then either posts an asynchronous send to stage s+1 (`send`; a send still pending from the
previous micro-batch is awaited first, `send_wait`) or, on the last stage, samples (`sample`)
and returns the token ids. Spans carry this process's `time.perf_counter()` (CLOCK_MONOTONIC on
Linux, shared by every process of one machine); the driver maps them onto the run's clock. On a
GPU, prepare/recv/forward/sample end at their CUDA events' elapsed time (shared/timing.py), and when
the next launch is already there its inputs are built while the forward runs (`prepare_ahead`,
before the forward's end event is waited on).
`wait`, `recv` and `send_wait` are idle time (the stage waits on someone else) and are not
counted as busy.

Paced links (the run names link.bandwidth / link.latency): the stage runs the micro-batches whose
activations arrived, in launch order among them (linked.py, transfer.py).

Any exception is reported to the driver as `StageError` with its traceback, then the process
exits. Spawned stages die with the driver (orphan.py: PR_SET_PDEATHSIG, a parent check while
idle), stages started by hand within seconds of losing it (driver_watch.py); both ignore SIGINT.

Run by hand for multi-machine pipelines (executor.launch=external; secret: wire/messages.py):
    python -m engine.torch_exec.stage.worker --driver tcp://<driver host>:<zmq_port> --stage <s>
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
import traceback
from collections import deque

import engine.torch_exec.wire.messages as wire
from engine.torch_exec.stage.linked import LinkedStage
from engine.torch_exec.stage.setup import StageSetup
from engine.torch_exec.wire.lane import ACTIVE_WINDOW_S, POLL_SLICE_S, Lane, LaneClosed, StageLine, Stopped
from engine.torch_exec.stage.driver_watch import WAIT_DRIVER_S, wait_for_driver, watch_driver
from engine.torch_exec.stage.orphan import IDLE_POLL_S, die_with_parent, parent_gone
from engine.torch_exec.wire.tables import StageLaunch, StageTables
from engine.torch_exec.shared.timing import timer_for
from engine.torch_exec.wire.messages import SpanRec

CONTROL = (wire.StageInit, wire.KvPool, wire.Launch, wire.Ping, wire.Stop)  # what the driver may send a stage
log = logging.getLogger(__name__)


def stage_main(driver_addr: str, stage: int, parent_pid: int | None = None, secret: bytes | None = None,
               run: str = "", lane=None, wait_driver_s: float = WAIT_DRIVER_S) -> None:
    """Entry point of a stage process (spawned by the driver, or run by hand: then `wait_driver_s`).
    `lane`: a spawned stage's end of its socketpair to the driver (wire/lane.py), used from `Ready` on."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    secret = secret or wire.secret_from_env()
    if secret is None:
        raise SystemExit(f"stage {stage}: no run secret; set {wire.SECRET_ENV} or {wire.SECRET_FILE_ENV} "
                         f"to the driver's")
    import zmq

    codec = wire.Codec(secret, me=f"stage{stage}", run=run)  # run "": external, learnt from the driver
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)  # no chosen identity: the driver binds "stage<i>" to this connection
    sock.setsockopt(zmq.LINGER, 2000)
    if parent_pid is None:  # started by hand: no parent to die with, so end when the driver goes
        connected = watch_driver(sock, stage, driver_addr)
    sock.connect(driver_addr)
    code, st = 0, None
    try:
        sock.send(codec.encode(wire.Hello(stage, socket.gethostname(), os.getpid())))
        if parent_pid is None:
            wait_for_driver(connected, stage, driver_addr, wait_driver_s)
        st = _Stage(sock, codec, stage, parent_pid, secret, Lane(lane) if lane is not None else None)
        st.run()
    except Stopped:
        pass
    except BaseException as exc:  # report, then exit non-zero
        code = wire.REPORTED_EXIT
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
        if parent_pid is None:  # started by hand: its own terminal is where it is read
            print(f"stage {stage}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        try:
            sock.send(codec.encode(wire.StageError(stage, text, time.perf_counter())), zmq.NOBLOCK)
        except Exception:
            pass
    finally:
        if st is not None and st.samplers is not None:
            st.samplers.close()
        sock.close(linger=2000 if code else 200)
        ctx.term()
    if code:
        os._exit(code)
    if st is not None and (st.link_in is not None or st.link_out is not None):
        # link threads sit in blocking gloo calls: a normal interpreter exit would abort in the
        # process group's teardown ("terminate called without an active exception")
        os._exit(0)


class _Stage(StageSetup, LinkedStage):
    def __init__(self, sock, codec: wire.Codec, stage: int, parent_pid: int | None, secret: bytes,
                 lane: Lane | None = None) -> None:
        self.sock = sock
        self.line = StageLine(sock, lane)  # ZeroMQ, then the lane from Ready on (spawned stages)
        self.last_step = 0.0  # when the last micro-batch ended (recv's short polls follow it)
        self.codec = codec
        self.secret = secret
        self.stage = stage
        self.parent_pid = parent_pid
        self.pending_sends: deque = deque()
        self.backlog: deque = deque()
        self.fault = None
        self.count = 0
        self.dropped = 0
        self.link_in = self.link_out = None
        self.samplers = None
        self._moved_reported = 0
        self.tables = StageTables()

    # --- control plane ----------------------------------------------------------------------------
    def send(self, msg) -> None:
        self.line.send(self.codec.encode(msg))

    def frame(self, timeout_s: float) -> bytes | None:
        try:
            return self.line.frame(timeout_s)
        except LaneClosed:
            raise Stopped() from None  # the driver is gone: nobody to report to

    def read(self, frame: bytes):
        """The driver's message in `frame`; None (dropped, logged) if it is not authentic."""
        try:
            msg = self.codec.decode(frame, expect=CONTROL)
        except wire.WireError as exc:
            self.dropped += 1
            log.warning("stage %d dropped a frame: %s", self.stage, exc)
            return None
        if isinstance(msg, wire.Stop):
            raise Stopped()
        if isinstance(msg, wire.Launch):  # whole tables from the deltas, in arrival (= launch) order
            return self.tables.resolve(msg)
        return msg

    def recv(self, timeout_s: float | None):
        """Next driver message; raises if the driver vanished or `timeout_s` passed. Right after a
        micro-batch it waits in `POLL_SLICE_S` slices (wire/lane.py: a long sleeper wakes late on a
        loaded machine), later in `IDLE_POLL_S` ones."""
        since = checked = time.perf_counter()
        while True:
            active = time.perf_counter() - self.last_step < ACTIVE_WINDOW_S
            frame = self.frame(POLL_SLICE_S if active else IDLE_POLL_S)
            if frame is not None:
                msg = self.read(frame)
                if msg is not None:
                    return msg
                continue
            now = time.perf_counter()
            if active and now - checked < IDLE_POLL_S:
                continue
            checked = now
            self.flush_link_events()
            if parent_gone(self.parent_pid):
                raise Stopped()  # the driver is gone: nobody to report to
            if timeout_s is not None and now - since > timeout_s:
                raise TimeoutError(f"no message from the driver for {timeout_s:.0f} s")

    def pong(self) -> None:
        self.send(wire.Pong(self.stage, time.perf_counter()))

    # --- main loops ----------------------------------------------------------------------------------
    def run(self) -> None:
        init = self.recv(300.0)
        if not isinstance(init, wire.StageInit):
            raise RuntimeError(f"expected init, got {init._wire_tag!r}")
        self.setup(init)
        if self.link_in is not None:
            self.run_linked()
        else:
            self.run_ordered()

    def run_ordered(self) -> None:
        while True:
            t_wait = time.perf_counter()
            msg = self.backlog.popleft() if self.backlog else self.recv(None)
            if isinstance(msg, wire.Ping):
                self.pong()
            elif isinstance(msg, StageLaunch):
                self.step(msg, t_wait, self.peek_ahead() if self.look_ahead else None)
            else:
                raise RuntimeError(f"unexpected message {msg._wire_tag!r}")

    def peek_ahead(self) -> StageLaunch | None:
        """Double buffer: micro-batch i+1's inputs are prepared by the prep thread while i runs
        (consecutive micro-batches hold disjoint sequences: token-safe)."""
        if not self.backlog and (frame := self.frame(0)) is not None:
            nxt = self.read(frame)
            if nxt is not None:
                self.backlog.append(nxt)
        if self.backlog and isinstance(self.backlog[0], StageLaunch):
            return self.backlog[0]
        return None

    # --- data-plane metadata (vLLM-style tensor-dict sends) ---------------------------------------------
    def meta_blob(self, payload) -> bytes:
        return self.codec.encode(wire.TensorMeta(list(payload.shape), str(payload.dtype)), to="stages")

    def read_meta(self, blob: bytes) -> tuple[int, ...]:
        try:
            return tuple(self.codec.decode(blob, expect=wire.TensorMeta).shape)
        except wire.WireError as exc:
            raise RuntimeError(f"stage {self.stage}: bad activation metadata from stage {self.stage - 1}: "
                               f"{exc}") from None

    # --- one micro-batch ----------------------------------------------------------------------------------
    def step(self, msg: StageLaunch, t_wait: float, ahead: StageLaunch | None = None) -> None:
        t = time.perf_counter()
        spans = [SpanRec("wait", t_wait, t, False)]
        self.count += 1
        if self.fault is not None and self.count == self.fault[1]:
            self.misbehave(self.fault[0])
        b, t1 = self.inputs(msg, spans, t)
        if ahead is not None and (ahead.mb_id in self.prepared or ahead.mb_id in self.ready):
            ahead = None
        if ahead is not None and self.overlap:  # SiPipe's prep thread
            self.prepared[ahead.mb_id] = self.prep_pool.submit(self.model.prepare, ahead.prefills, ahead.decodes)
            ahead = None
        hidden = None
        if not self.first:
            mark = timer_for(self.device).start()
            hidden = self.receive_hidden(msg.mb_id, b)
            t2 = timer_for(self.device).stop(mark)[1]
            spans.append(SpanRec("recv", t1, t2, False))
            t1 = t2
        out, t2 = self.forward(msg, b, hidden, t1, spans, ahead)
        if self.link_out is not None:
            self.send_paced(msg, out, spans)
        elif not self.last:
            self.send_next(msg, out, spans, t2)
        else:
            self.sample(msg, out, spans, t2)
        self.last_step = time.perf_counter()

    def inputs(self, msg: StageLaunch, spans: list, t: float):
        """This micro-batch's index tensors: prepared ahead (the prep thread, or while the previous
        forward ran on the GPU), or now."""
        b = self.ready.pop(msg.mb_id, None)  # prepared while the previous forward ran on the GPU
        if b is not None:
            return b, t
        fut = self.prepared.pop(msg.mb_id, None) if self.overlap else None
        if fut is not None:
            b = fut.result()
            t1 = time.perf_counter()
            if t1 - t > 20e-6:
                spans.append(SpanRec("prepare_wait", t, t1, False))
            return b, t1
        mark = timer_for(self.device).start()
        b = self.model.prepare(msg.prefills, msg.decodes)
        t1 = timer_for(self.device).stop(mark)[1]
        spans.append(SpanRec("prepare", t, t1, True))
        return b, t1

    def receive_hidden(self, mb_id: int, b):
        torch = self.torch
        buf = torch.empty((b.num_tokens, self.hidden), dtype=self.model.dtype,
                          device="cpu" if self.transfer_via_cpu else self.device)
        if self.link_in is not None:
            buf = self.take_linked(mb_id, buf)
        else:
            if not self.aware:
                # vLLM-style tensor-dict send: first the metadata (its size, then the blob), then
                # the tensor; structure-aware receivers infer the shape from the schedule instead
                size = torch.empty(1, dtype=torch.long)
                self.dist.recv(size, src=self.stage - 1)
                meta = torch.empty(int(size), dtype=torch.uint8)
                self.dist.recv(meta, src=self.stage - 1)
                shape = self.read_meta(meta.numpy().tobytes())
                if shape != tuple(buf.shape):
                    raise RuntimeError(f"metadata says {shape}, schedule says {tuple(buf.shape)}")
            self.dist.recv(buf, src=self.stage - 1)
        return buf.to(self.device) if self.transfer_via_cpu else buf

    def forward(self, msg: StageLaunch, b, hidden, t1: float, spans: list, ahead: StageLaunch | None = None):
        """The forward; on a GPU, `ahead`'s inputs are prepared while its kernels run (the host
        launches them and returns: the next micro-batch's index arrays, pinned copy included, are
        built before this span's end event is waited on)."""
        kind = msg.kind
        self.fwd_kind = kind
        self.fwd_start = t1
        if not msg.prefills:
            self.decode_starts.append(t1)
        timer = timer_for(self.device)
        mark = timer.start()
        out = self.model.forward(b, hidden)
        pending = timer.record(mark)  # CUDA events on a GPU (shared/timing.py)
        if ahead is not None:
            a = time.perf_counter()
            self.ready[ahead.mb_id] = self.model.prepare(ahead.prefills, ahead.decodes)
            # host work inside the forward's span: not counted busy twice (the bubble ratio)
            spans.append(SpanRec("prepare_ahead", a, time.perf_counter(), False))
        t2 = timer.wait(pending)[1]
        self.fwd_start = None
        prev = self.fwd_ema.get(kind)
        self.fwd_ema[kind] = (t2 - t1) if prev is None else 0.7 * prev + 0.3 * (t2 - t1)
        spans.append(SpanRec(f"forward:{kind}", t1, t2, True))
        return out, t2

    def send_next(self, msg: StageLaunch, out, spans: list, t2: float) -> None:
        torch = self.torch
        while self.pending_sends:
            work, _tensor = self.pending_sends.popleft()
            work.wait()
        t3 = time.perf_counter()
        if t3 - t2 > 20e-6:
            spans.append(SpanRec("send_wait", t2, t3, False))
        payload = (out.cpu() if self.transfer_via_cpu else out).contiguous()
        if not self.aware:
            # the metadata sends block until stage s+1 posts its receives: tell the driver first
            # that this micro-batch is computed, so a hang there is blamed on stage s+1, not here
            self.send(wire.Spans(self.stage, msg.mb_id, spans))
            spans = []
            blob = self.meta_blob(payload)
            self.dist.send(torch.tensor([len(blob)], dtype=torch.long), dst=self.stage + 1)
            self.dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=self.stage + 1)
        work = self.dist.isend(payload, dst=self.stage + 1)
        self.pending_sends.append((work, payload))
        spans.append(SpanRec("send", t3, time.perf_counter(), True))
        self.send(wire.Spans(self.stage, msg.mb_id, spans))

    def sample(self, msg: StageLaunch, out, spans: list, t2: float) -> None:
        prefills, decodes = msg.prefills, msg.decodes
        keys = [(p.seq_id, p.start + p.num_tokens) for p in prefills if p.samples] + \
               [(d.seq_id, d.position + 1) for d in decodes]
        if self.samplers is not None:
            logits = out.detach().float().cpu()
            self.samplers.submit(msg.mb_id, logits, keys, [(p.seq_id, p.start, p.token_ids) for p in prefills],
                                 msg.sampling)
            spans.append(SpanRec("to_samplers", t2, time.perf_counter(), True))
            self.send(wire.Spans(self.stage, msg.mb_id, spans))
            return
        if msg.sampling:
            self.sampler.set_params(wire.sampling_params(msg.sampling))
        for p in prefills:
            self.sampler.observe_prefill(p.seq_id, p.start, p.token_ids)
        mark = timer_for(self.device).start()
        tokens = self.sampler.sample(out, keys)
        spans.append(SpanRec("sample", t2, timer_for(self.device).stop(mark)[1], True))
        self.send(wire.Done(self.stage, msg.mb_id, [int(t) for t in tokens], spans))

    def misbehave(self, kind: str) -> None:
        if kind == "raise":
            raise RuntimeError(f"injected fault on stage {self.stage} at micro-batch #{self.count}")
        if kind == "exit":
            os._exit(3)
        while True:  # hang
            time.sleep(3600)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=f"Run one pipeline stage for an executor.launch=external driver "
                                             f"(the run's secret in {wire.SECRET_ENV} or {wire.SECRET_FILE_ENV}).")
    ap.add_argument("--driver", required=True, help="the driver's control address, tcp://HOST:PORT")
    ap.add_argument("--stage", type=int, required=True, help="this stage's index, 0..P-1")
    ap.add_argument("--wait-driver-s", type=float, default=WAIT_DRIVER_S, help="seconds to wait for the driver")
    args = ap.parse_args(argv)
    stage_main(args.driver, args.stage, None, wait_driver_s=args.wait_driver_s)


if __name__ == "__main__":
    main()
