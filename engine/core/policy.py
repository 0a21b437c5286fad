"""The policy contract: every hook a scheduling policy may implement, and the view it sees.

A policy is pure Python and knows nothing of the executor: the very same class drives the
discrete-event simulator and the real multi-process engine. A policy is one module in
`policies/` (discovered automatically, see `policies/__init__.py`) with a class decorated by
`@register_policy("name")`; `docs/writing-a-policy.md` walks through one.

Hooks, their defaults, and the process that runs each:

| hook | default | runs in |
|---|---|---|
| `Params` (frozen dataclass, validated in `__post_init__`) | `NoParams` | everywhere |
| `search_space(trial)` (classmethod; duck-typed `trial.suggest_*`, no Optuna import) | `{}` | the tuner |
| `prepare(ctx)`: before the run is built; may simulate short runs of this setup through `ctx.simulate` and replace `self.params`; returns facts to record | `{}` | driver |
| `start(view)`: once before the first `schedule` (e.g. fit a predictor on history) | nothing | driver |
| `view.history(mode, data_dir)` (a view method, not a hook): the workload's data set minus this run's requests, for policies that learn from history (TD-Pipe's length predictor); found by the provider the runner hands to `Controller(history=...)`, so engine/ and policies/ never read workload files | None (no provider) | driver |
| `view.prefilling`, `view.num_decoding` (view members, not hooks): the running sequences still prefilling (admission order) and the count of those past their prompt, kept by the controller at every status change, so a policy need not scan `view.running` per micro-batch (O(running) per batch: Sarathi's 45k batches over up to 128 sequences) | always there (a live view: read, never mutate) | driver |
| `view.estimate(batch)`, `view.estimate_prefill(prefix, n)` (view methods, not hooks): the cost model's stage time of the slowest stage for a batch, or for one prefill chunk of `n` tokens after `prefix` prompt tokens (chunk sizing: chunked_pp sizes every chunk of a long prompt to the first chunk's time; both executors price with the run's cost model) | always there when the run has a cost model | driver |
| `b.add_pipelined_prefill(seq, n)` (a builder method, not a hook): the next chunk of a prompt whose earlier chunks are still in flight, so one prompt's chunks run on different stages at once (chunked pipeline prefill); every other `add_*` refuses a sequence in flight | - | driver |
| `schedule(view) -> MicroBatch or None` | required | driver |
| `on_complete(view, micro_batch, finished)` | nothing | driver |
| `on_abort(view, seq)`: a served request ended early (its client went away; `testbed serve`); forget its state | nothing | driver |
| `max_inflight(view) -> int`: micro-batches in flight at most | `view.num_microbatches` | driver |
| `schedule_transfer(link, pending) -> Transfer` | FIFO, whole tensors | simulator: driver; torch engine: every sending stage |
| `runtime` (`RuntimeFeatures`, class attribute) | all off | read by the executor |

- `schedule` is called whenever a pipeline slot is free (fewer micro-batches in flight than
  `max_inflight(view)`). Compose with `b = view.new_batch()`; `b.add_decode(seq)`,
  `b.add_prefill(seq, n)`, `b.preempt(seq)`; then `return view.finish(b)`. Returning None leaves
  the slot free until the next completion or arrival.
- `view.finish(b)` is the view's one hand-over to the controller: a batch that holds work
  becomes a `MicroBatch` (the controller commits it when `schedule` returns it); a batch that
  only preempted is applied by the controller at once and `finish` returns None, so the policy
  may look again in the same call with the KV it freed. Everything else on the view is
  read-only.
- `max_inflight`: the default honours `parallel.num_microbatches` (the view's
  `num_microbatches`, which is the pipeline depth P when the setting is unset). A policy with
  its own count (MoLink's extension) must still return the setting when the user pinned it
  (`view.num_microbatches_pinned`); the runner refuses a pinned count a policy does not honour.
  Policies that split work across the micro-batches in flight (gLLM's #D, TD-Pipe's decode
  rounds, vLLM's virtual engines) split by `self.max_inflight(view)`, not by P.
- The links: `view.link_bandwidth_Bps` / `view.link_latency_s` are the run's stage-to-stage
  link (the hardware's unless `link.*` is set), the same numbers both executors use.
  `schedule_transfer` gets a `LinkState` with them on every call.
- On the torch engine each sending stage rebuilds the policy from its class and `params` and
  calls only `schedule_transfer` there, from the link's sender thread: that hook may use its
  arguments and state set up in `__init__`, never state from `prepare`/`start`/`schedule`.

Preemption and KV accounting belong to the controller and its one block manager: policies only
ask, through the builder, and the controller commits. Shared building blocks (idle decodes in
longest-idle-first order, Sarathi-style prefill filling, decode-or-preempt) are in
`policies/common.py`.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence as Seq
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from engine.base import typed
from engine.core.batch import BatchBuilder, MicroBatch, shape_of
from engine.base.errors import ConfigError
from engine.core.kv import BlockManager
from engine.base.registry import Registry
from engine.core.request import Request, Sequence


@dataclass(frozen=True)
class RuntimeFeatures:
    """SiPipe's three runtime techniques, as switches any policy may combine."""

    cpu_sampling: bool = False  # last stage ships logits to CPU sampler processes
    overlap_input_prep: bool = False  # prepare micro-batch i+1 while i runs (double buffer)
    structure_aware_transfer: bool = False  # receiver infers shapes; no per-hop metadata rounds

    def merged(self, overrides: Mapping[str, Any] | None) -> RuntimeFeatures:
        """Apply config overrides; None values keep the policy's own choice."""
        if not overrides:
            return self
        valid = {f.name for f in dataclasses.fields(self)}
        changes = {}
        for key, value in overrides.items():
            if key not in valid:
                raise ConfigError(f"unknown runtime feature {key!r}; valid choices: {', '.join(sorted(valid))}")
            if value is not None:
                if not isinstance(value, bool):
                    raise ConfigError(f"invalid runtime.{key}={value!r}: must be true, false or null")
                changes[key] = value
        return dataclasses.replace(self, **changes)


