"""Typed, authenticated messages between the driver, the stages and the CPU samplers.

Every frame on a socket of the torch engine (the driver's ZeroMQ ROUTER, a stage's DEALER, the
last stage's sampler channel, the metadata blob on the torch.distributed data plane) is

    HMAC-SHA256(secret, body) [32 bytes] || body,
    body = msgpack [tag, {field: value}, [run, sender, receiver, counter]]

The receiver checks the MAC first (`hmac.compare_digest`) and only then parses the body, with
msgpack (which builds only None, bools, numbers, str, bytes, lists and dicts -- never an arbitrary
object, unlike pickle). The tag names one frozen dataclass below; the field names must be exactly
the dataclass's fields and every value is checked against its annotation (wire/schema.py). Anything else -- a
short frame, a wrong MAC, malformed msgpack, an unknown tag, a missing/extra field, a wrong type --
raises `WireError`, and the receiver drops the frame (the driver counts them in
`TorchExecutor.dropped_frames`).

Binding: the MAC also covers the run, the sender (`driver`, `stage<i>`, `sampler<k>`), the
receiver (a name or the group `stages`/`samplers`: the direction) and the sender's counter, so a
frame cannot be replayed, redirected or reused in another run (engine/torch_exec/wire/binding.py).
External stages learn the run from the driver's first frame; the driver takes a run-less frame
only for their `hello`, and binds each sender name to one connection (driver/control.py).

The secret: 32 random bytes from `secrets.token_bytes`, made by the driver for each run and given
to spawned stages as a spawn argument (never over a socket). External stages
(`executor.launch=external`) and their driver read it from the environment variable
`TESTBED_STAGE_SECRET` (64 hex digits, e.g. `python -c "import secrets; print(secrets.token_hex(32))"`),
or from the file named by `TESTBED_STAGE_SECRET_FILE` (the same hex text; keep it mode 0600).

Tensors never travel inside a message: a message says dtype and shape, and the raw bytes follow
(a second ZeroMQ frame of the same multipart message, or a torch.distributed tensor).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import msgpack

from engine.torch_exec.wire.binding import (REPLAY_WINDOW, SECRET_BYTES, SECRET_ENV,  # noqa: F401 (re-exported)
                                       SECRET_FILE_ENV, Window, WireError, check_binding, new_run_id,
                                       new_secret, receiver_names, secret_from_env)
from engine.torch_exec.wire.schema import record_checker

MAC_BYTES = 32


# --- rows inside messages (tuples on the wire; stages index them like tuples) -----------------------
class PrefillMeta(NamedTuple):
    """A launched prefill chunk: `blocks` replace its table from `table_from` on (tables.py)."""
    seq_id: int
    start: int
    num_tokens: int
    samples: bool
    table_from: int
    blocks: list[int]
    token_ids: list[int]


class DecodeMeta(NamedTuple):
    """A launched decode; its table as a delta, as in `PrefillMeta` (usually no block at all)."""
    seq_id: int
    position: int
    table_from: int
    blocks: list[int]
    token_id: int


class PrefillChunk(NamedTuple):
    """A prefill chunk as a stage's model reads it (`StageModel.prepare`): whole block table."""
    seq_id: int
    start: int
    num_tokens: int
    samples: bool
    block_table: list[int]
    token_ids: list[int]


class DecodeRow(NamedTuple):
    """A decode as a stage's model reads it: whole block table."""
    seq_id: int
    position: int
    block_table: list[int]
    token_id: int


class RequestSampling(NamedTuple):
    """A served request's own sampling (engine/core/request.py `SamplingParams.as_tuple`)."""

    seq_id: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float


def sampling_params(rows: list[RequestSampling]) -> dict[int, tuple]:
    """{seq id: SamplingParams.as_tuple()} for `Sampler.set_params`."""
    return {r.seq_id: tuple(r[1:]) for r in rows}


class SpanRec(NamedTuple):
    name: str
    start: float
    end: float
    busy: bool


class LinkSpan(NamedTuple):
    name: str
    start: float
    end: float
    mb_id: int


class SampleKey(NamedTuple):
    seq_id: int
    position: int


class PrefillTokens(NamedTuple):
    seq_id: int
    start: int
    token_ids: list[int]


# --- messages ---------------------------------------------------------------------------------------
MESSAGES: dict[str, type] = {}
_DECODERS: dict[type, Callable[[dict], Any]] = {}


