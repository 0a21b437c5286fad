"""One experiment: config -> workload, policy, cost model, executor -> controller run -> results.

`run_experiment(cfg)` is what `testbed run`, `compare` and the tuner's trials call. It does no
MLflow logging and writes nothing; `testbed/outputs.py` and `testbed/tracking.py` do that, so a
trial can decide what to keep.
"""
from __future__ import annotations

import copy
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
from engine.policy import POLICIES, PrepareContext, RuntimeFeatures, make_params
from engine.trace import Tracer
from engine.units import parse_bandwidth, parse_duration
from testbed.config import data_dir
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


def microbatch_count(cfg: Mapping[str, Any], pp: int) -> int | None:
    """`parallel.num_microbatches`: None (the policy's choice) or an integer in [1, 2P].

    Fewer than P leaves stages idle on purpose; more than P queues micro-batches at stage 0,
    which hides link latency and bubbles at the price of smaller batches (docs/configuration.md).
    """
    n = _section(cfg, "parallel").get("num_microbatches")
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 2 * pp:
        raise bad_value("parallel.num_microbatches", n, f"must be an integer in [1, {2 * pp}] (2 x parallel.pp) "
                                                       "or null (the policy's own choice)")
    return n


def check_microbatch_count(ctrl: Controller, pinned: int | None) -> None:
    """Refuse a pinned micro-batch count the policy does not honour (its `max_inflight`)."""
    if pinned is None:
        return
    got = ctrl.policy.max_inflight(ctrl.view)
    if got != pinned:
        raise ConfigError(f"policy {ctrl.policy.name!r} does not honour parallel.num_microbatches={pinned} "
                          f"(it keeps {got} micro-batches in flight); unset it for this policy")


def _short_simulation(cfg: Mapping[str, Any], params: Mapping[str, Any], num_requests: int) -> dict | None:
    """`PrepareContext.simulate`: this run with other policy params, in the simulator, on its first
    `num_requests` requests, writing nothing. None when that simulation failed."""
    c = copy.deepcopy(dict(cfg))
    c["policy"] = dict(_section(cfg, "policy"), **params)
    c["executor"] = {"name": "sim"}
    wl = _section(c, "workload")
    if wl.get("num_requests") is None or wl["num_requests"] > num_requests:
        wl["num_requests"] = num_requests
    c["workload"] = wl
    c["output"] = dict(_section(c, "output"), mlflow=False, plots=False, progress=False)
    res = run_experiment(c)
    return None if res.failed else res.summary


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
        ctrl = self.controller
        error = None
        t_prep = time.perf_counter()
        t0 = t_prep
        try:
            ctrl.start()  # executor workers up, policy preparation (not serving time)
            t0 = time.perf_counter()
            ctrl.run()
        except RunFailedError as exc:
            error = str(exc)
            ctrl.fail_unfinished(f"run failed: {error}")  # in-flight and waiting requests are reported, not lost
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
        return RunResult(config=self.config, summary=summary, requests=request_rows(ctrl),
                         microbatches=microbatch_rows(ctrl), tracer=ctrl.executor.tracer,
                         stage_tracks=stage_tracks, info=info, error=error)


def prepare_experiment(cfg: Mapping[str, Any], progress: Callable[[int, int], None] | None = None,
                       requests=None) -> PreparedRun:
    """Validate the config and build workload, policy, cost model and executor.
    Raises TestbedError (one clear line) for any user mistake."""
    wall0 = time.perf_counter()
    cost = build_cost_model(cfg)
    num_blocks, block_size = kv_blocks(cfg, cost)
    bandwidth, latency = link_settings(cfg, cost)
    num_microbatches = microbatch_count(cfg, cost.pp)
    policy = build_policy(cfg)
    prepare_info = policy.prepare(PrepareContext(cost.pp, lambda params, n: _short_simulation(cfg, params, n)))
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
    tracer = Tracer(max_spans=int(output.get("max_trace_spans", 200_000)))
    executor = ex_spec.factory(settings, ExecutorBuild(cost, runtime, bandwidth, latency, policy, tracer, cfg))
    kv = BlockManager(num_blocks, block_size)
    ctrl = Controller(requests, policy, executor, kv, cost_model=cost,
                      check_integrity=bool(cfg.get("check_integrity", False)), data_dir=data_dir(cfg),
                      progress=progress, num_microbatches=num_microbatches,
                      link_bandwidth_Bps=bandwidth, link_latency_s=latency)
    check_microbatch_count(ctrl, num_microbatches)
    info = {"build_s": time.perf_counter() - wall0, "kv_num_blocks": num_blocks, "kv_block_size": block_size,
            "layers_per_stage": list(cost.layers), "executor": ex_name, "policy": policy.name,
            "runtime": {k: getattr(runtime, k) for k in ("cpu_sampling", "overlap_input_prep",
                                                          "structure_aware_transfer")},
            "link_bandwidth_Bps": bandwidth, "link_latency_s": latency,
            "_slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}}
    if num_microbatches is not None:
        info["num_microbatches"] = num_microbatches
    info.update(prepare_info)
    return PreparedRun(dict(cfg), ctrl, cost, info)


def run_experiment(cfg: Mapping[str, Any], progress: Callable[[int, int], None] | None = None,
                   requests=None) -> RunResult:
    """Prepare and run one experiment. A failure during the run (stall, dead worker) returns a
    RunResult with `error` set and every request accounted for (finished, or failed with a reason)."""
    return prepare_experiment(cfg, progress, requests).run()


__all__ = ["RunResult", "run_experiment", "build_cost_model", "TestbedError"]
