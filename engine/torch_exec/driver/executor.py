"""The driver side of the real engine: `TorchExecutor`, the `Executor` the controller drives.

It lives in the controller's process and never touches a tensor: `launch(mb)` turns a
micro-batch into plain metadata (engine/torch_exec/wire/tables.py `LaunchRows`: per prefill chunk its
token ids, per decode its last token, block tables as deltas against what the stages hold) and
sends the same `Launch` message to every stage: over the stage's own socketpair (wire/lane.py) for
spawned stages once they are ready, else over one ZeroMQ ROUTER socket. Every frame is a typed
msgpack message behind an HMAC of the run's secret (engine/torch_exec/wire/messages.py); frames that fail
the check -- a port scanner, a stray client, a pickle -- are dropped, logged and counted in
`dropped_frames`, never decoded further. The last stage answers with the sampled ids; every stage
ships its spans per micro-batch, which the driver records in the run's Tracer on tracks
`stage<s>` (and its own `launch` spans on track `driver`).

Completion order: micro-batches complete in launch order, except behind paced links (link.bandwidth
/ link.latency), where the policy's `schedule_transfer` may let a decode activation overtake a
prefill's remaining chunks: then any micro-batch in flight may complete (the controller keys
micro-batches by id). The hang diagnosis tracks, per stage, which in-flight micro-batches it finished;
a paced link that is still moving bytes (its sender reports `moved_bytes`) counts as progress, so a
10 kbps link is slow, not hung.

Start-up: Hello from every stage, then one StageInit each, then Ready. On CUDA with
`kv.num_blocks` unset the StageInit says num_blocks=0 and two rounds of KvProbe / KvPool come
in between: the stages' measured memory gives one pool size for all (engine/torch_exec/shared/kv_sizing.py),
which the controller's block manager takes before any block is handed out.

Listening sockets: the control socket binds `executor.zmq_host` (127.0.0.1 unless the user names
an address; then a warning names the port), and stage 0's torch.distributed store binds
`executor.master_addr` (also 127.0.0.1 by default).

Failure handling: the driver polls its socket together with every stage process's sentinel,
so a stage that dies is noticed at once; a stage that reports an exception is named with its
error; a pipeline that makes no progress for `stage_timeout_s` with work in flight is declared
hung, naming the first stage that has not finished the oldest micro-batch. Each raises
`RunFailedError` from `next_completion`. `shutdown()` is idempotent: it asks stages to stop,
then terminates and finally kills whatever is left (also registered with atexit).
"""
from __future__ import annotations

import atexit
import dataclasses
import math
import time
import weakref
from collections import deque
from typing import Any, Callable

from engine.core.batch import MicroBatch
from engine.base.errors import ConfigError
from engine.core.executor import Completion, Executor, ExecutorBuild
from engine.base.settings import RunConfig
from engine.torch_exec.settings import TorchSettings
import engine.torch_exec.wire.messages as wire
from engine.torch_exec.driver.control import ControlSocket
from engine.torch_exec.driver.diagnosis import FailureDiagnosis
from engine.torch_exec.wire.lane import POLL_SLICE_S, DriverLanes, LaneClosed
from engine.torch_exec.driver.startup import StageStartup
from engine.torch_exec.wire.tables import LaunchRows
from engine.core.trace import Tracer

STOP_GRACE_S = 5.0