@dataclass(eq=False, slots=True)
class PendingTransfer:
    """An activation (or the rest of one) waiting at a link's sending end."""

    mb: MicroBatch
    total_bytes: int
    remaining_bytes: int
    enqueued_s: float

    @property
    def kind(self) -> str:
        return self.mb.kind


@dataclass(frozen=True, slots=True)
class LinkState:
    """What a transfer scheduler knows about its link when it must choose."""

    src: int
    dst: int
    bandwidth_Bps: float
    latency_s: float
    now_s: float
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # executor-specific estimates


@dataclass(frozen=True, slots=True)
class Transfer:
    item: PendingTransfer
    nbytes: int


@dataclass(frozen=True)
class PrepareContext:
    """What `Policy.prepare` may use before the run is built.

    `simulate(param_overrides, num_requests)` simulates the first `num_requests` requests of this
    very run (same config, executor forced to the simulator, no outputs) with the policy's params
    changed by `param_overrides`, and returns the summary (the keys of `summary.json`), or None
    when that simulation failed. MoLink's `extension=search` picks its micro-batch count this way.
    """

    pipeline_depth: int
    simulate: Callable[[Mapping[str, Any], int], Mapping[str, Any] | None]


@dataclass(frozen=True)
class History:
    """Past requests a policy may learn from (`view.history`), and how they were found."""

    source: str  # e.g. "sharegpt-llama3 pairs ... minus the run", "run (leaks: no data set found)"
    requests: tuple[Request, ...] = ()
    dataset: str | None = None  # the data set's name, e.g. "sharegpt-llama3"; None: not a data set


# (run's requests, data dir or None, mode "auto" | "run") -> History; workloads/history.py has one.
HistoryProvider = Callable[[Seq[Request], str | None, str], History]


def request_key(r: Request) -> str:
    """What identifies a request for leakage checks (history minus the run, a saved model's
    training set): its text and its two lengths."""
    text = r.prompt_text or ""
    return hashlib.sha1(f"{r.prompt_len}|{r.output_len}|{text}".encode("utf-8", "replace")).hexdigest()[:20]


@dataclass(frozen=True)
class NoParams:
    """Hyperparameters of a policy that has none."""


