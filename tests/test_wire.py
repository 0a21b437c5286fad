"""The torch engine's wire: typed, authenticated messages; loopback-only sockets; no orphans.

Codec tests run without torch. The engine tests run tiny-llama pipelines on the CPU: hostile
frames sent to the driver's control port during a run (a pickle that would create a file, random
bytes, a well-formed message under the wrong secret) are dropped and counted while the run still
produces Hugging Face's greedy tokens; every listening socket of the driver, the stages and the
CPU samplers is on loopback; and the stages and samplers end when the driver is SIGKILLed.
"""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import msgpack
import pytest

from engine.torch_exec.wire import messages as wire

# --- the codec -------------------------------------------------------------------------------------------
SECRET = bytes(range(32))
SAMPLES = [
    wire.Hello(1, "host", 123),
    wire.Launch(7, "mixed", [wire.PrefillMeta(3, 0, 4, True, 0, [1, 2], [10, 11, 12, 13])],
                [wire.DecodeMeta(4, 9, 1, [5], 42)], [wire.RequestSampling(3, 0.7, 0.9, 40, None, 1.1, 0.0, 0.5)], [2]),
    wire.Spans(0, 7, [wire.SpanRec("forward:mixed", 1.5, 2.0, True)]),
    wire.Done(1, 7, [5, 6], [wire.SpanRec("sample", 1.0, 2.0, True)]),
    wire.LinkEvents(0, [wire.LinkSpan("xfer:prefill", 1.0, 2.0, 7)], 4096),
    wire.StageError(1, "RuntimeError: boom", 3.5),
    wire.Sampled(0, 7, 2, [0, 2], [9, 8], 1.0, 2.0),
    wire.SampleJob(7, 2, [1], [wire.SampleKey(3, 5)], [wire.PrefillTokens(3, 0, [1, 2])], "float32", [1, 32000],
                  [wire.RequestSampling(3, 1.0, 1.0, 0, 7, 1.0, 0.0, 0.0)]),
    wire.TensorMeta([16, 256], "torch.float32"),
    wire.Ping(), wire.Pong(1, 12.5), wire.Stop(), wire.Ready(0, 99, "cpu", 0.5, 1.0),
    wire.StageInit(pp=2, path="/m", arch={"hidden_size": 256, "rope_scaling": None}, layers=[(0, 4), (4, 4)],
                   num_blocks=64, block_size=16, dtype="float32", device="cpu", threads=1, backend="gloo",
                   master_addr="127.0.0.1", master_port=29500, stage_timeout_s=60.0, fault="",
                   sampling=wire.SamplerConfig("greedy", 1.0, 0, 1.0, 0, 1.0, 0.0, 0.0), num_cpu_samplers=2,
                   cpu_sampling=False, overlap_input_prep=True, structure_aware_transfer=False,
                   link_bandwidth_Bps=None, link_latency_s=0.0, link_chunk_bytes=1 << 20,
                   driver_addr="tcp://127.0.0.1:5555", policy_class="policies.molink:MoLinkPolicy",
                   policy_params={"N": 10, "extension_mode": "off"}),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    codec = wire.Codec(SECRET)
    assert codec.decode(codec.encode(msg)) == msg


def _signed(body_obj, binding=("", "stage1", "peer", 1)) -> bytes:
    """A frame with a valid MAC around an arbitrary msgpack body (what an insider could send);
    a [tag, fields] body gets `binding` appended."""
    codec = wire.Codec(SECRET)
    if isinstance(body_obj, list) and len(body_obj) == 2:
        body_obj = [*body_obj, list(binding)]
    body = msgpack.packb(body_obj, use_bin_type=True)
    return codec._mac(body) + body


@pytest.mark.parametrize("frame, why", [
    (b"", "too short"),
    (os.urandom(20), "too short"),
    (os.urandom(200), "bad MAC"),
    (pickle.dumps(("hello", 0, "h", 1)) * 4, "bad MAC"),
    (wire.Codec(bytes(32)).encode(wire.Ping()), "bad MAC"),  # right schema, wrong secret
    (_signed(["no_such_tag", {}]), "unknown message tag"),
    (_signed(["pong", {"stage": 1, "clock": 2.0, "extra": 3}]), "fields differ"),
    (_signed(["pong", {"stage": 1}]), "fields differ"),
    (_signed(["pong", {"stage": "1", "clock": 2.0}]), "expected int"),
    (_signed(["mb", {"sampling": [], "released": [], "mb_id": 1, "kind": "d", "prefills": [], "decodes": [[1, 2, 0, [3], "x"]]}]), "expected int"),
    (_signed(["mb", {"sampling": [], "released": [], "mb_id": 1, "kind": "d", "prefills": [], "decodes": [[1, 2, [3]]]}]), "DecodeMeta"),
    (_signed(["mb", {"sampling": [], "released": [], "mb_id": 1, "kind": "d", "prefills": [], "decodes": [[True, 2, 0, [3], 4]]}]), "expected int"),
    (_signed(["mb", {"sampling": [], "released": [], "mb_id": 1, "kind": "d", "prefills": [], "decodes": [[1, 2, 0, [3, True], 4]]}]), "array of int"),
    (_signed(["mb", {"sampling": [], "released": [], "mb_id": 1, "kind": "d", "prefills": [[1, 0, 2, 1, 0, [3], [4, 5]]], "decodes": []}]),
     "expected bool"),
    (_signed(["mb", {"sampling": [], "released": [], "mb_id": 1, "kind": "d", "prefills": [], "decodes": {"a": 1}}]), "expected array"),
    (_signed({"tag": "ping"}), "[tag, fields"),
    (_signed(["ping", {}])[:-1] + b"\xc1", "bad MAC"),
])
def test_codec_rejects(frame, why):
    with pytest.raises(wire.WireError, match=why.replace("[", r"\[")):
        wire.Codec(SECRET).decode(frame)


def test_a_replayed_frame_is_refused():
    """The MAC covered the body only: one replayed `done` or `hello` killed a run and replayed
    `spans` pushed a stage's utilisation to 1.51 (issue 25, item 3)."""
    sender, receiver = wire.Codec(SECRET), wire.Codec(SECRET)
    frame = sender.encode(wire.Pong(1, 2.0))
    assert receiver.decode(frame) == wire.Pong(1, 2.0)
    with pytest.raises(wire.WireError, match="replayed"):
        receiver.decode(frame)
    later = sender.encode(wire.Pong(1, 3.0))
    assert receiver.decode(later) == wire.Pong(1, 3.0)
    with pytest.raises(wire.WireError, match="replayed"):
        receiver.decode(frame)  # an old frame stays refused


def test_frames_are_bound_to_run_and_direction():
    stage = wire.Codec(SECRET, me="stage1", run="r1")
    to_driver = stage.encode(wire.Done(1, 7, [3], []))
    with pytest.raises(wire.WireError, match="another run"):
        wire.Codec(SECRET, me="driver", run="r2").decode(to_driver)
    with pytest.raises(wire.WireError, match="wrong direction"):
        wire.Codec(SECRET, me="stage0", run="r1").decode(to_driver)  # a stage's frame replayed to a stage
    driver = wire.Codec(SECRET, me="driver", run="r1")
    assert driver.decode(to_driver).mb_id == 7 and driver.last_sender == "stage1"
    launch = driver.encode(wire.Stop())  # to every stage
    assert wire.Codec(SECRET, me="stage0", run="r1").decode(launch) == wire.Stop()
    with pytest.raises(wire.WireError, match="wrong direction"):
        wire.Codec(SECRET, me="driver", run="r1").decode(launch)  # reflected back to a driver
    with pytest.raises(wire.WireError, match="another run"):  # a hello of no run only where allowed
        driver.decode(wire.Codec(SECRET, me="stage0").encode(wire.Hello(0, "h", 1)))
    external = wire.Codec(SECRET, me="driver", run="r1", unbound=(wire.Hello,))
    assert external.decode(wire.Codec(SECRET, me="stage0").encode(wire.Hello(0, "h", 1))).stage == 0
    learner = wire.Codec(SECRET, me="stage0")  # an external stage learns its run from the driver
    learner.decode(driver.encode(wire.Stop()))
    assert learner.run == "r1"


def _dealer(ctx, addr: str, identity: bytes | None = None):
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(addr)
    return sock


def _recv(ctl, timeout_s: float = 30.0, until=None):
    """The next authentic message on `ctl` (None when `until()` became true first)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = ctl.recv()
        if msg is not None:
            return msg
        if until is not None and until():
            return None
        ctl.sock.poll(100)
    raise AssertionError("nothing arrived")


def test_a_squatter_cannot_take_a_stage_identity_and_big_frames_are_refused():
    """A local process connecting first as `stage1` (ZeroMQ identity) took the stage's place;
    unauthenticated 700 MB frames were buffered whole (driver 249 MB -> 3.6 GB) (issue 25, item 3)."""
    import zmq

    from engine.torch_exec.driver.control import MAX_FRAME_BYTES, ControlSocket

    ctl = ControlSocket(wire.Codec(SECRET, me="driver", run="r1"), "127.0.0.1")
    ctx = zmq.Context()
    try:
        squatter = _dealer(ctx, ctl.address, b"stage1")
        squatter.send(b"x" * (MAX_FRAME_BYTES + 1))  # refused from its header, never delivered
        real = _dealer(ctx, ctl.address)
        stage = wire.Codec(SECRET, me="stage1", run="r1")
        real.send(stage.encode(wire.Hello(1, "h", 1)))
        assert _recv(ctl) == wire.Hello(1, "h", 1)
        assert ctl.dropped == 0  # the big frame was not even read
        ctl.send("stage1", wire.Ping())
        assert real.poll(30000) and stage.decode(real.recv()) == wire.Ping()  # the real stage got it
        other = _dealer(ctx, ctl.address)
        other.send(stage.encode(wire.Pong(1, 1.0)))  # an authentic frame of stage 1's from elsewhere
        assert _recv(ctl, until=lambda: ctl.dropped == 1) is None  # dropped: stage1 speaks from `real`
        real.send(stage.encode(wire.Pong(1, 2.0)))
        assert _recv(ctl) == wire.Pong(1, 2.0)
    finally:
        ctx.destroy(linger=0)
        ctl.close()


def test_codec_rejects_unexpected_type_and_malformed_signed_body():
    codec = wire.Codec(SECRET)
    with pytest.raises(wire.WireError, match="unexpected"):
        codec.decode(codec.encode(wire.Ping()), expect=wire.Launch)
    body = b"\xc1\xc1"  # never-used msgpack byte
    with pytest.raises(wire.WireError, match="malformed"):
        codec.decode(codec._mac(body) + body)


def test_external_secret_comes_from_env_or_file(tmp_path):
    key = os.urandom(32)
    assert wire.secret_from_env({wire.SECRET_ENV: key.hex()}) == key
    f = tmp_path / "secret"
    f.write_text(key.hex() + "\n")
    assert wire.secret_from_env({wire.SECRET_FILE_ENV: str(f)}) == key
    assert wire.secret_from_env({}) is None
    with pytest.raises(ValueError):
        wire.secret_from_env({wire.SECRET_ENV: "abcd"})


def test_binding_off_loopback_warns_with_the_port(caplog):
    pytest.importorskip("zmq")
    from engine.torch_exec.driver.control import ControlSocket

    codec = wire.Codec(SECRET)
    with caplog.at_level("WARNING", logger="engine.torch_exec.wire.addresses"):
        quiet = ControlSocket(codec, "127.0.0.1")
        assert quiet.address.startswith("tcp://127.0.0.1:") and not caplog.records
        loud = ControlSocket(codec, "0.0.0.0")
    quiet.close()
    loud.close()
    assert len(caplog.records) == 1 and f"0.0.0.0:{loud.port}" in caplog.records[0].getMessage()


# --- the engine ---------------------------------------------------------------------------------------------
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
psutil = pytest.importorskip("psutil")

import engine.torch_exec  # noqa: E402,F401
import policies  # noqa: E402,F401
from engine.core.controller import Controller  # noqa: E402
from engine.core.executor import EXECUTORS, ExecutorBuild  # noqa: E402
from engine.core.kv import BlockManager  # noqa: E402
from engine.pricing.models import get_model  # noqa: E402
from engine.core.policy import POLICIES, RuntimeFeatures  # noqa: E402
from engine.core.trace import Tracer  # noqa: E402
from engine.torch_exec.weights.checkpoint import random_checkpoint  # noqa: E402
from engine.torch_exec.settings import TorchSettings  # noqa: E402
from signal_helpers import WAIT_S  # noqa: E402
from test_torch_engine import _alive, _hf_greedy, _requests  # noqa: E402


@pytest.fixture(scope="module")
def model_cache(model_cache):  # conftest's folder, with tiny-llama built
    random_checkpoint(get_model("tiny-llama"), 0, model_cache)
    return model_cache


def _run(requests, cache, progress, *, pp=2, runtime=RuntimeFeatures(), **settings):
    from engine.base.settings import Link
    from testbed.config.spec import compose_spec
    from testbed.run.runner import build_cost_model

    run = compose_spec(["model=tiny-llama", f"parallel.pp={pp}", "hardware=l20-48g"])
    cost = build_cost_model(run)
    pol = POLICIES.get("sarathi").from_config({"token_budget": 16, "max_num_seqs": 8})
    ex = EXECUTORS.get("torch").factory(TorchSettings(model_cache_dir=cache, **settings),
                                        ExecutorBuild(cost, runtime, Link(1e9, 0.0), pol, Tracer(), run.settings))
    ctrl = Controller(requests, pol, ex, BlockManager(64, 4), cost_model=cost, progress=lambda d, t: progress(ex))
    try:
        ctrl.run()
    finally:
        ex.shutdown()
    return ctrl, ex


ATTACKER = textwrap.dedent("""
    import os, pickle, sys, zmq
    sys.path.insert(0, os.getcwd())
    from engine.torch_exec.wire import messages as wire

    class Touch:
        def __reduce__(self):
            return (os.system, ("touch " + sys.argv[2],))

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 5000)
    s.connect(sys.argv[1])
    s.send(pickle.dumps(Touch()))                                        # (a) code in a pickle
    s.send(os.urandom(300))                                              # (b) garbage
    s.send(wire.Codec(os.urandom(32)).encode(wire.Done(1, 0, [1], [])))  # (c) typed, wrong secret
    s.close()
    ctx.term()
    print("SENT", flush=True)