def message(tag: str):
    """Register a frozen dataclass as the message `tag` (its decoder is built on first use)."""

    def wrap(cls):
        if tag in MESSAGES:
            raise ValueError(f"duplicate message tag {tag!r}")
        cls._wire_tag = tag
        MESSAGES[tag] = cls
        return cls

    return wrap


@dataclass(frozen=True)
class SamplerConfig:
    """Sampling settings of the last stage and of each CPU sampler (`Sampler`'s keyword arguments)."""

    method: str
    temperature: float
    top_k: int
    top_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@message("hello")
@dataclass(frozen=True)
class Hello:
    stage: int
    host: str
    pid: int


@message("init")
@dataclass(frozen=True)
class StageInit:
    """Everything a stage needs, sent once by the driver after every stage said hello."""

    pp: int
    path: str  # the checkpoint directory; "" = random weights built in memory from `model_seed` (CUDA)
    arch: dict[str, Any]  # the ModelSpec's fields (engine/pricing/models.py)
    layers: list[tuple[int, int]]  # per stage: (first layer, number of layers)
    num_blocks: int  # 0 = measure: probe memory (KvProbe) and wait for the driver's KvPool
    block_size: int
    dtype: str
    device: str
    threads: int
    backend: str
    master_addr: str
    master_port: int
    stage_timeout_s: float
    fault: str
    sampling: SamplerConfig
    num_cpu_samplers: int
    cpu_sampling: bool
    overlap_input_prep: bool
    structure_aware_transfer: bool
    link_bandwidth_Bps: float | None
    link_latency_s: float
    link_chunk_bytes: int
    driver_addr: str
    policy_class: str  # "module:qualname" of the run's policy (schedule_transfer), "" = the default
    policy_params: dict[str, Any]
    model_seed: int = 0  # random weights when `path` is ""
    profile_tokens: int = 0  # the warm-up micro-batch (when num_blocks is 0), the piecewise graphs' budget
    attention: str = "auto"  # executor.attention: auto | torch | triton
    cuda_graphs: bool = True  # executor.cuda_graphs
    socket_ifname: str = ""  # executor.socket_ifname: GLOO_/NCCL_SOCKET_IFNAME unless the stage host sets them


@message("kv_probe")
@dataclass(frozen=True)
class KvProbe:
    """A stage's measured memory after loading its weights and a warm-up forward at the run's
    largest micro-batch (engine/torch_exec/shared/kv_sizing.py `StageMemory`)."""

    stage: int
    device_key: str
    total_bytes: int
    free_bytes: int
    peak_bytes: int
    resident_bytes: int
    block_bytes: int


@message("kv_pool")
@dataclass(frozen=True)
class KvPool:
    """The driver's answer to the probes: allocate `num_blocks` (0 = measure free memory again,
    now that every stage has loaded)."""

    num_blocks: int


@message("ready")
@dataclass(frozen=True)
class Ready:
    """A stage is set up. `runtime_s` / `runtime_mib`: the runtime's set-up alone (on CUDA the capture of
    every CUDA graph) and the device memory it reserved (0 on CPU), so a run records what capture costs."""

    stage: int
    pid: int
    device: str
    load_s: float
    init_s: float
    runtime_s: float = 0.0
    runtime_mib: float = 0.0


@message("ping")
@dataclass(frozen=True)
class Ping:
    pass


@message("pong")
@dataclass(frozen=True)
class Pong:
    stage: int
    clock: float


@message("stop")
@dataclass(frozen=True)
class Stop:
    pass


@message("mb")
@dataclass(frozen=True)
class Launch:
    """One micro-batch's metadata, the same for every stage; block tables as deltas (tables.py: a
    steady decode of 256 x 2,048 is a 2.6 kB frame, checked in 1.4 ms, instead of 101 kB, 19.5 ms)."""

    mb_id: int
    kind: str
    prefills: list[PrefillMeta]
    decodes: list[DecodeMeta]
    sampling: list[RequestSampling]  # served requests' own sampling (usually empty)
    released: list[int]  # sequences whose tables the stages drop, before this launch's rows apply


@message("spans")
@dataclass(frozen=True)
class Spans:
    stage: int
    mb_id: int
    spans: list[SpanRec]


@message("done")
@dataclass(frozen=True)
class Done:
    """The last stage's sampled token ids for a micro-batch (inline sampling)."""

    stage: int
    mb_id: int
    tokens: list[int]
    spans: list[SpanRec]


