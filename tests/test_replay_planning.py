"""A replay of a real run plans with the run's own cost model (issue 47).

The engine's policy reads `view.cost_model` (TD-Pipe's decode -> prefill switch, MoLink's
in-flight count) built from the run's `hardware`; the simulated replay prices the run with the
profile fitted to the engine. Given that profile to plan with too, TD-Pipe switched phases at
other points than the engine did: at P=2, Azure 9 req/s (CPU, tiny-llama) the replay's TTFT was
+199% off (diagnosis run pp2-azhi-tdpipe-d1), +12.5% when it plans with the run's hardware.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from testbed.config.composer import load_saved_profiles
from testbed.config.spec import compose_spec
from testbed.run.runner import prepare_experiment

CPU_PROFILE = "cpu-tiny-llama-pp2-runs"  # fitted to the engine on CPU (measurements/cpu-tiny-llama)

COMMON = ["executor=sim", "model=tiny-llama", "parallel.pp=2", "kv.num_blocks=512", "workload=synthetic",
          "workload.num_requests=40", "workload.arrival=offline", "output.mlflow=false", "output.plots=false",
          "output.progress=false", "output.trace=off", "seed=0"]


def _spec(hardware: str, policy: str = "tdpipe"):
    return compose_spec(COMMON + [f"hardware={hardware}", f"policy={policy}", "policy.history=run"])


@pytest.fixture(autouse=True)
def _cpu_profile(monkeypatch):
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(Path(__file__).parents[1] / "measurements/cpu-tiny-llama/profiles"))
    load_saved_profiles()


def test_the_policy_sees_the_planning_runs_cost_model_and_the_executor_prices_with_its_own():
    priced, planned = _spec(CPU_PROFILE), _spec("l20-48g")
    prep = prepare_experiment(priced, planning=planned)
    assert prep.controller.cost_model.hardware.name == "l20-48g"
    assert prep.cost.hardware.name == CPU_PROFILE
    assert prepare_experiment(priced).controller.cost_model.hardware.name == CPU_PROFILE
    # MoLink's in-flight count reads the link: the planning run's (l20's PCIe), not the fitted CPU one
    assert prep.controller.view.link_bandwidth_Bps == 20.8e9


def test_tdpipe_decides_with_the_planning_cost_model():
    """Same pricing, another cost model to plan with: other phase switches, other results."""
    priced = _spec(CPU_PROFILE)
    own = prepare_experiment(priced).run()
    other = prepare_experiment(priced, planning=_spec("l20-48g")).run()
    same = prepare_experiment(priced, planning=_spec(CPU_PROFILE)).run()
    assert same.summary == own.summary
    assert [m["kind"] for m in other.microbatches] != [m["kind"] for m in own.microbatches]
