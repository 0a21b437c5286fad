"""The policy contract: what a scheduling policy implements, and the read-only view it sees.

A policy is pure Python and knows nothing of the executor: the very same object drives the
discrete-event simulator and the real multi-process engine. Its hooks:

- `schedule(view) -> MicroBatch | None`: called whenever a pipeline slot is free (fewer
  micro-batches in flight than `max_inflight(view)`). Compose the batch with
  `b = view.new_batch()`; `b.add_decode(seq)`, `b.add_prefill(seq, n)`, `b.preempt(seq)`; then
  `return view.finish(b)` (None when empty). Returning None leaves the slot free until the next
  completion or arrival.
- `on_complete(view, micro_batch, finished)`: after a micro-batch's tokens are sampled and the
  controller has updated every sequence (`finished` lists the sequences that ended).
- `on_abort(view, seq)`: a served request ended early (its client went away); forget its state.
- `max_inflight(view) -> int`: how many micro-batches may be in flight; default the depth P
  (MoLink raises it to [P, 2P]).
- `schedule_transfer(link, pending) -> Transfer`: which pending activation (or how many bytes of
  it) a link sends next; default FIFO, whole tensors (MoLink chunks prefill activations).
- `runtime`: executor features the policy asks for (`RuntimeFeatures`); the run config may
  switch any of them on for any policy, e.g. gLLM on SiPipe's runtime.
- `search_space(trial)`: the policy's Optuna search space (duck-typed `trial.suggest_*`; no
  Optuna import here) returning a dict of hyperparameters.
- `Params`: a frozen dataclass of hyperparameters, validated in `__post_init__`.

Preemption and KV accounting belong to the controller and its one block manager: policies only
ask, through the builder, and the controller commits.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from engine.batch import BatchBuilder, MicroBatch, shape_of
from engine.errors import ConfigError
from engine.registry import Registry
from engine.request import Sequence

if TYPE_CHECKING:
    from engine.controller import Controller


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
        return view.pipeline_depth

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
    """Build a frozen dataclass from config values, naming unknown keys and bad types."""
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "(none)"
        raise ConfigError(f"unknown key {prefix}.{unknown[0]}; valid keys: {valid}")
    kwargs = {}
    for key, value in values.items():
        kwargs[key] = _coerce(f"{prefix}.{key}", value, fields[key])
    try:
        return params_cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def _coerce(key: str, value: Any, field: dataclasses.Field) -> Any:
    """Accept ints for float fields and reject strings for numbers, with a clear message."""
    default = field.default
    if value is None or default is dataclasses.MISSING or default is None:
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"invalid {key}={value!r}: must be true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"invalid {key}={value!r}: must be an integer")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"invalid {key}={value!r}: must be a number")
        return float(value)
    if isinstance(default, tuple) and isinstance(value, (list, tuple)):
        return tuple(value)
    return value


class SchedulerView:
    """Read-only window on the controller for policies.

    The containers returned (`waiting`, `running`) are the controller's live ones, for speed:
    read them, never mutate them. Mutation goes through `new_batch()`.
    """

    __slots__ = ("_c",)

    def __init__(self, controller: Controller) -> None:
        self._c = controller

    # clock and shape of the pipeline
    @property
    def now(self) -> float:
        return self._c.executor.now()

    @property
    def pipeline_depth(self) -> int:
        return self._c.pipeline_depth

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

    @property
    def cost_model(self):
        return self._c.cost_model

    # composing
    def new_batch(self) -> BatchBuilder:
        return BatchBuilder(self._c.kv)

    def finish(self, builder: BatchBuilder) -> MicroBatch | None:
        """Turn a builder into a micro-batch (None if it holds no work)."""
        if builder.is_empty():
            if builder.preempted:
                # Preemption alone is a real decision (make room); the controller applies it.
                self._c.apply_preemptions(builder.preempted)
            return None
        return MicroBatch(
            mb_id=-1,
            prefills=tuple(builder.prefills),
            decodes=tuple(builder.decodes),
            preempted=tuple(builder.preempted),
            shape=shape_of(builder.prefills, builder.decodes),
            tags=dict(builder.tags),
        )
