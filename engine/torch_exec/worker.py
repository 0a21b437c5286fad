"""A pipeline stage process: control messages over ZeroMQ, activations over torch.distributed.

Lifecycle (all waits bounded): connect a DEALER socket (identity `stage<s>`) to the driver's
ROUTER and say `hello`; receive `init` (checkpoint, layer range, KV pool size, rendezvous,
sampling); load this stage's tensors; join the process group (world = the P stages; the driver
is not a member); say `ready`; answer `ping`s with this process's clock; then serve `mb`
messages in order until `stop`.

Per micro-batch, stage s: wait for its metadata (span `wait`), build index tensors (`prepare`),
stage > 0 receives the previous stage's hidden states (`recv`), runs its layers (`forward:<kind>`),
then either posts an asynchronous send to stage s+1 (`send`; a send still pending from the
previous micro-batch is awaited first, `send_wait`) or, on the last stage, samples (`sample`)
and returns the token ids. Spans carry this process's `time.perf_counter()` (CLOCK_MONOTONIC on
Linux, shared by every process of one machine); the driver maps them onto the run's clock.
`wait`, `recv` and `send_wait` are idle time (the stage waits on someone else) and are not
counted as busy.

Paced links (the run names link.bandwidth / link.latency): a stage's activations are queued at
its outgoing link and a sender thread sends what the run's policy picks with
`schedule_transfer` (the policy is rebuilt here from the class and params in `init`; the link
arrives with each `LinkState`), chunk by chunk; a receiver thread reassembles each micro-batch's
chunks (interleaved: a decode may overtake a prefill's remaining chunks), see transfer.py. A
stage behind such a link runs the micro-batches whose activations are complete, in launch order
among them, so micro-batches may finish out of launch order (the driver accepts that then).
This is token-safe: the micro-batches in flight hold disjoint sequences. Link spans
(`queue:<kind>`, `xfer:<kind>`) go to the driver as `link` messages, traced on track `link<s>`.

Any exception is reported to the driver as `error` with its traceback, then the process exits.
Spawned stages die with the driver (PR_SET_PDEATHSIG on Linux, and a parent check while idle)
and ignore SIGINT: Ctrl-C reaches the driver, which ends every stage itself.

Run by hand for multi-machine pipelines (executor.launch=external):
    python -m engine.torch_exec.worker --driver tcp://<driver host>:<zmq_port> --stage <s>
"""
from __future__ import annotations

import argparse
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections import deque

