"""SiPipe's CPU sampler pool (runtime.cpu_sampling): processes beside the last stage.

Sampler k owns the rows of sequences with seq_id % n == k, so each sequence's penalty state lives
in exactly one process and is updated in place there (engine/torch_exec/stage/sampling.py `Sampler`).
The last stage (`SamplerPool`, below) sends each sampler only its rows of a micro-batch's logits:
an authenticated `SampleJob` (row indices, keys, the prefill tokens the penalty state needs,
dtype and shape; engine/torch_exec/wire/messages.py) followed by the rows' raw bytes in a second frame of
the same ZeroMQ message, over a ROUTER the stage binds on 127.0.0.1 (the samplers always run on
the stage's machine). Only samplers that said an authentic `SamplerHello` get jobs. Each sampler
returns its token ids straight to the driver over its own DEALER (`Sampled`); the driver merges
the n parts. A sampler exits on `Stop`, when the stage is gone (engine/torch_exec/stage/orphan.py), or
when its channel fails.
"""
from __future__ import annotations

import logging
import os
import signal
import time

import engine.torch_exec.wire.messages as wire
from engine.torch_exec.stage.orphan import IDLE_POLL_S, die_with_parent, parent_gone

DTYPES = ("float32",)  # what the stage sends (logits upcast once)
log = logging.getLogger(__name__)


class SamplerPool:
    """The stage side: n sampler processes and the channel that feeds them."""

    def __init__(self, n: int, driver_addr: str, secret: bytes, vocab: int, sampling: wire.SamplerConfig,
                 timeout_s: float, me: str = "stage0", run: str = "") -> None:
        import zmq

        self.n = n
        self.run = run
        self.codec = wire.Codec(secret, me=me, run=run)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.procs = [self._spawn(k, driver_addr, f"tcp://127.0.0.1:{port}", secret, vocab, sampling)
                      for k in range(n)]
        self.idents = self._gather_hellos(timeout_s)

    def _spawn(self, k: int, driver_addr: str, channel: str, secret: bytes, vocab: int, sampling):
        import multiprocessing as _mp

        import torch.multiprocessing as tmp

        mp = tmp.get_context("spawn")
        pr = mp.Process(target=sampler_main, args=(driver_addr, channel, k, self.n, secret, vocab, sampling,
                                                   os.getpid(), self.run), daemon=True, name=f"pp-sampler{k}")
        cur = _mp.current_process()._config  # stage processes are daemons; samplers die with them
        was = cur.get("daemon")
        cur["daemon"] = False
        try:
            pr.start()
        finally:
            cur["daemon"] = was
        return pr

    def _gather_hellos(self, timeout_s: float) -> list[bytes]:
        idents: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while len(idents) < self.n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"CPU samplers {sorted(set(range(self.n)) - set(idents))} did not start "
                                   f"within {timeout_s:g} s")
            if not self.sock.poll(int(1000 * min(left, IDLE_POLL_S))):
                dead = [k for k, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"CPU sampler {dead[0]} exited with code {self.procs[dead[0]].exitcode}")
                continue
            frames = self.sock.recv_multipart()
            try:
                hello = self.codec.decode(frames[-1], expect=wire.SamplerHello)
            except wire.WireError as exc:
                log.warning("dropped a frame on the sampler channel: %s", exc)
                continue
            if len(frames) == 2 and 0 <= hello.sampler < self.n:
                idents[hello.sampler] = frames[0]
        return [idents[k] for k in range(self.n)]

    def submit(self, mb_id: int, logits, keys: list, prefills: list,
               sampling: list | None = None) -> None:
        """Send each sampler its rows of `logits` [rows, vocab] (float32 on the CPU); `sampling`:
        served requests' own settings (`wire.RequestSampling`), to the sampler of their rows."""
        n = self.n
        for k in range(n):
            rows = [i for i, (sid, _) in enumerate(keys) if sid % n == k]
            part = logits[rows].contiguous().numpy()
            job = wire.SampleJob(mb_id, n, rows, [wire.SampleKey(*keys[i]) for i in rows],
                                 [wire.PrefillTokens(*p) for p in prefills if p[0] % n == k], "float32",
                                 list(part.shape), [r for r in sampling or () if r.seq_id % n == k])
            self.sock.send_multipart([self.idents[k], self.codec.encode(job, to=f"sampler{k}"), part], copy=False)

    def close(self) -> None:
        for k, ident in enumerate(getattr(self, "idents", [])):
            try:
                self.sock.send_multipart([ident, self.codec.encode(wire.Stop(), to=f"sampler{k}"), b""])
            except Exception:
                pass
        for pr in self.procs:
            pr.join(1.0)
            if pr.is_alive():
                pr.terminate()
        self.sock.close(linger=0)
        self.ctx.term()


def _job_logits(job: wire.SampleJob, data: bytes):
    import numpy as np
    import torch

    if job.dtype not in DTYPES or len(job.shape) != 2 or job.shape[0] != len(job.rows):
        raise wire.WireError(f"sample job for micro-batch {job.mb_id}: bad dtype/shape {job.dtype} {job.shape}")
    if len(data) != job.shape[0] * job.shape[1] * 4:
        raise wire.WireError(f"sample job for micro-batch {job.mb_id}: {len(data)} bytes for shape {job.shape}")
    return torch.from_numpy(np.frombuffer(bytearray(data), dtype=np.float32).reshape(job.shape))


def sampler_main(driver_addr: str, channel: str, k: int, n: int, secret: bytes, vocab: int,
                 sampling: wire.SamplerConfig, parent_pid: int | None = None, run: str = "") -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    import torch
    import zmq

    from engine.torch_exec.stage.sampling import Sampler

    torch.set_num_threads(1)
    codec = wire.Codec(secret, me=f"sampler{k}", run=run)
    ctx = zmq.Context()
    jobs = ctx.socket(zmq.DEALER)
    jobs.setsockopt(zmq.LINGER, 0)
    jobs.connect(channel)
    out = ctx.socket(zmq.DEALER)  # no chosen identity (see engine/torch_exec/driver/control.py)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(driver_addr)
    s = Sampler(vocab, **sampling.kwargs())
    try:
        jobs.send(codec.encode(wire.SamplerHello(k, os.getpid()), to="stages"))
        while True:
            if not jobs.poll(int(IDLE_POLL_S * 1000)):
                if parent_gone(parent_pid):
                    break
                continue
            frames = jobs.recv_multipart()
            try:
                job = codec.decode(frames[0], expect=(wire.SampleJob, wire.Stop))
                if isinstance(job, wire.Stop):
                    break
                logits = _job_logits(job, frames[1] if len(frames) == 2 else b"")
            except wire.WireError as exc:
                log.warning("sampler %d dropped a frame: %s", k, exc)
                continue
            out.send(codec.encode(_sample(s, job, logits, k)))
    finally:
        jobs.close()
        out.close()
        ctx.term()


def _sample(s, job: wire.SampleJob, logits, k: int) -> wire.Sampled:
    t0 = time.perf_counter()
    if job.sampling:
        s.set_params(wire.sampling_params(job.sampling))
    for sid, start, toks in job.prefills:
        s.observe_prefill(sid, start, toks)
    keys = [tuple(key) for key in job.keys]
    mine = s.sample(logits, keys) if keys else []
    return wire.Sampled(k, job.mb_id, job.num_parts, job.rows, [int(t) for t in mine], t0, time.perf_counter())
