"""A finished real run, read back: its config, requests, micro-batches and per-stage spans.

`testbed calibrate runs` fits a hardware profile from these and `testbed validate --runs` replays
them in the simulator, so nothing here runs the engine again. A run directory is what
`testbed run executor=torch` writes (docs/run-outputs.md#what-a-run-leaves-behind):
`config.yaml`, `requests.csv`, `microbatches.csv`, `summary.json` and, for a fit,
`trace.json` written with `output.trace=full` (every micro-batch's spans; a sampled trace keeps
one micro-batch in ten, which would fit the sampled ones only and is refused).

The micro-batches' shapes are not in the tables (a row has token counts, not each sequence's
context), so they are rebuilt by replaying the run's controller and policy on its own requests
with an executor that completes every micro-batch at its recorded time (`ReplayExecutor`): the
policy sees the same state at the same clock and forms the same micro-batches; each one is checked
against the recorded row (kind, prefill tokens, decodes) and a divergence is an error, never
silently fitted.
"""
from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from engine.core.batch import MicroBatch
from engine.core.controller import Controller
from engine.pricing.costmodel import BatchShape
from engine.base.errors import ConfigError
from engine.core.executor import Completion, Executor
from engine.core.kv import BlockManager
from engine.core.policy import PrepareContext
from engine.core.request import Request
from engine.core.trace import Tracer
from testbed.calibrate import run_checks as checks
from testbed.config.spec import RunSpec

RUN_FILES = ("config.yaml", "requests.csv", "microbatches.csv", "summary.json")
REQUEST_COLUMNS = ("request_id", "arrival_s", "prompt_len", "output_len", "output_token_ids")
# Span names the stages record (engine/torch_exec/stage/worker.py); forward spans are "forward:<kind>".
STAGE_SPANS = ("prepare", "forward", "sample", "send", "recv", "wait", "to_samplers")


@dataclass(frozen=True)
class StageSpans:
    """What one stage did for one micro-batch, in seconds on the run's clock (None: not recorded)."""

    prepare_start: float | None
    prepare: float | None
    forward: float | None
    sample_end: float | None
    sample: float | None
    send_start: float | None
    recv_start: float | None
    recv_end: float | None
    busy_end: float | None  # when the stage was done with this micro-batch (its last span but waits)
    handoff: float | None = None  # runtime.cpu_sampling: the last stage sending its logits to the samplers


@dataclass(frozen=True)
class ReplayedBatch:
    """One recorded micro-batch with its shape rebuilt and its spans per stage."""

    mb_id: int
    kind: str
    shape: BatchShape
    scheduled_s: float
    completed_s: float
    after_completion_s: float | None  # the completion this launch followed (None: not right after one)
    stages: tuple[StageSpans, ...]


@dataclass
class RealRun:
    """A real run directory read back (module docstring)."""

    path: Path
    spec: RunSpec
    requests: list[Request]
    microbatches: pd.DataFrame
    summary: dict
    spans: dict[tuple[int, int], dict[str, tuple[float, float]]] | None  # (mb, stage) -> name -> (start, dur)
    # what the replay found, kept: a fit, a validate and its stall check each ask for it
    _kv_blocks: int | None = field(default=None, repr=False)
    _shapes: dict | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        return self.path.name

    @property
    def pp(self) -> int:
        return self.spec.settings.parallel.pp


