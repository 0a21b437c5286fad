"""`parallel.layer_split=balanced` (engine/pricing/layer_balance.py) on a vLLM PR #6920-like
setting: Llama-3.1-70B on 8 GPUs of 24 GB (an L4's memory on the L20 profile), P=8."""
from __future__ import annotations

import dataclasses

import pytest

import policies  # noqa: F401
from engine.base.errors import ConfigError
from engine.pricing.costmodel import BatchShape, CostModel
from engine.pricing.hardware import get_hardware
from engine.pricing.layer_balance import REFERENCE_DECODE
from engine.pricing.models import get_model
from testbed.config.spec import compose_spec
from testbed.run.runner import run_experiment

L4_LIKE = dataclasses.replace(get_hardware("l20-48g"), mem_gib=24.0)
MODEL = get_model("llama-3.1-70b")


def test_balanced_holds_more_kv_and_no_stage_is_slower_than_the_even_splits_slowest():
    even = CostModel(MODEL, L4_LIKE, pp=8)
    bal = CostModel(MODEL, L4_LIKE, pp=8, layer_split="balanced")
    assert even.layers == (10,) * 8
    assert sum(bal.layers) == 80 and bal.layers[0] < 10 and bal.layers[-1] < 10  # the ends hold embedding, LM head
    assert bal.kv_capacity_blocks() > even.kv_capacity_blocks()  # measured 3,825 vs 3,612
    decode = BatchShape.decode(*REFERENCE_DECODE)
    assert max(bal.stage_times_s(decode)) <= max(even.stage_times_s(decode))  # 46.7 ms vs 47.7 ms


def test_even_stays_where_no_move_helps():
    """With 48 GB an 11-layer stage would hold fewer blocks than the even split's end stages."""
    hw = get_hardware("l20-48g")
    assert CostModel(MODEL, hw, pp=8, layer_split="balanced").layers == (10,) * 8


def test_balanced_split_in_a_simulated_run_serves_faster_with_no_stage_busier():
    common = ["policy=vllm", "workload=synthetic", "workload.arrival=offline", "workload.num_requests=200",
              "workload.input_mean=800", "workload.output_mean=100", "hardware=l20-48g", "hardware.mem_gib=24",
              "model=llama-3.1-70b", "parallel.pp=8", "output.mlflow=false"]
    runs = {}
    for split in ("null", "balanced"):
        res = run_experiment(compose_spec([*common, f"parallel.layer_split={split}"]))
        assert res.error is None
        runs[split] = res
    even, bal = runs["null"], runs["balanced"]
    assert bal.info["kv_num_blocks"] > even.info["kv_num_blocks"]
    assert bal.info["layers_per_stage"] == [9, 11, 11, 10, 10, 10, 10, 9]
    busiest = [max(u * r.summary["duration_s"] for u in r.summary["stage_utilization"]) for r in (even, bal)]
    assert busiest[1] <= busiest[0]  # the same work: no stage busier than the even split's busiest
    assert bal.summary["throughput_tok_s"] >= even.summary["throughput_tok_s"]


def test_the_torch_engine_loads_the_balanced_split():
    from engine.core.executor import EXECUTORS, ExecutorBuild
    from engine.core.policy import POLICIES, RuntimeFeatures
    from engine.core.trace import Tracer
    from engine.base.settings import Link
    from engine.torch_exec.settings import TorchSettings
    from testbed.run.runner import build_cost_model

    spec = compose_spec(["executor=torch", "model=tiny-llama", "parallel.pp=2", "parallel.layer_split=balanced",
                         "hardware=l20-48g"])
    cost = build_cost_model(spec)
    ex = EXECUTORS.get("torch").factory(TorchSettings(), ExecutorBuild(
        cost, RuntimeFeatures(), Link(1e9, 0.0), POLICIES.get("sarathi")(), Tracer(), spec.settings))
    try:
        n = get_model("tiny-llama").num_layers
        assert [k for _, k in ex._layer_ranges(n)] == list(cost.layers) and sum(cost.layers) == n
    finally:
        ex.shutdown()


def test_a_bad_split_name_is_one_error_line():
    with pytest.raises(ConfigError, match="layer_split"):
        compose_spec(["parallel.layer_split=lopsided"]).settings
