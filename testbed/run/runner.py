"""One experiment: RunSpec -> workload, policy, cost model, executor -> controller run -> results.

`run_experiment(spec)` (a `RunSpec`, testbed/config/spec.py) is what `testbed run`, `compare`
and the tuner's trials call. It does no MLflow logging and writes nothing;
`testbed/run/outputs.py` and `testbed/tracking/tracker.py` do that, so a trial can decide what
to keep.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.core.breakdown import run_breakdown
from engine.core.controller import Controller
from engine.pricing.costmodel import CostModel
from engine.base.errors import ConfigError, RunFailedError, TestbedError
from engine.core.executor import EXECUTORS, ExecutorBuild
from engine.core.kv import BlockManager
from engine.core.metrics import SLO, microbatch_rows, request_rows, summarize
from engine.core.policy import POLICIES, PrepareContext
from engine.base.settings import Link, RunConfig
from testbed.run.outputs import make_tracer
from testbed.run.timing import serving_name
from testbed.signals import signal_name
from testbed.run.result import RunInterrupted, RunResult
from testbed.config.spec import RunSpec
from workloads.base import build_workload
from workloads.history import history_for_run


def build_cost_model(spec: RunSpec) -> CostModel:
    """The cost model of a run: its model on its hardware, split over its stages."""
    rc = spec.settings
    if rc.hardware is None or rc.model is None:
        raise ConfigError("the config names no hardware or no model; e.g. hardware=l20-48g model=qwen2.5-32b")
    split = rc.parallel.layer_split
    return CostModel(rc.model, rc.hardware, pp=rc.parallel.pp, tp=rc.parallel.tp,
                     layer_split=(split if isinstance(split, str) else list(split)) if split else None,
                     coefficients=spec.cost)


def kv_blocks(rc: RunConfig, cost: CostModel) -> tuple[int, int]:
    """(number of KV blocks, tokens per block): `kv.num_blocks`, else what the memory holds (the
    torch engine on CPU: the machine's available memory, engine/torch_exec/shared/kv_sizing.py)."""
    kv = rc.kv
    if kv.num_blocks is not None:
        return kv.num_blocks, kv.block_size
    st = rc.executor.settings
    if rc.executor.name == "torch" and st.device == "cpu" and st.launch == "spawn":  # not the GPU's memory
        from engine.base.settings import MAX_KV_BLOCKS
        from engine.torch_exec.shared.kv_sizing import cpu_pool_for

        n = cpu_pool_for(cost.model, kv.block_size, st.resolved_dtype, MAX_KV_BLOCKS)
        if n is not None:
            return n, kv.block_size
    return cost.kv_capacity_blocks(gpu_memory_utilization=kv.gpu_memory_utilization,
                                   block_size=kv.block_size), kv.block_size


def link_settings(rc: RunConfig, cost: CostModel) -> Link:
    """The run's stage-to-stage link, resolved once (engine/base/settings.py: null = the hardware's)."""
    return rc.link.resolve(cost.hardware)


def check_microbatch_count(ctrl: Controller, pinned: int | None) -> None:
    """Refuse a pinned micro-batch count the policy does not honour (its `max_inflight`)."""
    if pinned is None:
        return
    got = ctrl.policy.max_inflight(ctrl.view)
    if got != pinned:
        raise ConfigError(f"policy {ctrl.policy.name!r} does not honour parallel.num_microbatches={pinned} "
                          f"(it keeps {got} micro-batches in flight); unset it for this policy")


def short_simulation_spec(spec: RunSpec, params: Mapping[str, Any], num_requests: int) -> RunSpec:
    """This run with other policy params, in the simulator, on its first `num_requests` requests,
    writing nothing."""
    values: dict[str, Any] = {f"policy.{k}": v for k, v in params.items()}
    values["executor"] = {"name": "sim"}
    if spec.workload.num_requests is None or spec.workload.num_requests > num_requests:
        values["workload.num_requests"] = num_requests
    values.update({"output.mlflow": False, "output.plots": False, "output.progress": False})
    return spec.with_values(values)


def _short_simulation(spec: RunSpec, params: Mapping[str, Any], num_requests: int) -> dict | None:
    """`PrepareContext.simulate`: the summary of `short_simulation_spec`; None when it failed."""
    res = run_experiment(short_simulation_spec(spec, params, num_requests))
    return None if res.failed else res.summary


def build_policy(spec: RunSpec):
    return POLICIES.get(spec.policy_name)(spec.policy)


@dataclass
class PreparedRun:
    """Everything built and validated, nothing run yet: user mistakes surface before any
    tracking run is opened."""

    spec: RunSpec
    controller: Controller
    cost: CostModel
    info: dict

    def run(self) -> RunResult:
        """Run to the end. A failure of the run itself (stall, dead worker) returns a result with
        `error` set; Ctrl-C or SIGTERM raises `RunInterrupted` carrying the partial result (every
        unfinished request reported failed), so `testbed run` can still write and log it."""
        ctrl = self.controller
        error = None
        interrupted: KeyboardInterrupt | None = None
        if self.info["executor"] == "torch":  # the host and its speed, before the workers (host_probe.py)
            from testbed.run.host_probe import host_info
            self.info["host"] = host_info()
        t_prep = time.perf_counter()
        t0 = t_prep
        try:
            ctrl.start()  # executor workers up, policy preparation (not serving time)
            self.info["kv_num_blocks"] = ctrl.kv.num_blocks  # measured by the executor, or as configured
            if getattr(ctrl.executor, "stage_info", None):  # a real run's stages: load, set-up, capture time and memory
                self.info["stages"] = ctrl.executor.stage_info
            t0 = time.perf_counter()
            ctrl.run()
        except RunFailedError as exc:
            error = str(exc)
            ctrl.fail_unfinished(f"run failed: {error}")  # in-flight and waiting requests are reported, not lost
        except KeyboardInterrupt as exc:
            interrupted = exc
            error = f"interrupted ({signal_name(exc)})"
            ctrl.drop_half_written_rows()  # the signal may have struck inside an append
            ctrl.fail_unfinished(f"run {error}")
        except BaseException as exc:
            ctrl.fail_unfinished(f"run aborted: {type(exc).__name__}: {exc}")
            raise
        finally:
            ctrl.executor.shutdown()
        run_s = time.perf_counter() - t0
        stage_tracks = [f"stage{s}" for s in range(self.cost.pp)]
        summary = summarize(ctrl, SLO(**self.info.pop("_slo")), stage_tracks)
        info = dict(self.info, start_s=t0 - t_prep, microbatches_per_wall_s=summary["num_microbatches"] / run_s if run_s > 0 else 0.0)
        info[f"{serving_name(self.info['executor'])}_s"] = run_s  # simulation_s or engine_s (testbed/run/timing.py)
        result = RunResult(spec=self.spec, summary=summary, requests=request_rows(ctrl),
                           microbatches=microbatch_rows(ctrl), tracer=ctrl.executor.tracer,
                           stage_tracks=stage_tracks, info=info, error=error,
                           breakdown=run_breakdown(ctrl, stage_tracks))
        if interrupted is not None:
            raise RunInterrupted(result, signal_name(interrupted)) from None
        return result


def prepare_experiment(spec: RunSpec, progress: Callable[[int, int], None] | None = None,
                       requests=None, planning: RunSpec | None = None) -> PreparedRun:
    """Validate the config and build workload, policy, cost model and executor.
    Raises TestbedError (one clear line) for any user mistake.

    `planning`: the run whose hardware the policy plans with (`view.cost_model`, `view.estimate`,
    `prepare`'s short simulations, `view.link_bandwidth_Bps` / `link_latency_s`), when it is not the one that prices the run: a replay of a real
    engine run (testbed/calibrate/offline.py) prices with the profile fitted to the engine but must
    let the policy see the cost model the engine's policy saw (TD-Pipe's phase switch and MoLink's
    in-flight count read them; issue 47: TD-Pipe's TTFT +199% at P=2, 9 req/s, when they differed)."""
    wall0 = time.perf_counter()
    rc = spec.settings
    cost = build_cost_model(spec)
    plan = planning or spec
    plan_cost = cost if planning is None else build_cost_model(planning)
    link = link_settings(rc, cost)
    plan_link = link if planning is None else link_settings(planning.settings, plan_cost)
    num_microbatches = rc.parallel.num_microbatches
    policy = build_policy(spec)
    prepare_info = policy.prepare(PrepareContext(cost.pp, lambda params, n: _short_simulation(plan, params, n)))
    runtime = policy.runtime.merged(dataclasses.asdict(rc.runtime))
    ex_spec = EXECUTORS.get(rc.executor.name)
    if requests is None:
        requests = build_workload(spec.workload, spec.data_dir)
    if not requests:
        raise ConfigError("the workload produced no requests; loosen its filters or raise workload.num_requests")
    tracer = make_tracer(dataclasses.asdict(rc.output), rc.executor.name)  # output.trace: sampled (default), full or off
    executor = ex_spec.factory(rc.executor.settings, ExecutorBuild(cost, runtime, link, policy, tracer, rc))
    # the torch engine on CUDA sizes an unset pool from measured memory when it starts (a placeholder till then)
    measured = rc.kv.num_blocks is None and getattr(executor, "measure_kv", False)
    num_blocks, block_size = (1, rc.kv.block_size) if measured else kv_blocks(rc, cost)
    kv = BlockManager(num_blocks, block_size)
    ctrl = Controller(requests, policy, executor, kv, cost_model=plan_cost, check_integrity=rc.check_integrity,
                      data_dir=spec.data_dir, progress=progress, num_microbatches=num_microbatches,
                      link_bandwidth_Bps=plan_link.bandwidth_Bps, link_latency_s=plan_link.latency_s,
                      history=history_for_run)  # `view.history`: the data set minus the run (TD-Pipe)
    check_microbatch_count(ctrl, num_microbatches)
    info = {"build_s": time.perf_counter() - wall0, "kv_num_blocks": num_blocks, "kv_block_size": block_size,
            "layers_per_stage": list(cost.layers), "executor": rc.executor.name, "policy": policy.name,
            "runtime": {k: getattr(runtime, k) for k in ("cpu_sampling", "overlap_input_prep",
                                                          "structure_aware_transfer")},
            "link_bandwidth_Bps": link.bandwidth_Bps, "link_latency_s": link.latency_s,
            "_slo": {"ttft_s": rc.slo.ttft_s, "tpot_s": rc.slo.tpot_s}}
    if num_microbatches is not None:
        info["num_microbatches"] = num_microbatches
    info.update(prepare_info)
    return PreparedRun(spec, ctrl, cost, info)


def run_experiment(spec: RunSpec, progress: Callable[[int, int], None] | None = None,
                   requests=None) -> RunResult:
    """Prepare and run one experiment. A failure during the run (stall, dead worker) returns a
    RunResult with `error` set and every request accounted for (finished, or failed with a reason)."""
    return prepare_experiment(spec, progress, requests).run()


__all__ = ["RunResult", "run_experiment", "build_cost_model", "TestbedError"]
