"""One experiment: config -> workload, policy, cost model, executor -> controller run -> results.

`run_experiment(cfg)` is what `testbed run`, `compare` and the tuner's trials call. It does no
MLflow logging and writes nothing; `testbed/outputs.py` and `testbed/tracking.py` do that, so a
trial can decide what to keep.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.controller import Controller
from engine.costmodel import CostCoefficients, CostModel
from engine.errors import ConfigError, RunFailedError, TestbedError, bad_value
from engine.executor import EXECUTORS, ExecutorBuild
from engine.hardware import HardwareSpec
from engine.kv import BlockManager
from engine.metrics import SLO, microbatch_rows, request_rows, summarize
from engine.models import ModelSpec
from engine.policy import POLICIES, RuntimeFeatures, make_params
from engine.units import parse_bandwidth, parse_duration
from testbed.config import data_dir
from testbed.signals import signal_name
from testbed.outputs import make_tracer
from workloads.base import build_workload


@dataclass
class RunResult:
    config: dict
    summary: dict
    requests: list[dict]
    microbatches: list[dict]
    tracer: Tracer
    stage_tracks: list[str]
    info: dict = field(default_factory=dict)  # wall time, memory: not deterministic, kept out of summary
    error: str | None = None

    @property
    def failed(self) -> bool:
        return self.error is not None


def _section(cfg: Mapping[str, Any], name: str) -> dict:
    value = cfg.get(name)
    return dict(value) if isinstance(value, Mapping) else {}


def build_cost_model(cfg: Mapping[str, Any]) -> CostModel:
    hw = _spec(HardwareSpec, _section(cfg, "hardware"), "hardware")
    model = _spec(ModelSpec, _section(cfg, "model"), "model")
    par = _section(cfg, "parallel")
    pp, tp = par.get("pp", 1), par.get("tp", 1)
    for key, value in (("parallel.pp", pp), ("parallel.tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise bad_value(key, value, "must be an integer >= 1")
    values = dict(hw.calibration or {})
    values.update({k: v for k, v in _section(cfg, "cost").items() if v is not None})
    coeffs = make_params(CostCoefficients, values, prefix="cost")
    split = par.get("layer_split")
    return CostModel(model, hw, pp=pp, tp=tp, layer_split=list(split) if split else None, coefficients=coeffs)


def _spec(cls: type, values: dict, prefix: str):
    return make_params(cls, values, prefix=prefix)


def kv_blocks(cfg: Mapping[str, Any], cost: CostModel) -> tuple[int, int]:
    kv = _section(cfg, "kv")
    block_size = kv.get("block_size", 16)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise bad_value("kv.block_size", block_size, "must be an integer >= 1")
    util = kv.get("gpu_memory_utilization", 0.9)
    if not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise bad_value("kv.gpu_memory_utilization", util, "must be in (0, 1]")
    fixed = kv.get("num_blocks")
    if fixed is not None:
        if isinstance(fixed, bool) or not isinstance(fixed, int) or fixed < 1:
            raise bad_value("kv.num_blocks", fixed, "must be an integer >= 1 or null (derived from memory)")
        return fixed, block_size
    return cost.kv_capacity_blocks(gpu_memory_utilization=float(util), block_size=block_size), block_size


def link_settings(cfg: Mapping[str, Any], cost: CostModel) -> tuple[float, float]:
    link = _section(cfg, "link")
    bw = link.get("bandwidth")
    lat = link.get("latency")
    bandwidth = parse_bandwidth(bw) if bw is not None else cost.hardware.p2p_bw_gbs * 1e9
    latency = parse_duration(lat) if lat is not None else cost.hardware.p2p_latency_s
    return bandwidth, latency


def build_policy(cfg: Mapping[str, Any]):
    pol = _section(cfg, "policy")
    name = pol.pop("name", None)
    if name is None:
        raise ConfigError(f"no policy chosen; valid choices: {', '.join(POLICIES.names())}")
    return POLICIES.get(name).from_config(pol)


@dataclass
class PreparedRun:
    """Everything built and validated, nothing run yet: user mistakes surface before any
    tracking run is opened."""

    config: dict
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
        t_prep = time.perf_counter()
        t0 = t_prep
        try:
            ctrl.start()  # executor workers up, policy preparation (not serving time)
            t0 = time.perf_counter()
            ctrl.run()
        except RunFailedError as exc:
            error = str(exc)
            ctrl.fail_unfinished(f"run failed: {error}")  # in-flight and waiting requests are reported, not lost
        except KeyboardInterrupt as exc:
            interrupted = exc
            error = f"interrupted ({signal_name(exc)})"
            ctrl.fail_unfinished(f"run {error}")
        except BaseException as exc:
            ctrl.fail_unfinished(f"run aborted: {type(exc).__name__}: {exc}")
            raise
        finally:
            ctrl.executor.shutdown()
        run_s = time.perf_counter() - t0
        stage_tracks = [f"stage{s}" for s in range(self.cost.pp)]
        summary = summarize(ctrl, SLO(**self.info.pop("_slo")), stage_tracks)
        info = dict(self.info, simulate_s=run_s, start_s=t0 - t_prep, wall_s=self.info["build_s"] + (t0 - t_prep) + run_s,
                    microbatches_per_wall_s=summary["num_microbatches"] / run_s if run_s > 0 else 0.0)
        result = RunResult(config=self.config, summary=summary, requests=request_rows(ctrl),
                           microbatches=microbatch_rows(ctrl), tracer=ctrl.executor.tracer,
                           stage_tracks=stage_tracks, info=info, error=error)
        if interrupted is not None:
            raise RunInterrupted(result, signal_name(interrupted)) from None
        return result


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a run, with the partial result (a KeyboardInterrupt, so callers
    that stop on Ctrl-C keep doing so)."""

    def __init__(self, result: RunResult, signal: str) -> None:
        super().__init__(signal)
        self.result, self.signal = result, signal