class TorchExecutor(StageStartup, FailureDiagnosis, Executor):
    """P stage processes running a real model; see the package docstring for the architecture."""

    def __init__(self, settings: TorchSettings, *, pp: int, run_config: RunConfig | None = None,
                 layer_split: list[int] | None = None, tracer: Tracer | None = None, runtime=None,
                 link_bandwidth_Bps: float | None = None, link_latency_s: float = 0.0,
                 shape_links: bool = False, policy=None) -> None:
        self.settings = settings
        from engine.core.policy import RuntimeFeatures

        self.runtime = runtime or RuntimeFeatures()
        # Links are paced (emulated on loopback) only when the run names them (link.bandwidth /
        # link.latency); otherwise the data plane runs at loopback speed.
        self.link_bandwidth_Bps = link_bandwidth_Bps if shape_links else None
        self.link_latency_s = link_latency_s if shape_links else 0.0
        # Paced links send what the policy's schedule_transfer picks: a decode activation may
        # overtake a prefill's remaining chunks, so micro-batches may complete out of launch order.
        self.policy = policy
        self.reorder = bool(shape_links) and pp > 1
        self._parts: dict[int, list] = {}  # mb id -> CPU sampler parts received
        self.pipeline_depth = pp
        self.run_config = run_config if run_config is not None else RunConfig()
        self.layer_split = layer_split
        self.tracer = tracer or Tracer()
        # The controller's KV block manager (block tables, pool size), set by `attach(kv)`,
        # which the Controller calls when it is built.
        self.kv: Any = None
        self.block_table: Callable[[int], list[int]] | None = None
        self._live: Callable[[int], bool] = lambda seq_id: False  # does the run still hold its blocks?
        self._rows: LaunchRows | None = None  # a launch's rows, tables as deltas (wire/tables.py); set at start
        self.stage_info: list[dict] = []
        self.model_path: str | None = None
        self.arch: Any = None
        self.layers: list[tuple[int, int]] = []
        # CUDA without kv.num_blocks: the pool is sized from the stages' measured memory at start
        # (engine/torch_exec/shared/kv_sizing.py); the runner's block manager is resized then
        self.measure_kv = settings.device == "cuda" and self.run_config.kv.num_blocks is None
        self.kv_pool = None  # the sizing (kv_sizing.PoolSize) when measured
        self._procs: list[Any] = []
        self._lanes = DriverLanes()  # spawned stages' socketpairs (wire/lane.py), used from Ready on
        self._ctl: ControlSocket | None = None
        self._sock = None
        self._poller = None
        self._t0 = time.perf_counter()
        self._offsets = [0.0] * pp
        self._inflight: deque[int] = deque()  # mb ids in launch order
        self._ready: deque[Completion] = deque()
        self._stage_done: list[set[int]] = [set() for _ in range(pp)]  # in-flight mb ids each stage finished
        self._last_progress = time.perf_counter()
        self._failed: str | None = None
        self._started = False
        self._closed = False
        self.launch_overhead_s = 0.0  # driver time in launch(): metadata + encoding + sends
        self.num_launched = 0
        self._moved: dict[int, int] = {}  # stage -> bytes its paced out-link has moved so far
        self._secret = (wire.secret_from_env() if settings.launch == "external" else None) or wire.new_secret()
        self._run_id = wire.new_run_id()
        # external stages say hello before they know the run; spawned ones are told it at spawn
        self._codec = wire.Codec(self._secret, me="driver", run=self._run_id,
                                 unbound=(wire.Hello,) if settings.launch == "external" else ())
        atexit.register(_shutdown_ref, weakref.ref(self))

    # --- Executor interface ------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def start_clock(self) -> None:
        """The run's time 0 (engine/core/executor.py `start_clock`): after the policy prepared."""
        self._t0 = time.perf_counter()
        self._last_progress = self._t0

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self.block_table is None:
            if self.kv is None:
                raise RuntimeError("TorchExecutor needs the controller's block tables: the Controller "
                                   "calls executor.attach(kv); set executor.block_table when driving it by hand")
            self.block_table = self.kv.block_table
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise

    def launch(self, mb: MicroBatch) -> None:
        self._check_failed()
        t = time.perf_counter()
        sampling = [wire.RequestSampling(c.seq.seq_id, *c.seq.request.sampling.as_tuple()) for c in mb.prefills
                    if c.seq.request.sampling is not None]  # served requests' own, set with their prefill
        prefills, decodes, released = self._rows.rows(mb, self.block_table, self._live)
        msg = self._codec.encode(wire.Launch(mb.mb_id, mb.kind, prefills, decodes, sampling, released))
        for s in range(self.pipeline_depth):
            self._send_frame(s, msg)
        if not self._inflight:
            self._last_progress = time.perf_counter()
        self._inflight.append(mb.mb_id)
        t2 = time.perf_counter()
        self.launch_overhead_s += t2 - t
        self.num_launched += 1
        self.tracer.span("driver", "launch", t - self._t0, t2 - self._t0, mb.mb_id)

    def next_completion(self, deadline: float | None = None) -> Completion | None:
        while True:
            self._check_failed()
            if self._ready:
                return self._ready.popleft()
            if not self._inflight:
                if deadline is not None:
                    self.wait_until(deadline)
                return None
            now = time.perf_counter()
            hang_at = self._last_progress + self.settings.stage_timeout_s
            wait = hang_at - now
            if deadline is not None:
                wait = min(wait, deadline + self._t0 - now)
            if wait <= 0:
                if deadline is not None and now - self._t0 >= deadline:
                    return None
                self._fail(self._hang_message())
            self._poll(min(wait, POLL_SLICE_S))  # short polls: a long sleeper wakes late (wire/lane.py)

    def wait_until(self, t: float) -> None:
        """Idle until the run clock reads `t`, still watching the stages."""
        while True:
            self._check_failed()
            left = t + self._t0 - time.perf_counter()
            if left <= 0:
                return
            self._poll(left)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        procs = self._procs
        if self._sock is not None:
            for s in range(self.pipeline_depth):
                try:
                    if self._lanes.carries(s):
                        self._lanes.lanes[s].send(self._codec.encode(wire.Stop(), to=self._ident(s)))
                    else:
                        self._ctl.send(self._ident(s), wire.Stop(), nonblocking=True)
                except Exception:
                    pass
        # after a failure some stage may be hung or blocked on a dead peer: do not wait for it long
        deadline = time.monotonic() + (0.5 if self._failed else STOP_GRACE_S)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for p in procs:
            try:
                p.close()
            except Exception:
                pass
        self._lanes.close()
        if self._ctl is not None:
            self._ctl.close()
            self._sock = None

    def attach(self, kv) -> None:
        """Follow this block manager's tables (what the runner should call before `start()`)."""
        self.kv = kv
        self.block_table = kv.block_table
        self._live = kv.holds

    @property
    def dropped_frames(self) -> int:
        """Frames on the control socket that failed authentication or the schema (dropped)."""
        return self._ctl.dropped if self._ctl is not None else 0

    # --- helpers for tests and tools -----------------------------------------------------------------
    def stage_pids(self) -> list[int]:
        return [info.get("pid", -1) for info in self.stage_info]

    # --- messages --------------------------------------------------------------------------------------
    @staticmethod
    def _ident(s: int) -> str:
        """Stage s's sender name; the control socket knows its connection once it said hello."""
        return f"stage{s}"

    def _send(self, s: int, msg) -> None:
        self._send_frame(s, self._codec.encode(msg, to=self._ident(s)))

    def _send_frame(self, s: int, frame: bytes) -> None:
        """An encoded message to stage s: its lane once the stages are ready, else the control socket."""
        if self._lanes.carries(s):
            try:
                self._lanes.lanes[s].send(frame)
            except LaneClosed:
                self._procs[s].join(2.0)
                self._check_processes()
                self._fail(f"stage {s} closed its line to the driver while the run was in progress")
        else:
            self._ctl.send_raw(self._ident(s), frame)

    def _poll(self, timeout_s: float, expect: type | None = None) -> list:
        """Wait up to `timeout_s` for messages; handle spans/done/error; return `expect` messages."""
        events = dict(self._poller.poll(max(0, math.ceil(timeout_s * 1000))))
        out: list = []
        if self._sock in events:
            while (msg := self._ctl.recv()) is not None:
                self._dispatch(msg, expect, out)
        msgs, closed = self._lanes.messages(events, self._codec, self._ctl.drop)
        for msg in msgs:
            self._dispatch(msg, expect, out)
        for s in closed:  # its process is ending: name how it ended, not the closed line
            self._procs[s].join(2.0)
        if closed or any(k not in self._lanes.fds for k in events if k is not self._sock):  # a sentinel: a stage ended
            self._check_processes()
        if closed:
            self._fail(f"stage {closed[0]} closed its line to the driver while the run was in progress")
        return out


    def _dispatch(self, msg, expect: type | None, out: list) -> None:
        if isinstance(msg, wire.StageError):
            self._stage_error(msg)
        elif expect is not None and isinstance(msg, expect):
            out.append(msg)
        else:
            self._handle(msg)

    def _handle(self, msg) -> None:
        if isinstance(msg, wire.Spans):
            self._record(msg.stage, msg.mb_id, msg.spans)
            if msg.mb_id in self._inflight and 0 <= msg.stage < self.pipeline_depth:
                self._stage_done[msg.stage].add(msg.mb_id)
            self._last_progress = time.perf_counter()
        elif isinstance(msg, wire.Done):
            self._record(msg.stage, msg.mb_id, msg.spans)
            self._last_progress = time.perf_counter()
            self._retire(f"stage {msg.stage}", msg.mb_id)
            self._ready.append(Completion(msg.mb_id, self.now(), tuple(msg.tokens)))
        elif isinstance(msg, wire.LinkEvents):  # the link scheduler's queueing and transfer spans
            self._link_events(msg)
        elif isinstance(msg, wire.Sampled):  # one CPU sampler's share of a micro-batch
            self._sampled(msg)
        elif not isinstance(msg, wire.Pong):
            self._fail(f"unexpected message {msg._wire_tag!r} on the control socket")

    def _link_events(self, msg: wire.LinkEvents) -> None:
        off = self._offsets[msg.stage] + self._t0
        for name, a, b, mb_id in msg.events:
            a = max(a - off, 0.0)
            self.tracer.span(f"link{msg.stage}", name, a, max(b - off, a), mb_id, busy=False)
        if msg.moved_bytes > self._moved.get(msg.stage, 0):  # bytes still moving: not hung
            self._moved[msg.stage] = msg.moved_bytes
            self._last_progress = time.perf_counter()

    def _sampled(self, msg: wire.Sampled) -> None:
        self.tracer.span(f"sampler{msg.sampler}", "sample", max(msg.start - self._t0, 0.0),
                         max(msg.end - self._t0, 0.0), msg.mb_id)
        parts = self._parts.setdefault(msg.mb_id, [])
        parts.append((msg.rows, msg.tokens))
        if len(parts) < msg.num_parts:
            return
        del self._parts[msg.mb_id]
        out = [0] * sum(len(r) for r, _ in parts)
        for rows, tokens in parts:
            for i, tok in zip(rows, tokens):
                out[i] = tok
        self._last_progress = time.perf_counter()
        self._retire("CPU samplers", msg.mb_id)
        self._ready.append(Completion(msg.mb_id, self.now(), tuple(out)))

    def _retire(self, who: str, mb_id: int) -> None:
        """A micro-batch completed: in launch order, or -- behind policy-scheduled links -- any in flight."""
        head = self._inflight[0] if self._inflight else None
        if head == mb_id:
            self._inflight.popleft()
        elif self.reorder and mb_id in self._inflight:
            self._inflight.remove(mb_id)
        else:
            self._fail(f"{who} completed micro-batch {mb_id} while {head} was the oldest in flight")
        for done in self._stage_done:
            done.discard(mb_id)

    def _policy_spec(self) -> tuple[str, dict]:
        """("module:qualname", params) of the run's policy: stages behind paced links rebuild it
        for `schedule_transfer` ("" = the default FIFO transfers)."""
        pol = self.policy
        if pol is None or not self.reorder:
            return "", {}
        params = pol.params
        values = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)} \
            if dataclasses.is_dataclass(params) else {}
        return f"{type(pol).__module__}:{type(pol).__qualname__}", values

    def _record(self, s: int, mb_id: int, spans: list) -> None:
        off = self._offsets[s] + self._t0
        track = f"stage{s}"
        for name, a, b, busy in spans:
            a = max(a - off, 0.0)
            b = max(b - off, a)
            self.tracer.span(track, name, a, b, mb_id, busy=busy)

