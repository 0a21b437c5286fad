"""Start-up and shutdown of `testbed serve`.

The run config is built exactly as `testbed run` builds it (`prepare_experiment`: policy,
cost model, KV block manager, executor), then a Controller with no requests of its own is made
over the same pieces and driven online by the engine thread (engine_loop.py). Under
`executor=sim` the simulator is wrapped in `PacedExecutor` (engine/simulator/paced.py) at
`serve.time_scale`.

One MLflow run per server (when `output.mlflow`): opened at start, and at shutdown given the
summary of every request served (the same `summary.json`/`requests.csv` as `testbed run`, under
`<output.dir>/<run name>`), then closed FINISHED, KILLED when requests had to be aborted at
shutdown, FAILED when the engine failed. uvicorn catches SIGTERM and Ctrl-C (SIGHUP is turned
into SIGTERM): it stops accepting,
lets open requests finish for `serve.drain_timeout_s`, then the engine thread ends what is left
(a stream gets an error event and `[DONE]`, a waiting client a 503) and the stage processes are
stopped.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.controller import Controller
from engine.base.errors import ConfigError
from engine.core.metrics import SLO, microbatch_rows, request_rows, summarize
from engine.simulator.paced import PacedExecutor
from engine.core.request import Request
from testbed.run.runner import RunResult, prepare_experiment
from testbed.config.serve import ServeSettings
from testbed.config.spec import RunSpec

CUT_GRACE_S = 2.0  # after the drain time, how long cut requests get to send their error and `[DONE]`


@dataclass
class Server:
    """A built server: controller, engine thread, ASGI app; `serve_forever()` or `start_background()`."""

    spec: RunSpec
    settings: ServeSettings
    ctrl: Controller
    engine: object
    app: object
    info: dict
    tracker: object = None
    run_id: str | None = None
    _uvicorn: object = None
    _thread: threading.Thread | None = None
    _closed: bool = False
    result: RunResult | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        host = self.settings.host if ":" not in self.settings.host else f"[{self.settings.host}]"
        return f"http://{host}:{self.port}"

    @property
    def port(self) -> int:
        srv = self._uvicorn
        if srv is not None and getattr(srv, "servers", None):
            return srv.servers[0].sockets[0].getsockname()[1]
        return self.settings.port

    def _uvicorn_server(self):
        import uvicorn

        from testbed.serve.limits import guarded_protocol

        st = self.settings
        config = uvicorn.Config(self.app, host=st.host, port=st.port, log_level=st.log_level,
                                timeout_graceful_shutdown=st.drain_timeout_s + CUT_GRACE_S, lifespan="off",
                                access_log=False, timeout_keep_alive=st.keep_alive_s,
                                http=guarded_protocol(st.header_timeout_s, st.max_connections_per_client))
        self._uvicorn = _Uvicorn(config, self.engine, st.drain_timeout_s)
        return self._uvicorn

    def serve_forever(self, console=None) -> RunResult:
        """Serve until SIGTERM or Ctrl-C (uvicorn's handlers), then shut down."""
        from testbed.signals import saving

        srv = self._uvicorn_server()
        try:
            srv.run()
        finally:
            with saving():  # a second signal must not cut the save of the results and the MLflow run
                result = self.shutdown()
        return result

    def start_background(self, timeout_s: float = 30.0) -> str:
        """Serve from a thread (tests); returns the base URL once the socket listens."""
        srv = self._uvicorn_server()
        self._thread = threading.Thread(target=srv.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not srv.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self.base_url

    def shutdown(self) -> RunResult:
        """Stop HTTP (background mode), abort what is open, stop the stages, close the MLflow run."""
        if self._closed:
            return self.result
        self._closed = True
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(self.settings.drain_timeout_s + 5)
        engine = self.engine
        engine.draining = True
        try:
            engine.stop()
        finally:
            self.ctrl.executor.shutdown()
        self.result = self._result(engine.dead)
        self._close_tracking(engine.aborted_at_shutdown)
        return self.result

    def _result(self, error: str | None) -> RunResult:
        ctrl = self.ctrl
        tracks = [f"stage{s}" for s in range(ctrl.pipeline_depth)]
        slo = SLO(**self.info.pop("_slo"))
        return RunResult(spec=self.spec, summary=summarize(ctrl, slo, tracks), requests=request_rows(ctrl),
                         microbatches=microbatch_rows(ctrl), tracer=ctrl.executor.tracer, stage_tracks=tracks,
                         info=dict(self.info, mode="serve"), error=error)

    def _close_tracking(self, aborted: int) -> None:
        from testbed.run.outputs import run_name, write_run_dir

        run_dir = Path(self.spec.output.dir) / self.info.get("run_name", run_name(self.spec))
        write_run_dir(self.result, run_dir, plots=False)
        self.info["run_dir"] = str(run_dir)
        if self.tracker is not None:
            self.tracker.finish(self.run_id, self.result, run_dir)
            if aborted and not self.result.error:
                self.tracker.client.set_terminated(self.run_id, "KILLED")


def _Uvicorn(config, engine, drain_s: float):
    """uvicorn's server, imported here (importing this package stays cheap)."""
    import asyncio

    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server that tells the engine when its graceful shutdown begins (SIGTERM,
        Ctrl-C or `should_exit`), so that requests aborted from then on count as cut, not as
        clients that went away; after `drain_s` the engine ends the requests still open with an
        error (`EngineLoop.cut_open`), and uvicorn, which waits `CUT_GRACE_S` longer, finds
        their handlers done instead of cancelling them mid-stream."""

        def __init__(self, config, engine) -> None:
            super().__init__(config)
            self.engine = engine

        async def shutdown(self, sockets=None) -> None:
            self.engine.draining = True
            reason = f"the server is shutting down (serve.drain_timeout_s={drain_s:g} s passed)"
            cut = asyncio.get_running_loop().call_later(drain_s, self.engine.cut_open, reason)
            try:
                await super().shutdown(sockets=sockets)
            finally:
                cut.cancel()

    return _Server(config, engine)


def build_server(spec: RunSpec, console=None) -> Server:
    """Validate everything and start the engine (stage processes, for executor=torch)."""
    from testbed.run.outputs import run_name
    from testbed.serve.app import ServeState, build_app
    from testbed.serve.codec import load_codec
    from testbed.serve.engine_loop import EngineLoop
    from testbed.serve.metrics import ServeMetrics

    settings = spec.serve
    # prepare_experiment builds policy, cost model, KV and executor from the config; the stand-in
    # request keeps it from building a workload and is never served.
    prepared = prepare_experiment(spec, requests=[Request(0, 0.0, 1, 1)])
    stub = prepared.controller
    executor = stub.executor
    ex_name = prepared.info["executor"]
    if ex_name == "sim":
        executor = PacedExecutor(executor, settings.time_scale)
    elif settings.time_scale != 1.0:
        raise ConfigError(f"serve.time_scale={settings.time_scale} applies to executor=sim only; "
                          f"executor={ex_name} runs in real time")
    ctrl = Controller([], stub.policy, executor, stub.kv, cost_model=prepared.cost,
                      check_integrity=stub.check_integrity, data_dir=stub.data_dir,
                      num_microbatches=stub.num_microbatches, link_bandwidth_Bps=stub.link_bandwidth_Bps,
                      link_latency_s=stub.link_latency_s)
    ctrl.token_gaps = None  # the time between tokens is the client's to measure (bench serve's itl_*)
    model = prepared.cost.model
    name = settings.model_name or str(getattr(spec.settings.model, "name", None) or model.name)
    stamp = run_name(spec, who=prepared.info["policy"], what=f"serve-{ex_name}")
    info = dict(prepared.info, run_name=stamp, time_scale=settings.time_scale, model_name=name)
    tracker = run_id = None
    if spec.output.mlflow:
        from testbed.tracking.tracker import Tracker

        tracker = Tracker(spec.output)
        # the MLflow run's name in `testbed run`'s style (`gllm · serve · sim`), the folder's as always
        shown = spec.output.run_name or f"{prepared.info['policy']} · serve · {ex_name}"
        run_id = tracker.start(spec, shown, tags={"mode": "serve"})
    try:
        codec_vocab = model.vocab_size
        engine = EngineLoop(ctrl, None, poll_interval_s=settings.poll_interval_s)  # codec set after start
        engine.start()  # stage processes up (torch), clock started (sim)
        info["kv_num_blocks"] = ctrl.kv.num_blocks  # the torch engine on CUDA measures an unset pool at start
        path = getattr(executor, "model_path", None)
        if getattr(executor, "arch", None) is not None:
            codec_vocab = executor.arch.vocab_size
        codec = load_codec(path, codec_vocab)
        engine.codec = codec
        engine.incremental = codec.name == "fallback"
        if ex_name != "sim":  # before the socket listens: /health means warm (testbed/serve/warmup.py)
            from testbed.serve.warmup import warm_up

            warm_up(engine, settings.warmup_requests, codec_vocab, model.max_position_embeddings)
        metrics = ServeMetrics(ctrl, name)
        engine.metrics = metrics
        context = model.max_position_embeddings if ex_name != "sim" else None
        state = ServeState(engine, codec, settings, name, metrics, codec_vocab, context, created=int(time.time()),
                           setup=server_setup(spec))
        app = build_app(state)
    except BaseException as exc:
        executor.shutdown()
        if tracker is not None:
            tracker.fail(run_id, f"{type(exc).__name__}: {exc}")
        raise
    info["codec"] = codec.name
    return Server(spec, settings, ctrl, engine, app, info, tracker, run_id)


def server_setup(spec: RunSpec) -> dict[str, str]:
    """What this server runs, as `/v1/models` lists it (entry key `testbed`) and `testbed run`
    tags it: `testbed bench serve` logs these, not its own config's defaults."""
    from testbed.tracking.tracker import SETUP_TAGS, run_tags

    tags = run_tags(spec)
    return {k: tags[k] for k in SETUP_TAGS}


def _check_bind(st: ServeSettings) -> None:
    """A port in use (or an address not on this machine) is a one-line error before any stage starts."""
    import socket

    family = socket.AF_INET6 if ":" in st.host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((st.host, st.port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on serve.host={st.host} serve.port={st.port}: {exc.strerror or exc}; "
                          f"choose another serve.port (or serve.port=0 for a free one)") from None


class _Terminated(Exception):
    """SIGTERM, re-raised by uvicorn after its graceful shutdown."""


def cli_serve(overrides: list[str], console) -> int:
    import signal

    from testbed.config.spec import compose_spec

    spec = compose_spec(overrides)
    _check_bind(spec.serve)
    if spec.serve.port == 0:  # pick the free port now, so that the line below can name it
        from engine.torch_exec.wire.addresses import free_port

        spec = spec.with_values({"serve.port": free_port(spec.serve.host)})
    server = build_server(spec, console)
    st = server.settings
    if not st.is_loopback:
        console.print(f"[yellow]warning:[/yellow] serve.host={st.host} exposes port {st.port} beyond this machine; "
                      f"the server has no authentication")

    def _term(signum, frame):
        raise _Terminated()

    def _hangup(signum, frame):  # a closed terminal: stop as on SIGTERM (uvicorn's graceful path)
        signal.raise_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGHUP, _hangup)
    info = server.info
    console.print(f"serving {info['model_name']!r} ({info['executor']}, policy {info['policy']}, "
                  f"P={server.ctrl.pipeline_depth}, KV {info['kv_num_blocks']} blocks x {info['kv_block_size']}, "
                  f"text: {info['codec']}) on http://{st.host}:{st.port}  (Ctrl-C to stop)")
    if server.tracker is not None:
        console.print(server.tracker.link, highlight=False, soft_wrap=True, markup=False)
    try:
        result = server.serve_forever(console)
    except (KeyboardInterrupt, _Terminated):
        from testbed.signals import saving

        with saving():
            result = server.shutdown()
    s = result.summary
    console.print(f"served {s['num_finished']} requests ({s['num_failed']} failed or aborted)")
    print(Path(server.info["run_dir"]).resolve())
    return 1 if result.error else 0