def prepare_experiment(cfg: Mapping[str, Any], progress: Callable[[int, int], None] | None = None,
                       requests=None) -> PreparedRun:
    """Validate the config and build workload, policy, cost model and executor.
    Raises TestbedError (one clear line) for any user mistake."""
    wall0 = time.perf_counter()
    from testbed.molink_search import resolve_extension  # MoLink: extension=search -> simulated k

    cfg, search_info = resolve_extension(cfg)
    cost = build_cost_model(cfg)
    num_blocks, block_size = kv_blocks(cfg, cost)
    bandwidth, latency = link_settings(cfg, cost)
    policy = build_policy(cfg)
    if hasattr(policy, "bind_links"):  # policies that size work by the links (MoLink)
        policy.bind_links(bandwidth, latency)
    runtime = policy.runtime.merged(_section(cfg, "runtime"))
    ex_cfg = _section(cfg, "executor")
    ex_name = ex_cfg.pop("name", "sim")
    ex_spec = EXECUTORS.get(ex_name)
    settings = make_params(ex_spec.config_cls, ex_cfg, prefix="executor")
    slo = make_params(SLO, _section(cfg, "slo"), prefix="slo")
    if requests is None:
        requests = build_workload(_section(cfg, "workload"), data_dir(cfg))
    if not requests:
        raise ConfigError("the workload produced no requests; loosen its filters or raise workload.num_requests")
    output = _section(cfg, "output")
    tracer = make_tracer(output, ex_name)  # output.trace: sampled (default), full or off
    executor = ex_spec.factory(settings, ExecutorBuild(cost, runtime, bandwidth, latency, policy, tracer, cfg))
    kv = BlockManager(num_blocks, block_size)
    ctrl = Controller(requests, policy, executor, kv, cost_model=cost,
                      check_integrity=bool(cfg.get("check_integrity", False)), data_dir=data_dir(cfg),
                      progress=progress)
    info = {"build_s": time.perf_counter() - wall0, "kv_num_blocks": num_blocks, "kv_block_size": block_size,
            "layers_per_stage": list(cost.layers), "executor": ex_name, "policy": policy.name,
            "runtime": {k: getattr(runtime, k) for k in ("cpu_sampling", "overlap_input_prep",
                                                          "structure_aware_transfer")},
            "link_bandwidth_Bps": bandwidth, "link_latency_s": latency,
            "_slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}
    if search_info:
        info.update(search_info)
    return PreparedRun(dict(cfg), ctrl, cost, info)


def run_experiment(cfg: Mapping[str, Any], progress: Callable[[int, int], None] | None = None,
                   requests=None) -> RunResult:
    """Prepare and run one experiment. A failure during the run (stall, dead worker) returns a
    RunResult with `error` set and every request accounted for (finished, or failed with a reason)."""
    return prepare_experiment(cfg, progress, requests).run()


__all__ = ["RunResult", "run_experiment", "build_cost_model", "TestbedError"]