""")


def test_hostile_frames_on_the_control_port_are_dropped(model_cache, tmp_path):
    target = tmp_path / "pwned"
    attacked = []

    def attack(ex):
        if not attacked:
            attacked.append(subprocess.run([sys.executable, "-c", ATTACKER, ex._ctl.address, str(target)],
                                           capture_output=True, text=True, timeout=60, cwd=os.getcwd()))

    requests = _requests()
    ctrl, ex = _run(requests, model_cache, attack)
    assert attacked and "SENT" in attacked[0].stdout, attacked and attacked[0].stderr
    assert ctrl.num_finished == len(requests)
    ref = _hf_greedy(random_checkpoint(get_model("tiny-llama"), 0, model_cache), requests)
    for r in requests:
        assert ctrl.sequences[r.request_id].output_token_ids == ref[r.request_id]
    assert not target.exists(), "the pickle ran code in the driver"
    assert ex.dropped_frames == 3


def _listening(pids) -> dict[tuple[int, str], set]:
    out: dict = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                out.setdefault((pid, p.name()), set()).add(c.laddr.ip)
    return out


def test_a_torch_run_listens_only_on_loopback(model_cache):
    """Driver, both stages (torch.distributed store, gloo) and the CPU samplers' channel."""
    seen: dict = {}
    # the session's service fixtures (PostgreSQL, mlflow server, a Ray cluster) are children of
    # this process too: only what the run itself starts counts
    before = {c.pid for c in psutil.Process().children(recursive=True)}

    def inspect(ex):
        if not seen:
            me = psutil.Process()
            pids = [me.pid] + [c.pid for c in me.children(recursive=True) if c.pid not in before]
            seen.update(_listening(pids))

    _run(_requests()[:3], model_cache, inspect, runtime=RuntimeFeatures(cpu_sampling=True))
    assert len(seen) >= 3, seen  # the driver and both stages listen on something
    addrs = {a for v in seen.values() for a in v}
    assert addrs and all(a.startswith("127.") or a == "::1" for a in addrs), seen


