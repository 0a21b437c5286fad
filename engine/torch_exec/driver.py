"""The driver side of the real engine: `TorchExecutor`, the `Executor` the controller drives.

It lives in the controller's process and never touches a tensor: `launch(mb)` turns a
micro-batch into plain metadata (per prefill chunk: sequence id, start, token count, whether it
samples, the controller's block table and the chunk's token ids = prompt ids followed by the
sequence's generated ids, so recomputation after preemption re-feeds exactly what was there;
per decode: id, position, block table, last token) and sends the same pickled message to every
stage over one ZeroMQ ROUTER socket. The last stage answers with the sampled ids; every stage
ships its spans per micro-batch, which the driver records in the run's Tracer on tracks
`stage<s>` (and its own `launch` spans on track `driver`).

Completion order: micro-batches complete in launch order, except behind paced links (link.bandwidth
/ link.latency), where the policy's `schedule_transfer` may let a decode activation overtake a
prefill's remaining chunks: then any micro-batch in flight may complete (the controller keys
micro-batches by id). The hang diagnosis tracks, per stage, which in-flight micro-batches it finished.

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
import os
import pickle
import socket
import time
import weakref
from collections import deque
from typing import Any, Callable

from engine.batch import MicroBatch
from engine.errors import ConfigError, RunFailedError
from engine.executor import Completion, Executor, ExecutorBuild
from engine.settings import RunConfig
from engine.torch_exec.settings import TorchSettings
from engine.trace import Tracer

STOP_GRACE_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TorchExecutor(Executor):
    """P stage processes running a real model; see the package docstring for the architecture."""

    def __init__(self, settings: TorchSettings, *, pp: int, run_config: RunConfig | None = None,
                 layer_split: list[int] | None = None, tracer: Tracer | None = None, runtime=None,
                 link_bandwidth_Bps: float | None = None, link_latency_s: float = 0.0,
                 shape_links: bool = False, policy=None) -> None:
        self.settings = settings
        from engine.policy import RuntimeFeatures

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
        self.stage_info: list[dict] = []
        self.model_path: str | None = None
        self.arch: Any = None
        self.layers: list[tuple[int, int]] = []
        self._procs: list[Any] = []
        self._ctx = None
        self._sock = None
        self._poller = None
        self._t0 = time.perf_counter()
        self._offsets = [0.0] * pp
        self._inflight: deque[int] = deque()  # mb ids in launch order
        self._ready: deque[Completion] = deque()
        self._stage_done: list[set[int]] = [set() for _ in range(pp)]  # in-flight mb ids each stage finished
        self._last_progress = time.perf_counter()
        self._prompts: dict[int, list[int]] = {}
        self._failed: str | None = None
        self._started = False
        self._closed = False
        self.launch_overhead_s = 0.0  # driver time in launch(): metadata + pickling + sends
        self.num_launched = 0
        atexit.register(_shutdown_ref, weakref.ref(self))

    # --- Executor interface ------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self._t0

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
        meta = self._metadata(mb)
        sampling = {c.seq.seq_id: c.seq.request.sampling.as_tuple() for c in mb.prefills
                    if c.seq.request.sampling is not None}
        if sampling:  # served requests' own sampling, set on the last stage with their prefill
            meta = (*meta, sampling)
        msg = pickle.dumps(("mb", mb.mb_id, mb.kind, *meta), protocol=pickle.HIGHEST_PROTOCOL)
        for s in range(self.pipeline_depth):
            self._sock.send_multipart([self._ident(s), msg])
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
            self._pump(wait)

    def wait_until(self, t: float) -> None:
        """Idle until the run clock reads `t`, still watching the stages."""
        while True:
            self._check_failed()
            left = t + self._t0 - time.perf_counter()
            if left <= 0:
                return
            self._pump(left)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        procs = self._procs
        if self._sock is not None:
            for s in range(self.pipeline_depth):
                try:
                    self._sock.send_multipart([self._ident(s), pickle.dumps(("stop",))], flags=1)  # NOBLOCK
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
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def attach(self, kv) -> None:
        """Follow this block manager's tables (what the runner should call before `start()`)."""
        self.kv = kv
        self.block_table = kv.block_table

    # --- helpers for tests and tools -----------------------------------------------------------------
    def stage_pids(self) -> list[int]:
        return [info.get("pid", -1) for info in self.stage_info]

    # --- start-up -------------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        import zmq

        from engine.torch_exec.checkpoint import model_source, random_checkpoint, read_arch

        st = self.settings
        P = self.pipeline_depth
        model = self.run_config.model
        path, spec = model_source(st, {"model": dataclasses.asdict(model)} if model is not None else {})
        if path is None:
            cache = st.model_cache_dir or os.path.join(self.run_config.output.dir, "models")
            path = random_checkpoint(spec, st.model_seed, cache)
        self.model_path = os.path.abspath(path)
        self.arch = arch = read_arch(path)
        self.layers = self._layer_ranges(arch.num_layers)
        num_blocks, block_size = self.kv.num_blocks, self.kv.block_size
        self._check_kv_memory(arch, num_blocks, block_size)
        seed = st.prompt_seed if st.prompt_seed is not None else self.run_config.seed
        self._prompt_seed = seed
        self._vocab = arch.vocab_size

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        if st.zmq_port:
            self._sock.bind(f"tcp://{st.zmq_host}:{st.zmq_port}")
            port = st.zmq_port
        else:
            port = self._sock.bind_to_random_port(f"tcp://{st.zmq_host}")
        host = "127.0.0.1" if st.zmq_host in ("0.0.0.0", "*") else st.zmq_host
        addr = f"tcp://{host}:{port}"
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        if st.launch == "spawn":
            import torch.multiprocessing as tmp

            from engine.torch_exec.worker import stage_main

            mp = tmp.get_context("spawn")
            # Stages inherit the environment at spawn. Passive OpenMP waits: spinning threads of
            # P stages (plus the driver) on few cores starve each other (see bench.py's note).
            saved = os.environ.get("OMP_WAIT_POLICY")
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
            try:
                for s in range(P):
                    p = mp.Process(target=stage_main, args=(addr, s, os.getpid()), name=f"pp-stage{s}",
                                   daemon=True)
                    p.start()
                    self._procs.append(p)
                    self._poller.register(p.sentinel, zmq.POLLIN)
            finally:
                if saved is None:
                    os.environ.pop("OMP_WAIT_POLICY", None)
        backend = st.backend
        if backend == "auto":
            backend = "gloo"
            if st.device == "cuda":
                import torch

                backend = "nccl" if torch.cuda.device_count() >= P or st.launch == "external" else "gloo"
        master_port = st.master_port or free_port(st.master_addr if st.launch == "spawn" else "0.0.0.0")
        deadline = time.perf_counter() + st.start_timeout_s
        hello = self._gather("hello", deadline)
        self.stage_info = [{"host": h[2], "pid": h[3]} for h in hello]
        init = {"pp": P, "path": self.model_path, "arch": arch.to_dict(), "layers": self.layers,
                "num_blocks": num_blocks, "block_size": block_size, "dtype": st.dtype, "device": st.device,
                "threads": st.threads_per_stage, "backend": backend, "master_addr": st.master_addr,
                "master_port": master_port, "stage_timeout_s": st.stage_timeout_s, "sampling": st.sampling,
                "temperature": st.temperature, "top_k": st.top_k, "top_p": st.top_p,
                "sample_seed": st.sample_seed, "fault": st.fault,
                "repetition_penalty": st.repetition_penalty, "presence_penalty": st.presence_penalty,
                "frequency_penalty": st.frequency_penalty, "num_cpu_samplers": st.num_cpu_samplers,
                "cpu_sampling": self.runtime.cpu_sampling, "overlap_input_prep": self.runtime.overlap_input_prep,
                "structure_aware_transfer": self.runtime.structure_aware_transfer,
                "link_bandwidth_Bps": self.link_bandwidth_Bps, "link_latency_s": self.link_latency_s,
                "link_chunk_bytes": st.link_chunk_bytes, "driver_addr": addr,
                "policy": self._policy_spec()}
        for s in range(P):
            self._send(s, ("init", init))
        ready = self._gather("ready", deadline)
        for s, r in enumerate(ready):
            self.stage_info[s].update(r[2])
        self._clock_offsets(deadline)
        self._t0 = time.perf_counter()
        self._last_progress = self._t0

    def _layer_ranges(self, num_layers: int) -> list[tuple[int, int]]:
        from engine.costmodel import split_layers

        split = split_layers(num_layers, self.pipeline_depth, self.layer_split)
        out, first = [], 0
        for n in split:
            out.append((first, n))
            first += n
        return out

    def _check_kv_memory(self, arch, num_blocks: int, block_size: int) -> None:
        """Refuse a CPU pool that cannot fit this machine (the cost model sizes KV for GPUs)."""
        if self.settings.device != "cpu":
            return
        elem = 4 if self.settings.dtype == "float32" else 2
        per_layer = 2 * num_blocks * block_size * arch.num_kv_heads * arch.head_dim * elem
        total = per_layer * arch.num_layers  # all stages share this machine when spawned
        try:
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return
        if self.settings.launch == "spawn" and total > 0.5 * mem:
            raise ConfigError(
                f"the KV cache of {num_blocks} blocks x {block_size} tokens needs {total / 2**30:.1f} GiB on this "
                f"machine ({mem / 2**30:.1f} GiB RAM): set kv.num_blocks (e.g. kv.num_blocks="
                f"{max(1, int(0.25 * mem / (per_layer / num_blocks * arch.num_layers)))})")

    def _gather(self, kind: str, deadline: float) -> list[tuple]:
        got: dict[int, tuple] = {}
        while len(got) < self.pipeline_depth:
            left = deadline - time.perf_counter()
            if left <= 0:
                missing = [s for s in range(self.pipeline_depth) if s not in got]
                self._fail(f"stage(s) {missing} did not report {kind!r} within executor.start_timeout_s="
                           f"{self.settings.start_timeout_s:g} s")
            for msg in self._poll(left, expect=kind):
                got[msg[1]] = msg
        return [got[s] for s in range(self.pipeline_depth)]

    def _clock_offsets(self, deadline: float) -> None:
        """Stage clock - driver clock: 0 on this host (CLOCK_MONOTONIC), else from ping round trips."""
        here = socket.gethostname()
        for s, info in enumerate(self.stage_info):
            if info["host"] == here and os.uname().sysname == "Linux":
                continue
            best = None
            for _ in range(5):
                a = time.perf_counter()
                self._send(s, ("ping",))
                msg = self._poll_one("pong", deadline)
                b = time.perf_counter()
                if best is None or b - a < best[0]:
                    best = (b - a, msg[2] - (a + b) / 2)
            self._offsets[s] = best[1]

    def _poll_one(self, kind: str, deadline: float) -> tuple:
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                self._fail(f"no {kind!r} within executor.start_timeout_s")
            msgs = self._poll(left, expect=kind)
            if msgs:
                return msgs[0]

    # --- messages --------------------------------------------------------------------------------------
    @staticmethod
    def _ident(s: int) -> bytes:
        return f"stage{s}".encode()

    def _send(self, s: int, msg: tuple) -> None:
        self._sock.send_multipart([self._ident(s), pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)])

    def _poll(self, timeout_s: float, expect: str | None = None) -> list[tuple]:
        """Wait up to `timeout_s` for messages; handle spans/done/error; return `expect` messages."""
        import zmq

        events = dict(self._poller.poll(max(0, int(timeout_s * 1000) + 1)))
        out = []
        if self._sock in events:
            while True:
                try:
                    _ident, raw = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = pickle.loads(raw)
                kind = msg[0]
                if kind == "error":
                    self._stage_error(msg[1], msg[2])
                elif kind == expect:
                    out.append(msg)
                else:
                    self._handle(msg)
        if len(events) > (1 if self._sock in events else 0):
            self._check_processes()
        return out

    def _pump(self, timeout_s: float) -> None:
        self._poll(timeout_s)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "spans":
            _, s, mb_id, spans = msg
            self._record(s, mb_id, spans)
            if mb_id in self._inflight:
                self._stage_done[s].add(mb_id)
            self._last_progress = time.perf_counter()
        elif kind == "done":
            _, s, mb_id, tokens, spans = msg
            self._record(s, mb_id, spans)
            self._last_progress = time.perf_counter()
            self._retire(f"stage {s}", mb_id)
            self._ready.append(Completion(mb_id, self.now(), tuple(tokens)))
        elif kind == "link":  # the link scheduler's queueing and transfer spans of stage s's out-link
            _, s, events = msg
            off = self._offsets[s] + self._t0
            for name, a, b, mb_id in events:
                a = max(a - off, 0.0)
                self.tracer.span(f"link{s}", name, a, max(b - off, a), mb_id, busy=False)
        elif kind == "sampled":  # one CPU sampler's share of a micro-batch
            _, k, mb_id, n, rows, tokens, (a, b) = msg
            self.tracer.span(f"sampler{k}", "sample", max(a - self._t0, 0.0), max(b - self._t0, 0.0), mb_id)
            parts = self._parts.setdefault(mb_id, [])
            parts.append((rows, tokens))
            if len(parts) == n:
                del self._parts[mb_id]
                size = sum(len(r) for r, _ in parts)
                out = [0] * size
                for r, t in parts:
                    for i, tok in zip(r, t):
                        out[i] = tok
                self._last_progress = time.perf_counter()
                self._retire("CPU samplers", mb_id)
                self._ready.append(Completion(mb_id, self.now(), tuple(out)))
        elif kind == "pong":
            pass
        else:
            self._fail(f"unexpected message {kind!r} from stage {msg[1] if len(msg) > 1 else '?'}")

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

    def _policy_spec(self):
        """(module, class, params) of the run's policy: stages rebuild it for `schedule_transfer`."""
        pol = self.policy
        if pol is None or not self.reorder:
            return None
        return (type(pol).__module__, type(pol).__qualname__, pol.params)

    def _record(self, s: int, mb_id: int, spans: list) -> None:
        off = self._offsets[s] + self._t0
        track = f"stage{s}"
        for name, a, b, busy in spans:
            a = max(a - off, 0.0)
            b = max(b - off, a)
            self.tracer.span(track, name, a, b, mb_id, busy=busy)

    # --- metadata --------------------------------------------------------------------------------------
    def _metadata(self, mb: MicroBatch) -> tuple[list, list]:
        table = self.block_table
        prefills = []
        for c in mb.prefills:
            seq = c.seq
            prompt = self._prompt(seq.request)
            end = c.start + c.num_tokens
            plen = len(prompt)
            if end <= plen:
                toks = prompt[c.start:end]
            else:
                toks = (prompt + seq.output_token_ids)[c.start:end]
            prefills.append((seq.seq_id, c.start, c.num_tokens, c.samples, table(seq.seq_id), toks))
        decodes = []
        for seq in mb.decodes:
            pos = seq.num_computed
            prompt = self._prompt(seq.request)
            tok = prompt[pos] if pos < len(prompt) else seq.output_token_ids[pos - len(prompt)]
            decodes.append((seq.seq_id, pos, table(seq.seq_id), tok))
        return prefills, decodes

    def _prompt(self, request) -> list[int]:
        ids = self._prompts.get(request.request_id)
        if ids is None:
            from engine.torch_exec.checkpoint import prompt_ids

            ids = self._prompts[request.request_id] = prompt_ids(request, self._vocab, self._prompt_seed)
        return ids

    # --- failures ------------------------------------------------------------------------------------
    def _check_processes(self) -> None:
        for s, p in enumerate(self._procs):
            if p.exitcode is not None:
                # drain a last error message the stage may have sent before dying
                self._drain_errors()
                sig = -p.exitcode if p.exitcode < 0 else None
                how = f"was killed by signal {sig}" if sig else f"exited with code {p.exitcode}"
                self._fail(f"stage {s} (pid {p.pid}) {how} while the run was in progress")

    def _drain_errors(self) -> None:
        import zmq

        if self._sock is None:
            return
        deadline = time.perf_counter() + 0.2
        while time.perf_counter() < deadline:
            if not self._sock.poll(20, zmq.POLLIN):
                continue
            _ident, raw = self._sock.recv_multipart()
            msg = pickle.loads(raw)
            if msg[0] == "error":
                self._stage_error(msg[1], msg[2])
            elif msg[0] in ("spans", "done"):
                self._handle(msg)

    def _stage_error(self, stage: int, text: str) -> None:
        """A stage reported an exception. If another stage process died, that death is the root
        cause (its neighbours' communication then fails): name the dead stage first."""
        deadline = time.monotonic() + 1.0
        dead = []
        while time.monotonic() < deadline:
            dead = [(s, p) for s, p in enumerate(self._procs) if p.exitcode is not None and s != stage]
            if dead:
                break
            time.sleep(0.05)
        first = text.strip().splitlines()[0] if text.strip() else "error"
        if dead:
            s, p = dead[0]
            sig = -p.exitcode if p.exitcode < 0 else None
            how = f"was killed by signal {sig}" if sig else f"exited with code {p.exitcode}"
            self._fail(f"stage {s} (pid {p.pid}) {how} while the run was in progress; "
                       f"then stage {stage} failed: {first}")
        self._fail(f"stage {stage} failed: {text.strip()}")

    def _hang_message(self) -> str:
        oldest = self._inflight[0]
        stuck = next((s for s in range(self.pipeline_depth) if oldest not in self._stage_done[s]),
                     self.pipeline_depth - 1)
        pid = self.stage_info[stuck].get("pid") if stuck < len(self.stage_info) else "?"
        return (f"stage {stuck} (pid {pid}) made no progress for executor.stage_timeout_s="
                f"{self.settings.stage_timeout_s:g} s on micro-batch {oldest} (hung)")

    def _fail(self, message: str) -> None:
        if self._failed is None:
            self._failed = message
        raise RunFailedError(self._failed)

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise RunFailedError(self._failed)


def _shutdown_ref(ref) -> None:
    ex = ref()
    if ex is not None:
        ex.shutdown()


def make_torch_executor(settings: TorchSettings, build: ExecutorBuild) -> TorchExecutor:
    rc = build.run_config
    pp = build.cost_model.pp if build.cost_model is not None else rc.parallel.pp
    split = rc.parallel.layer_split
    return TorchExecutor(settings, pp=pp, run_config=rc, layer_split=list(split) if split else None,
                         tracer=build.tracer, runtime=build.runtime, link_bandwidth_Bps=build.link.bandwidth_Bps,
                         link_latency_s=build.link.latency_s, shape_links=build.link.explicit, policy=build.policy)