def load_run(path: str | Path, need_trace: bool = False) -> RealRun:
    """Read a run directory; one clear ConfigError for anything missing or not a real run."""
    import yaml

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"run directory {path} does not exist")
    missing = [f for f in RUN_FILES if not (path / f).is_file()]
    if missing:
        raise ConfigError(f"run directory {path} lacks {', '.join(missing)}: not a finished `testbed run`")
    try:
        tree = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8"))
        summary = json.loads((path / "summary.json").read_text(encoding="utf-8"))
        mbs = pd.read_csv(path / "microbatches.csv")
        reqs = pd.read_csv(path / "requests.csv", usecols=lambda c: c in REQUEST_COLUMNS, dtype={"output_token_ids": str})
    except (OSError, ValueError, yaml.YAMLError, pd.errors.ParserError) as exc:
        raise ConfigError(f"cannot read run {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    checks.check_microbatches(path / "microbatches.csv", mbs)
    checks.check_requests(path / "requests.csv", reqs)
    checks.check_summary(path, summary, reqs, mbs)
    if not isinstance(tree, dict):
        checks.check_config(path, tree, None, reqs)
    spec = RunSpec.from_tree(tree)
    if spec.settings.executor.name != "torch":
        raise ConfigError(f"run {path} ran executor={spec.settings.executor.name}: calibrate from real "
                          "(executor=torch) runs")
    checks.check_real(path, reqs)
    checks.check_config(path, tree, spec, reqs)
    requests = with_prompt_texts(spec, [Request(int(r.request_id), float(r.arrival_s), int(r.prompt_len),
                                                int(r.output_len)) for r in reqs.itertuples()])
    spans = read_spans(path / "trace.json", len(mbs)) if (path / "trace.json").is_file() else None
    if need_trace and spans is None:
        raise ConfigError(f"run {path} has no trace.json: rerun it with output.trace=full")
    return RealRun(path, spec, requests, mbs, summary, spans)


def with_prompt_texts(spec: RunSpec, requests: list[Request]) -> list[Request]:
    """The run's requests rebuilt from its workload where the data directory has it and they are
    the same (id, arrival, lengths): they carry the prompts' text, which requests.csv does not, and
    TD-Pipe's predictor finds its training set by them. Without it a ShareGPT replay trained on the
    run's own requests (warned: leaks) where the engine had trained on the data set minus the run."""
    from engine.base.errors import TestbedError
    from workloads.base import build_workload

    try:
        built = build_workload(spec.workload, spec.data_dir)
    except (TestbedError, OSError, ValueError):
        return requests
    same = len(built) == len(requests) and all(
        (a.request_id, a.prompt_len, a.output_len) == (b.request_id, b.prompt_len, b.output_len)
        and abs(a.arrival_s - b.arrival_s) < 1e-6 for a, b in zip(built, requests))
    return [Request(b.request_id, b.arrival_s, b.prompt_len, b.output_len, a.prompt_text)
            for a, b in zip(built, requests)] if same else requests


def read_spans(path: Path, num_mbs: int) -> dict[tuple[int, int], dict[str, tuple[float, float]]]:
    """(mb, stage) -> span name -> (start s, duration s) from a Perfetto trace the run wrote.
    A trace that lacks micro-batches (sampled, or spans dropped) is refused."""
    try:
        events = json.loads(path.read_text(encoding="utf-8"))["traceEvents"]
        names = {e["tid"]: str(e["args"]["name"]) for e in events
                 if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read trace {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    stage_of = {tid: int(n[5:]) for tid, n in names.items() if n.startswith("stage") and n[5:].isdigit()}
    out: dict[tuple[int, int], dict[str, tuple[float, float]]] = {}
    for i, e in enumerate(events):
        span = checks.check_span(path, i, e) if isinstance(e, dict) and e.get("tid") in stage_of else None
        if span is None:
            continue
        mb, name, ts, dur = span
        name = name.split(":")[0]
        if name in STAGE_SPANS:
            out.setdefault((mb, stage_of[e["tid"]]), {})[name] = (ts / 1e6, dur / 1e6)
    covered = {mb for mb, _ in out}
    if len(covered) < num_mbs:
        raise ConfigError(f"trace {path} has spans of {len(covered)} of {num_mbs} micro-batches: "
                          "rerun with output.trace=full")
    return out


class _FirstLaunch(Exception):
    """Ends a replay after its first launch (`infer_kv_blocks`)."""


class ReplayDiverged(ConfigError):
    """The replayed controller formed another micro-batch than the run recorded."""

    def __init__(self, message: str, mb_id: int | None = None) -> None:
        super().__init__(message)
        self.mb_id = mb_id


# Arrivals that landed inside the controller's own step, each costing one more replay (the
# H100 Azure run at 8 req/s, 1,702 micro-batches: see tests/test_calibrate_runs.py).
MAX_REPLAY_FLIPS = 64


class ReplayExecutor(Executor):
    """Completes each micro-batch at the time the real run recorded; the clock reads the real
    controller's decision times, so the policy decides on the same state it saw then.

    `now()` moves to the next launch's recorded time when that comes before the next recorded
    completion: the real controller committed it then, after its own step. When it admitted
    arrivals inside that step is not recorded: by default at the commit's time, and for the
    micro-batches in `admit_at_event` at the completion's (or deadline's) time; `replay_shapes`
    flips a micro-batch whose replay diverged and replays again."""

    def __init__(self, pp: int, recorded: pd.DataFrame, stop_after: int | None = None,
                 admit_at_event: frozenset[int] = frozenset()) -> None:
        self.pipeline_depth = pp
        self._admit_at_event = admit_at_event
        self._stop_after = stop_after
        self.tracer = Tracer()
        self._rows = recorded.set_index("mb_id")
        self._scheduled = self._rows["scheduled_s"].to_dict()
        self._completed = self._rows["completed_s"].to_dict()
        self._heap: list[tuple[float, int]] = []
        self._clock = 0.0
        self._launched = 0
        self._fresh_event = False
        self.shapes: dict[int, BatchShape] = {}
        self.last_completion: float | None = None
        self.after_completion: dict[int, float | None] = {}

    def now(self) -> float:
        if self._fresh_event:
            self._fresh_event = False
            if self._launched in self._admit_at_event:
                return self._clock
        nxt = self._scheduled.get(self._launched)
        if nxt is not None and nxt > self._clock and (not self._heap or nxt <= self._heap[0][0]):
            self._clock = nxt
        return self._clock

    def wait_until(self, t: float) -> None:
        self._clock = max(self._clock, t)
        self.last_completion = None
        self._fresh_event = True

    def launch(self, mb: MicroBatch) -> None:
        if mb.mb_id not in self._completed:
            raise ReplayDiverged(f"the replay formed micro-batch {mb.mb_id}, the run recorded only "
                                 f"{len(self._completed)}")
        row = self._rows.loc[mb.mb_id]
        got = (mb.kind, mb.num_prefill_tokens, len(mb.decodes))
        want = (str(row["kind"]), int(row["num_prefill_tokens"]), int(row["num_decode_seqs"]))
        if got != want:
            raise ReplayDiverged(f"the replay diverged at micro-batch {mb.mb_id}: it formed kind={got[0]}, "
                                 f"{got[1]} prefill tokens, {got[2]} decodes; the run recorded kind={want[0]}, "
                                 f"{want[1]}, {want[2]}", mb.mb_id)
        self.shapes[mb.mb_id] = mb.shape
        self.after_completion[mb.mb_id] = self.last_completion
        self._launched += 1
        if self._launched == self._stop_after:
            raise _FirstLaunch
        heapq.heappush(self._heap, (self._completed[mb.mb_id], mb.mb_id))

    def next_completion(self, deadline: float | None = None) -> Completion | None:
        if not self._heap or (deadline is not None and self._heap[0][0] > deadline and not self._completes_first()):
            if deadline is not None:
                self._clock = max(self._clock, deadline)
                self.last_completion = None
                self._fresh_event = True
            return None
        t, mb_id = heapq.heappop(self._heap)
        self._clock = max(self._clock, t)
        self.last_completion = t
        self._fresh_event = True
        return Completion(mb_id, t)

    def _completes_first(self) -> bool:
        """Whether the real controller took the next completion before its next launch: then a
        deadline (an arrival) that passes before that completion launched nothing. Without it, an
        arrival 0.26 ms before a completion (tiny-llama P=2 on CPU, Azure at 1.2 req/s) made the
        replay launch its prefill alone where the run waited and added the finished decode."""
        nxt = self._scheduled.get(self._launched)
        return nxt is not None and self._heap[0][0] <= nxt


def replay_shapes(run: RealRun) -> dict[int, tuple[BatchShape, float | None]]:
    """mb_id -> (its shape, the completion time its launch followed), by replaying the run's
    controller (module docstring). Raises ReplayDiverged when the policy forms other batches."""
    from testbed.run.runner import build_cost_model, link_settings
    from workloads.history import history_for_run

    if run._shapes is not None:
        return run._shapes
    spec = run.spec
    cost = build_cost_model(spec)
    link = link_settings(spec.settings, cost)
    blocks = kv_num_blocks(run)
    flipped: set[int] = set()
    while True:
        policy = _prepared_policy(run)
        ex = ReplayExecutor(cost.pp, run.microbatches, admit_at_event=frozenset(flipped))
        ctrl = Controller(list(run.requests), policy, ex, BlockManager(blocks, spec.settings.kv.block_size),
                          cost_model=cost, data_dir=spec.data_dir,
                          num_microbatches=spec.settings.parallel.num_microbatches, link_bandwidth_Bps=link.bandwidth_Bps,
                          link_latency_s=link.latency_s, history=history_for_run)
        try:
            ctrl.run()
            break
        except ReplayDiverged as exc:
            if exc.mb_id is None or exc.mb_id in flipped or len(flipped) >= MAX_REPLAY_FLIPS:
                raise
            flipped.add(exc.mb_id)
    if len(ex.shapes) != len(run.microbatches):
        raise ReplayDiverged(f"the replay formed {len(ex.shapes)} micro-batches, the run recorded "
                             f"{len(run.microbatches)}")
    run._shapes = {mb: (shape, ex.after_completion[mb]) for mb, shape in ex.shapes.items()}
    return run._shapes


def _prepared_policy(run: RealRun):
    """The run's policy, prepared as for a run (a replay needs no short simulations)."""
    from testbed.run.runner import build_policy

    policy = build_policy(run.spec)
    policy.prepare(PrepareContext(run.pp, lambda params, n: None))
    return policy


def kv_num_blocks(run: RealRun) -> int:
    """The run's KV pool: `kv.num_blocks` as configured, else inferred (once per run)."""
    if run._kv_blocks is None:
        run._kv_blocks = run.spec.settings.kv.num_blocks or infer_kv_blocks(run)
    return run._kv_blocks


def infer_kv_blocks(run: RealRun) -> int:
    """The KV pool a run measured (CUDA sizes it from free memory; the tables record only its
    usage): the blocks the first micro-batch holds, replayed on a pool too big to matter, over the
    usage the run recorded after it."""
    from testbed.run.runner import build_cost_model, link_settings

    usage = float(run.microbatches["kv_usage"].iloc[0])
    if not usage > 0:
        raise ConfigError(f"run {run.path}: cannot infer its KV pool size from microbatches.csv; pass kv.num_blocks=")
    policy = _prepared_policy(run)
    block = run.spec.settings.kv.block_size
    kv = BlockManager(sum(-(-(r.prompt_len + r.output_len) // block) for r in run.requests) + 1, block)
    ex = ReplayExecutor(run.pp, run.microbatches, stop_after=1)
    cost = build_cost_model(run.spec)
    link = link_settings(run.spec.settings, cost)  # MoLink counts its micro-batches from the link (as the run did)
    try:
        Controller(list(run.requests), policy, ex, kv, cost_model=cost, link_bandwidth_Bps=link.bandwidth_Bps,
                   link_latency_s=link.latency_s).run()
    except _FirstLaunch:
        pass
    return int(round(kv.num_used / usage))


def replayed_batches(run: RealRun) -> list[ReplayedBatch]:
    """Every micro-batch of a traced run with its rebuilt shape and its spans per stage."""
    if run.spans is None:
        raise ConfigError(f"run {run.path} has no trace.json: rerun it with output.trace=full")
    shapes = replay_shapes(run)
    out = []
    for row in run.microbatches.itertuples():
        shape, after = shapes[int(row.mb_id)]
        stages = tuple(_stage_spans(run.spans.get((int(row.mb_id), s), {})) for s in range(run.pp))
        out.append(ReplayedBatch(int(row.mb_id), str(row.kind), shape, float(row.scheduled_s),
                                 float(row.completed_s), after, stages))
    return out


def _stage_spans(spans: dict[str, tuple[float, float]]) -> StageSpans:
    def start(name: str) -> float | None:
        return spans[name][0] if name in spans else None

    def dur(name: str) -> float | None:
        return spans[name][1] if name in spans else None

    def end(name: str) -> float | None:
        return spans[name][0] + spans[name][1] if name in spans else None

    ends = [s + d for name, (s, d) in spans.items() if name != "wait"]
    return StageSpans(start("prepare"), dur("prepare"), dur("forward"), end("sample"), dur("sample"),
                      start("send"), start("recv"), end("recv"), max(ends) if ends else None, dur("to_samplers"))


def group_by_setting(runs: Sequence[RealRun]) -> dict[str, list[RealRun]]:
    """Runs of the same command (same config but the run's name and output folder): repeats, whose
    spread is the engine's own run-to-run noise."""
    groups: dict[str, list[RealRun]] = {}
    for run in runs:
        groups.setdefault(setting_key(run.spec), []).append(run)
    return {runs[0].label: runs for runs in groups.values()}


def setting_key(spec: RunSpec) -> str:
    """What a run was asked to do, from the typed spec (frozen dataclasses, so their repr is
    stable): everything but where it wrote and what it named itself or traced."""
    rc = spec.settings
    output = replace(rc.output, run_name=None, dir="", trace="off")
    return repr((replace(rc, output=output), spec.policy_name, spec.policy, spec.workload, spec.cost, spec.serve))