class Policy:
    """Base class; subclasses register with `@POLICIES.register("name")` (see `register_policy`)."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    runtime: ClassVar[RuntimeFeatures] = RuntimeFeatures()

    def __init__(self, params: Any | None = None) -> None:
        self.params = params if params is not None else self.Params()

    # --- construction from config ------------------------------------------------------------
    @classmethod
    def from_config(cls, values: Mapping[str, Any] | None = None) -> Policy:
        """Build from a plain mapping (e.g. the `policy` config group minus `name`)."""
        return cls(make_params(cls.Params, values or {}, prefix="policy"))

    @classmethod
    def search_space(cls, trial: Any) -> dict[str, Any]:
        """Hyperparameters to try, from `trial.suggest_*`; the default policy has none."""
        return {}

    # --- hooks -------------------------------------------------------------------------------
    def prepare(self, ctx: PrepareContext) -> dict[str, Any]:
        """Before the run is built (driver only): may replace `self.params` after simulating
        alternatives through `ctx.simulate`; returns facts for the run's record."""
        return {}

    def start(self, view: SchedulerView) -> None:
        """Called once before the first schedule (e.g. to fit a predictor on history)."""

    def schedule(self, view: SchedulerView) -> MicroBatch | None:
        raise NotImplementedError

    def on_complete(self, view: SchedulerView, micro_batch: MicroBatch, finished: list[Sequence]) -> None:
        """Called after the controller applied a completed micro-batch."""

    def on_abort(self, view: SchedulerView, seq: Sequence) -> None:
        """A served request ended before finishing (its client went away; `Controller.abort`):
        forget any per-sequence state. The controller already freed its KV."""

    def max_inflight(self, view: SchedulerView) -> int:
        """Micro-batches in flight at most: `parallel.num_microbatches`, P when unset."""
        return view.num_microbatches

    def schedule_transfer(self, link: LinkState, pending: Seq[PendingTransfer]) -> Transfer:
        """FIFO, whole tensors."""
        first = pending[0]
        return Transfer(first, first.remaining_bytes)


POLICIES: Registry[type[Policy]] = Registry("policy")


