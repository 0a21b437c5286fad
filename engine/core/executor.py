"""The executor interface: what the controller needs from the simulator and the real engine.

Three calls carry the loop (nano-vllm's `step`): `launch(micro_batch)`, `next_completion()`,
`now()`. `wait_until(t)` idles until the next arrival when nothing is in flight. Executors
record what each stage did in a `Tracer` (engine/core/trace.py) so both produce the same metrics
and the same trace.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from engine.core.batch import MicroBatch
from engine.core.policy import RuntimeFeatures
from engine.base.registry import Registry
from engine.base.settings import Link, RunConfig
from engine.core.trace import Tracer


@dataclass(frozen=True, slots=True)
class Completion:
    """A micro-batch whose tokens were sampled. `token_ids` follow
    `micro_batch.sampled_sequences()` order; the simulator returns None (lengths only)."""

    mb_id: int
    time_s: float
    token_ids: tuple[int, ...] | None = None


class Executor(ABC):
    pipeline_depth: int
    tracer: Tracer

    @abstractmethod
    def launch(self, mb: MicroBatch) -> None:
        """Start `mb` through the pipeline; returns at once."""

    @abstractmethod
    def next_completion(self, deadline: float | None = None) -> Completion | None:
        """Block until a micro-batch completes (return it) or the clock reaches `deadline`
        (return None). With nothing in flight and no deadline, return None at once."""

    @abstractmethod
    def now(self) -> float:
        """Seconds since the run started, on the executor's clock."""

    @abstractmethod
    def wait_until(self, t: float) -> None:
        """Idle until the clock reads `t` (nothing is in flight)."""

    def attach(self, kv) -> None:
        """The controller hands over its block manager: the real engine's stages index their
        paged KV pools by its block tables. The simulator needs only lengths."""

    def start(self) -> None:
        """Bring workers up (the real engine); the simulator has nothing to do."""

    def start_clock(self) -> None:
        """The run's clock starts now: called by the controller once the policy has prepared
        (`Policy.start`), so that preparation is not serving time on either executor. The real
        engine's clock had read TD-Pipe's predictor training (4.37 s on CPU before its first
        micro-batch, 0 s when an earlier run had left its predictions on disk), which the
        simulator never charged; the simulator's clock is already at 0 here."""

    def shutdown(self) -> None:
        """End every worker; idempotent, and safe after a failure."""


class ExecutorSpec(NamedTuple):
    """What an executor registers: its settings dataclass and a factory.

    `factory(settings, build)` gets the settings and an `ExecutorBuild` with everything the
    run resolved (cost model, runtime features, link, policy, tracer, typed run config)."""

    config_cls: type
    factory: Callable[[Any, "ExecutorBuild"], Executor]


@dataclass(frozen=True)
class ExecutorBuild:
    """What the runner resolved for an executor: typed, never the raw config dict."""

    cost_model: Any  # engine.pricing.costmodel.CostModel
    runtime: RuntimeFeatures
    link: Link  # resolved once by the runner; `link.explicit`: the run named it (the torch engine paces)
    policy: Any
    tracer: Tracer
    run_config: RunConfig  # the typed top-level sections (seed, parallel, kv, output, ...)


EXECUTORS: Registry[ExecutorSpec] = Registry("executor")