DRIVER = textwrap.dedent("""
    import os, sys, threading, time, psutil
    sys.path.insert(0, os.getcwd())
    import engine.torch_exec
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    def announce():  # once the stages' fork server, both stages and both CPU samplers are up
        while True:
            kids = [p for p in psutil.Process().children(recursive=True)
                    if "resource_tracker" not in " ".join(p.cmdline())]
            if len(kids) >= 5:
                time.sleep(1.0)
                print("PIDS", *[p.pid for p in kids], flush=True)
                return
            time.sleep(0.2)

    if __name__ == "__main__":
        threading.Thread(target=announce, daemon=True).start()
        cfg = compose_spec(["executor=torch", "model=tiny-llama", "parallel.pp=2", "runtime.cpu_sampling=true",
            "workload=synthetic", "workload.num_requests=4", "workload.arrival=offline",
            "workload.input_mean=16", "workload.output_mean=2000", "kv.num_blocks=1024",
            "executor.num_cpu_samplers=2", "executor.model_cache_dir=%s", "output.dir=%s"])
        run_experiment(cfg)
""")


def test_stages_and_samplers_exit_when_the_driver_is_killed(model_cache, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER % (model_cache, tmp_path))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=os.getcwd())
    pids, seen = [], []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("PIDS"):
            pids = [int(x) for x in line.split()[1:]]
            break
    assert len(pids) == 5, "expected the fork server, 2 stages and 2 samplers: " + "".join(seen[-20:])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(WAIT_S)
    deadline = time.time() + WAIT_S  # liveness bound, not a speed assertion (20 s once)
    alive = pids
    while alive and time.time() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.2)
    for p in alive:  # do not leak them into the rest of the suite
        os.kill(p, signal.SIGKILL)
    assert not alive, f"orphans after the driver was killed: {alive}"