def register_policy(name: str):
    """Class decorator: set `cls.name` and add the class to `POLICIES` (duplicates refused)."""

    def wrap(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        POLICIES.add(name, cls)
        return cls

    return wrap


def make_params(params_cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """Build a frozen dataclass from config values (engine/base/typed.py: one system for every setting)."""
    return typed.build(params_cls, values, prefix)


class ViewSource(Protocol):
    """What `SchedulerView` reads of the controller (engine/core/controller.py's `Controller` is one).

    Named here as a protocol, not as the Controller class: the controller imports this module
    (the contract), so this module naming it back would make an import cycle
    (tests/test_architecture.py refuses any)."""

    executor: Any  # an engine.core.executor.Executor: `now()`
    kv: BlockManager
    cost_model: Any
    pipeline_depth: int
    num_microbatches: int | None
    link_bandwidth_Bps: float | None
    link_latency_s: float | None
    waiting: Seq[Sequence]
    waiting_prefill_tokens: int
    running: Mapping[int, Sequence]
    prefilling: Mapping[int, Sequence]
    num_decoding: int
    inflight: Mapping[int, MicroBatch]
    num_finished: int
    data_dir: str | None
    requests: Seq[Request]
    history_provider: HistoryProvider | None

    @property
    def num_not_arrived(self) -> int: ...

    def estimate(self, batch: MicroBatch | BatchBuilder) -> float: ...

    def estimate_prefill(self, prefix_tokens: int, num_tokens: int) -> float: ...

    def apply_preemptions(self, victims: Seq[Sequence]) -> None: ...


class SchedulerView:
    """The policy's window on the controller: read-only, except `finish` (see the module doc).

    The containers returned (`waiting`, `running`) are the controller's live ones, for speed:
    read them, never mutate them. Mutation goes through `new_batch()` and `finish()`.
    """

    __slots__ = ("_c",)

    def __init__(self, controller: ViewSource) -> None:
        self._c = controller

    # clock and shape of the pipeline
    @property
    def now(self) -> float:
        return self._c.executor.now()

    @property
    def pipeline_depth(self) -> int:
        return self._c.pipeline_depth

    @property
    def num_microbatches(self) -> int:
        """`parallel.num_microbatches` when set, else the pipeline depth P."""
        return self._c.num_microbatches or self._c.pipeline_depth

    @property
    def num_microbatches_pinned(self) -> bool:
        """True when the user set `parallel.num_microbatches` (policies must then honour it)."""
        return self._c.num_microbatches is not None

    # the stage-to-stage link, as both executors use it
    @property
    def link_bandwidth_Bps(self) -> float | None:
        return self._c.link_bandwidth_Bps

    @property
    def link_latency_s(self) -> float | None:
        return self._c.link_latency_s

    # requests
    @property
    def waiting(self):
        """Arrived, not admitted (preempted sequences first, then arrival order)."""
        return self._c.waiting

    @property
    def waiting_prefill_tokens(self) -> int:
        """Prompt tokens the waiting sequences still need to prefill (O(1); gLLM's #WP part)."""
        return self._c.waiting_prefill_tokens

    @property
    def running(self):
        """Admitted sequences (prefilling or decoding, in flight or not), in admission order."""
        return self._c.running.values()

    @property
    def num_running(self) -> int:
        return len(self._c.running)

    @property
    def prefilling(self):
        """The running sequences still prefilling their prompt (in flight or not), in admission
        order: kept by the controller at every status change, so a policy that wants its partial
        prompts need not scan the whole running set per micro-batch."""
        return self._c.prefilling.values()

    @property
    def num_decoding(self) -> int:
        """Running sequences past their prompt (in flight or not): `num_running` minus the
        prefilling ones, O(1)."""
        return self._c.num_decoding

    @property
    def inflight(self) -> tuple[MicroBatch, ...]:
        return tuple(self._c.inflight.values())

    @property
    def num_inflight(self) -> int:
        return len(self._c.inflight)

    @property
    def num_finished(self) -> int:
        return self._c.num_finished

    @property
    def num_not_arrived(self) -> int:
        return self._c.num_not_arrived

    @property
    def data_dir(self) -> str | None:
        """The run's workload data directory (None: the environment/cache defaults)."""
        return self._c.data_dir

    @property
    def all_requests(self):
        """Every request of the workload (offline policies such as TD-Pipe may look ahead)."""
        return self._c.requests

    def history(self, mode: str = "auto", data_dir: str | None = None) -> History | None:
        """Requests of the workload's data set other than this run's, for policies that learn from
        history (`mode="auto"`), or the run's own requests (`mode="run"`, which leaks). Found by
        the provider the runner passed to the controller, in `data_dir` (default: the run's
        `data_dir`); None when the controller was built without one (a hand-made controller)."""
        provider = self._c.history_provider
        if provider is None:
            return None
        return provider(self._c.requests, data_dir or self._c.data_dir, mode)

    # KV cache
    @property
    def block_size(self) -> int:
        return self._c.kv.block_size

    @property
    def kv_total_blocks(self) -> int:
        return self._c.kv.num_blocks

    @property
    def kv_free_blocks(self) -> int:
        return self._c.kv.num_free

    @property
    def kv_free_fraction(self) -> float:
        return self._c.kv.num_free / self._c.kv.num_blocks

    def kv_blocks_of(self, seq: Sequence) -> int:
        return len(self._c.kv.block_table(seq.seq_id))

    # cost model
    def estimate(self, batch: MicroBatch | BatchBuilder) -> float:
        """Predicted time of the slowest stage for this batch (seconds), from the cost model."""
        return self._c.estimate(batch)

    def estimate_prefill(self, prefix_tokens: int, num_tokens: int) -> float:
        """Predicted time of the slowest stage (seconds) for a micro-batch holding one prefill chunk
        of `num_tokens` after `prefix_tokens` tokens already in the KV cache, from the same cost
        model as `estimate`. In SGLang's terms it is Runtime(prefix + chunk) - Runtime(prefix) plus
        the per-pass fixed costs every chunk pays, so "every chunk as long as the first" is
        `estimate_prefill(L, x) == estimate_prefill(0, first_chunk)`."""
        return self._c.estimate_prefill(prefix_tokens, num_tokens)

    @property
    def cost_model(self):
        return self._c.cost_model

    # composing
    def new_batch(self) -> BatchBuilder:
        return BatchBuilder(self._c.kv)

    def finish(self, builder: BatchBuilder) -> MicroBatch | None:
        """Hand the builder to the controller: a micro-batch when it holds work, else None after
        the controller applied its preemptions (a preemption-only decision makes room at once, so
        the policy may look again in the same call)."""
        if builder.is_empty():
            if builder.preempted:
                self._c.apply_preemptions(builder.preempted)
            return None
        # positional: MicroBatch(mb_id, prefills, decodes, preempted, shape, tags), once per micro-batch
        return MicroBatch(-1, tuple(builder.prefills), tuple(builder.decodes), tuple(builder.preempted),
                          shape_of(builder.prefills, builder.decodes), dict(builder.tags))