@message("link")
@dataclass(frozen=True)
class LinkEvents:
    """Queueing/transfer spans of stage `stage`'s out-link; `moved_bytes` (total sent so far, paced)
    tells the driver's hang check that a slow link is still moving bytes."""

    stage: int
    events: list[LinkSpan]
    moved_bytes: int


REPORTED_EXIT = 70  # exit code of a stage that sent its `StageError` (EX_SOFTWARE): not a silent death


@message("error")
@dataclass(frozen=True)
class StageError:
    stage: int
    text: str
    clock: float  # when it happened, on the stage's perf_counter (which failed first)


@message("sampled")
@dataclass(frozen=True)
class Sampled:
    """One CPU sampler's share of a micro-batch: token ids of rows `rows` of the `num_parts` parts."""

    sampler: int
    mb_id: int
    num_parts: int
    rows: list[int]
    tokens: list[int]
    start: float
    end: float


@message("sampler_hello")
@dataclass(frozen=True)
class SamplerHello:
    sampler: int
    pid: int


@message("sample")
@dataclass(frozen=True)
class SampleJob:
    """A CPU sampler's rows of a micro-batch; the logits' raw bytes follow in the next frame."""

    mb_id: int
    num_parts: int
    rows: list[int]  # row indices in the micro-batch's sampled rows
    keys: list[SampleKey]
    prefills: list[PrefillTokens]
    dtype: str
    shape: list[int]
    sampling: list[RequestSampling]  # served requests' own sampling among these rows


@message("tensor_meta")
@dataclass(frozen=True)
class TensorMeta:
    """The shape/dtype blob of a vLLM-style tensor-dict send on the data plane."""

    shape: list[int]
    dtype: str


def _decoder(cls):
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = record_checker(cls)
    return dec


def _to_plain(msg) -> dict:
    out = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return out


# --- the codec ------------------------------------------------------------------------------------------
class Codec:
    """Encode/decode messages under one run's secret, as `me` in run `run`.

    `run` "" (an external stage before the driver's first frame) adopts the run of the first
    authentic frame; `unbound` names the message types accepted without a run (the driver's
    `Hello` from external stages)."""

    def __init__(self, secret: bytes, me: str = "peer", run: str = "", unbound: tuple[type, ...] = ()) -> None:
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the wire secret must be at least 16 bytes")
        self._secret = secret
        self.me, self.run, self.unbound = me, run, unbound
        self._names = receiver_names(me)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self._windows: dict[str, Window] = {}
        self.last_sender: str | None = None

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    def _default_to(self) -> str:
        return {"driver": "stages", "peer": "peer"}.get(self.me, "driver")

    def encode(self, msg, to: str | None = None) -> bytes:
        """`msg` signed from `me` to `to` (default: the driver's peers are the stages, everyone
        else's the driver)."""
        tag = getattr(type(msg), "_wire_tag", None)
        if tag is None:
            raise TypeError(f"{type(msg).__name__} is not a wire message")
        with self._lock:
            n = next(self._counter)
        body = msgpack.packb([tag, _to_plain(msg), [self.run, self.me, to or self._default_to(), n]],
                             use_bin_type=True)
        return self._mac(body) + body

    def decode(self, frame: bytes, expect: type | tuple[type, ...] | None = None):
        """The message in `frame`: the MAC first, then the binding, then the schema; raises WireError."""
        if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) <= MAC_BYTES:
            raise WireError("frame too short to carry a MAC")
        frame = bytes(frame)
        mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body)):
            raise WireError("bad MAC (not signed with this run's secret)")
        try:
            obj = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several types; all mean "malformed"
            raise WireError(f"malformed msgpack: {type(exc).__name__}") from None
        if type(obj) is not list or len(obj) != 3 or type(obj[0]) is not str:
            raise WireError("a message is [tag, fields, binding]")
        cls = MESSAGES.get(obj[0])
        if cls is None:
            raise WireError(f"unknown message tag {obj[0][:40]!r}")
        run, sender, n = check_binding(obj[2], self._names, self.run, self.me,
                                       run_optional=issubclass(cls, self.unbound))
        msg = _decoder(cls)(obj[1], obj[0])
        if expect is not None and not isinstance(msg, expect):
            raise WireError(f"unexpected message {obj[0]!r} here")
        with self._lock:
            window = self._windows.setdefault(sender, Window())
            if not window.fresh(n):
                raise WireError(f"replayed frame (counter {n} from {sender!r} already seen)")
            window.add(n)
            if not self.run and run:
                self.run = run  # an external stage learns its run from the driver's first frame
        self.last_sender = sender
        return msg