def _shutdown_ref(ref) -> None:
    ex = ref()
    if ex is not None:
        ex.shutdown()


def check_launchable(settings: TorchSettings) -> None:
    """What can be refused before any process starts (one `error:` line each)."""
    if settings.device == "cuda" and settings.launch == "spawn":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("executor.device=cuda, but no CUDA device is available here "
                              "(torch.cuda.is_available() is False); valid choices: cpu")
    if settings.attention == "triton":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            raise ConfigError("executor.attention=triton, but triton is not installed here; "
                              "valid choices: auto, torch")
    if settings.launch == "external":
        try:
            secret = wire.secret_from_env()
        except (OSError, ValueError) as exc:
            raise ConfigError(f"executor.launch=external: cannot read the stage secret: {exc}") from None
        if secret is None:
            raise ConfigError(f"executor.launch=external needs the run's shared secret on the driver and every "
                              f"stage host: set {wire.SECRET_ENV} (64 hex digits, e.g. from "
                              f"`python -c 'import secrets; print(secrets.token_hex(32))'`) or "
                              f"{wire.SECRET_FILE_ENV}")


def make_torch_executor(settings: TorchSettings, build: ExecutorBuild) -> TorchExecutor:
    check_launchable(settings)
    rc = build.run_config
    pp = build.cost_model.pp if build.cost_model is not None else rc.parallel.pp
    if settings.device == "cuda" and settings.backend == "nccl" and settings.launch == "spawn":
        from engine.torch_exec.shared.placement import data_backend

        data_backend(settings.backend, settings.device, pp, TorchExecutor._device_count())  # refuses shared GPUs
    split = rc.parallel.layer_split
    if isinstance(split, str) and build.cost_model is not None:  # `balanced`: the cost model's answer
        split = build.cost_model.layers
    return TorchExecutor(settings, pp=pp, run_config=rc, layer_split=list(split) if split else None,
                         tracer=build.tracer, runtime=build.runtime, link_bandwidth_Bps=build.link.bandwidth_Bps,
                         link_latency_s=build.link.latency_s, shape_links=build.link.explicit, policy=build.policy)