IDLE_POLL_MS = 500


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def stage_main(driver_addr: str, stage: int, parent_pid: int | None = None) -> None:
    """Entry point of a stage process (spawned by the driver, or run by hand)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent_pid is not None:
        _die_with_parent()
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"stage{stage}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(driver_addr)
    code = 0
    st = None
    try:
        sock.send(pickle.dumps(("hello", stage, socket.gethostname(), os.getpid())))
        st = _Stage(sock, stage, parent_pid)
        st.run()
    except _Stopped:
        pass
    except BaseException as exc:  # report, then exit non-zero
        code = 1
        text = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"
        try:
            sock.send(pickle.dumps(("error", stage, text)), zmq.NOBLOCK)
        except Exception:
            pass
    finally:
        sock.close(linger=2000 if code else 200)
        ctx.term()
    if code:
        os._exit(code)
    if st is not None and (getattr(st, "link_in", None) is not None or getattr(st, "link_out", None) is not None):
        # link threads sit in blocking gloo calls: a normal interpreter exit would abort in the
        # process group's teardown ("terminate called without an active exception")
        for pr in getattr(st, "sampler_procs", []):
            pr.terminate()
        os._exit(0)


class _Stopped(Exception):
    pass


class _Stage:
    def __init__(self, sock, stage: int, parent_pid: int | None) -> None:
        self.sock = sock
        self.stage = stage
        self.parent_pid = parent_pid
        self.pending_sends: deque = deque()
        self.fault = None
        self.count = 0

    # --- control plane ----------------------------------------------------------------------------
    def send(self, *msg) -> None:
        self.sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self, timeout_s: float | None):
        """Next driver message; raises if the driver vanished or `timeout_s` passed."""
        import zmq

        waited = 0.0
        while True:
            if self.sock.poll(IDLE_POLL_MS, zmq.POLLIN):
                msg = pickle.loads(self.sock.recv())
                if msg[0] == "stop":
                    raise _Stopped()
                return msg
            waited += IDLE_POLL_MS / 1000
            if getattr(self, "link_out", None) is not None:
                self.flush_link_events()
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                raise _Stopped()  # the driver is gone: nobody to report to
            if timeout_s is not None and waited > timeout_s:
                raise TimeoutError(f"no message from the driver for {timeout_s:.0f} s")

    # --- main loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        msg = self.recv(300.0)
        if msg[0] != "init":
            raise RuntimeError(f"expected init, got {msg[0]!r}")
        cfg = msg[1]
        self.setup(cfg)
        if self.link_in is not None:
            return self.run_linked()
        import zmq

        while True:
            t_wait = time.perf_counter()
            msg = self.backlog.popleft() if self.backlog else self.recv(None)
            kind = msg[0]
            if kind == "ping":
                self.send("pong", self.stage, time.perf_counter())
            elif kind == "mb":
                if self.overlap:
                    # double buffer: micro-batch i+1's inputs are prepared by the prep thread while
                    # i runs (consecutive micro-batches hold disjoint sequences: token-safe)
                    if not self.backlog and self.sock.poll(0, zmq.POLLIN):
                        nxt = pickle.loads(self.sock.recv())
                        if nxt[0] == "stop":
                            raise _Stopped()
                        self.backlog.append(nxt)
                    ahead = None
                    if self.backlog and self.backlog[0][0] == "mb":
                        ahead = self.backlog[0]
                    self.step(msg, t_wait, ahead)
                else:
                    self.step(msg, t_wait)
            else:
                raise RuntimeError(f"unknown message {kind!r}")

    def run_linked(self) -> None:
        """Main loop of a stage > 0 behind a policy-scheduled link: micro-batches run in the order
        their activations complete (a decode may overtake a prefill still on the link), launch
        order among those complete. Token-safe: micro-batches in flight hold disjoint sequences,
        and each one's KV writes and reads touch only its own sequences' blocks."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.notify, zmq.POLLIN)
        known: dict[int, tuple] = {}  # mb id -> its message, launch order (dicts keep insertion order)
        t_wait = time.perf_counter()
        while True:
            ready = next((m for i, m in known.items() if self.link_in.has(i)), None)
            if ready is not None:
                del known[ready[1]]
                ahead = next(iter(known.values()), None) if self.overlap else None
                self.step(ready, t_wait, ahead)
                t_wait = time.perf_counter()
                continue
            self.flush_link_events()
            events = dict(poller.poll(IDLE_POLL_MS))
            if self.notify in events:
                while self.notify.poll(0, zmq.POLLIN):
                    if self.notify.recv() == b"error":
                        raise RuntimeError(f"link {self.stage - 1}->{self.stage} receiver failed: "
                                           f"{self.link_in.error!r}") from self.link_in.error
            if self.sock in events:
                while self.sock.poll(0, zmq.POLLIN):
                    msg = pickle.loads(self.sock.recv())
                    if msg[0] == "stop":
                        raise _Stopped()
                    if msg[0] == "ping":
                        self.send("pong", self.stage, time.perf_counter())
                    elif msg[0] == "mb":
                        known[msg[1]] = msg
                    else:
                        raise RuntimeError(f"unknown message {msg[0]!r}")
            elif not events and self.parent_pid is not None and os.getppid() != self.parent_pid:
                raise _Stopped()

    def flush_link_events(self) -> None:
        if self.link_out is not None:
            if self.link_out.error is not None:
                raise RuntimeError(f"link {self.stage}->{self.stage + 1} sender failed: "
                                   f"{self.link_out.error!r}") from self.link_out.error
            ev = self.link_out.drain_events()
            if ev:
                self.send("link", self.stage, ev)

    def setup(self, cfg: dict) -> None:
        t0 = time.perf_counter()
        import torch

        from engine.torch_exec.checkpoint import ArchConfig
        from engine.torch_exec.model import StageModel

        self.cfg = cfg
        self.P = cfg["pp"]
        self.first = self.stage == 0
        self.last = self.stage == self.P - 1
        if cfg["device"] == "cpu":
            torch.set_num_threads(cfg["threads"])
        device = cfg["device"]
        if device == "cuda":
            device = f"cuda:{self.stage % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        self.device = device
        self.transfer_via_cpu = cfg["backend"] == "gloo" and device != "cpu"
        if cfg.get("fault"):
            from engine.torch_exec.settings import parse_fault

            kind, st, n = parse_fault(cfg["fault"])
            if st == self.stage:
                self.fault = (kind, n)
        arch = ArchConfig(**cfg["arch"])
        first_layer, n_layers = cfg["layers"][self.stage]
        self.model = StageModel(arch, first_layer, n_layers, self.first, self.last, cfg["num_blocks"],
                                cfg["block_size"], cfg["dtype"], device)
        self.model.load(cfg["path"])
        self.hidden = arch.hidden_size
        t_load = time.perf_counter() - t0
        if self.P > 1:
            import datetime

            import torch.distributed as dist

            dist.init_process_group(cfg["backend"], init_method=f"tcp://{cfg['master_addr']}:{cfg['master_port']}",
                                    rank=self.stage, world_size=self.P,
                                    timeout=datetime.timedelta(seconds=cfg["stage_timeout_s"]))
            self.dist = dist
        self.torch = torch
        self.backlog: deque = deque()
        self.overlap = bool(cfg.get("overlap_input_prep"))
        self.prepared: dict[int, object] = {}  # mb id -> future of its prepared inputs (<= 2 buffers)
        self.aware = bool(cfg.get("structure_aware_transfer"))
        self.bw = cfg.get("link_bandwidth_Bps")
        self.lat = float(cfg.get("link_latency_s") or 0.0)
        self.chunk = int(cfg.get("link_chunk_bytes") or (1 << 20))
        if self.overlap:
            from concurrent.futures import ThreadPoolExecutor

            self.prep_pool = ThreadPoolExecutor(1, thread_name_prefix="prep")
        # paced links: activations go through a policy-scheduled sender thread (transfer.py)
        self.link_out = self.link_in = None
        self.fwd_start: float | None = None  # the forward running now (for the policy's T_a)
        self.fwd_kind = ""
        self.fwd_ema: dict[str, float] = {}  # kind -> mean forward time
        self.decode_starts: deque = deque(maxlen=8)  # recent decode forward starts (next decode's ETA)
        if self.P > 1 and (self.bw or self.lat):
            from engine.torch_exec import transfer

            comm_dev = "cpu" if (self.transfer_via_cpu or device == "cpu") else device
            if not self.last:
                policy = self.build_policy(cfg.get("policy"))
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
                                                     self.izctx)
        if self.last:
            from engine.torch_exec.sampling import Sampler

            skw = dict(method=cfg["sampling"], temperature=cfg["temperature"], top_k=cfg["top_k"],
                       top_p=cfg["top_p"], seed=cfg["sample_seed"],
                       repetition_penalty=cfg.get("repetition_penalty", 1.0),
                       presence_penalty=cfg.get("presence_penalty", 0.0),
                       frequency_penalty=cfg.get("frequency_penalty", 0.0))
            self.sampler = Sampler(arch.vocab_size, **skw)
            self.cpu_queues = []
            if cfg.get("cpu_sampling"):
                import torch.multiprocessing as tmp

                from engine.torch_exec.cpu_sampler import sampler_main

                mp = tmp.get_context("spawn")
                n = cfg["num_cpu_samplers"]
                self.sampler_procs = []
                for k in range(n):
                    q = mp.Queue()
                    pr = mp.Process(target=sampler_main, args=(cfg["driver_addr"], k, n,
                                                              {"vocab": arch.vocab_size, "sampler": skw}, q),
                                    daemon=True, name=f"pp-sampler{k}")
                    import multiprocessing as _mp

                    cur = _mp.current_process()._config  # stage processes are daemons; samplers die with them
                    was = cur.get("daemon")
                    cur["daemon"] = False
                    try:
                        pr.start()
                    finally:
                        cur["daemon"] = was
                    self.cpu_queues.append(q)
                    self.sampler_procs.append(pr)
        self.send("ready", self.stage, {"load_s": t_load, "init_s": time.perf_counter() - t0,
                                        "pid": os.getpid(), "device": str(device)})

    def build_policy(self, spec):
        """The run's policy, rebuilt here from (module, class name, params) for `schedule_transfer`."""
        from engine.policy import Policy

        if spec is None:
            return Policy()
        import importlib

        mod, name, params = spec
        if mod.startswith("policies"):
            import policies  # noqa: F401  (registers every policy)
        return getattr(importlib.import_module(mod), name)(params)  # the link arrives with each LinkState

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

    def step(self, msg, t_wait: float, ahead=None) -> None:
        _, mb_id, kind, prefills, decodes = msg[:5]
        sampling = msg[5] if len(msg) > 5 else None  # served requests' own sampling (driver._metadata)
        torch = self.torch
        spans = []
        t = time.perf_counter()
        spans.append(("wait", t_wait, t, False))
        self.count += 1
        if self.fault is not None and self.count == self.fault[1]:
            self.misbehave(self.fault[0])
        fut = self.prepared.pop(mb_id, None) if self.overlap else None
        if fut is not None:
            b = fut.result()
            t1 = time.perf_counter()
            if t1 - t > 20e-6:
                spans.append(("prepare_wait", t, t1, False))
        else:
            b = self.model.prepare(prefills, decodes)
            t1 = time.perf_counter()
            spans.append(("prepare", t, t1, True))
        if ahead is not None and ahead[1] not in self.prepared:
            self.prepared[ahead[1]] = self.prep_pool.submit(self.model.prepare, ahead[3], ahead[4])
        hidden = None
        if not self.first:
            buf = torch.empty((b.num_tokens, self.hidden), dtype=self.model.dtype,
                              device="cpu" if self.transfer_via_cpu else self.device)
            if not self.aware and self.link_in is None:
                # vLLM-style tensor-dict send: first the metadata (its size, then the blob), then
                # the tensor; structure-aware receivers infer the shape from the schedule instead
                size = torch.empty(1, dtype=torch.long)
                self.dist.recv(size, src=self.stage - 1)
                meta = torch.empty(int(size), dtype=torch.uint8)
                self.dist.recv(meta, src=self.stage - 1)
                shape = pickle.loads(meta.numpy().tobytes())["hidden"][0]
                if tuple(shape) != tuple(buf.shape):
                    raise RuntimeError(f"metadata says {shape}, schedule says {tuple(buf.shape)}")
            if self.link_in is not None:
                got = self.link_in.take(mb_id)
                flat, ready_s, shape = got
                if shape is not None and tuple(shape) != tuple(buf.shape):
                    raise RuntimeError(f"metadata says {shape}, schedule says {tuple(buf.shape)}")
                if flat.numel() != buf.numel() * buf.element_size():
                    raise RuntimeError(f"micro-batch {mb_id}: {flat.numel()} bytes arrived, the schedule "
                                       f"needs {buf.numel() * buf.element_size()}")
                buf = flat.view(buf.dtype).view(buf.shape)
                late = ready_s - time.perf_counter()
                if late > 0:
                    time.sleep(min(late, self.lat))  # the link's latency: delivered L after sending
            else:
                self.dist.recv(buf, src=self.stage - 1)
            hidden = buf.to(self.device) if self.transfer_via_cpu else buf
            t2 = time.perf_counter()
            spans.append(("recv", t1, t2, False))
            t1 = t2
        self.fwd_kind = kind
        self.fwd_start = t1
        if not prefills:
            self.decode_starts.append(t1)
        out = self.model.forward(b, hidden)
        if self.device != "cpu":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        self.fwd_start = None
        prev = self.fwd_ema.get(kind)
        self.fwd_ema[kind] = (t2 - t1) if prev is None else 0.7 * prev + 0.3 * (t2 - t1)
        spans.append((f"forward:{kind}", t1, t2, True))
        if self.link_out is not None:
            from engine.torch_exec.transfer import _MbRef

            t3 = time.perf_counter()
            payload = (out.cpu() if self.transfer_via_cpu else out).contiguous()
            meta = None
            if not self.aware:
                meta = pickle.dumps({"hidden": (tuple(payload.shape), str(payload.dtype))})
            self.link_out.put(_MbRef(mb_id, kind, prefills, decodes), payload, meta)
            spans.append(("send", t3, time.perf_counter(), True))
            self.flush_link_events()
            self.send("spans", self.stage, mb_id, spans)
        elif not self.last:
            while self.pending_sends:
                work, _tensor = self.pending_sends.popleft()
                work.wait()
            t3 = time.perf_counter()
            if t3 - t2 > 20e-6:
                spans.append(("send_wait", t2, t3, False))
            payload = (out.cpu() if self.transfer_via_cpu else out).contiguous()
            if not self.aware:
                blob = pickle.dumps({"hidden": (tuple(payload.shape), str(payload.dtype))})
                self.dist.send(torch.tensor([len(blob)], dtype=torch.long), dst=self.stage + 1)
                self.dist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8), dst=self.stage + 1)
            work = self.dist.isend(payload, dst=self.stage + 1)
            self.pending_sends.append((work, payload))
            t4 = time.perf_counter()
            spans.append(("send", t3, t4, True))
            self.send("spans", self.stage, mb_id, spans)
        else:
            keys = [(p[0], p[1] + p[2]) for p in prefills if p[3]] + [(d[0], d[1] + 1) for d in decodes]
            if self.cpu_queues:
                pre = [(p[0], p[1], p[5]) for p in prefills]
                logits = out.detach().float().cpu()
                item = (mb_id, logits, keys, pre) + ((sampling,) if sampling else ())
                for q in self.cpu_queues:
                    q.put(item)  # storage moves to shared memory once
                t3 = time.perf_counter()
                spans.append(("to_samplers", t2, t3, True))
                self.send("spans", self.stage, mb_id, spans)
            else:
                if sampling:
                    self.sampler.set_params(sampling)
                for p in prefills:
                    self.sampler.observe_prefill(p[0], p[1], p[5])
                tokens = self.sampler.sample(out, keys)
                t3 = time.perf_counter()
                spans.append(("sample", t2, t3, True))
                self.send("done", self.stage, mb_id, tokens, spans)

    def misbehave(self, kind: str) -> None:
        if kind == "raise":
            raise RuntimeError(f"injected fault on stage {self.stage} at micro-batch #{self.count}")
        if kind == "exit":
            os._exit(3)
        while True:  # hang
            time.sleep(3600)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run one pipeline stage for a driver started with "
                                             "executor.launch=external.")
    ap.add_argument("--driver", required=True, help="the driver's control address, tcp://HOST:PORT")
    ap.add_argument("--stage", type=int, required=True, help="this stage's index, 0..P-1")
    args = ap.parse_args(argv)
    stage_main(args.driver, args.stage, None)


if __name__ == "__main__":
    main()
