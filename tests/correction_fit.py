"""A per-stage price correction fitted end to end (`calibrate runs --decode-by-batch` and
`--mixed-by-rows`): a simulated CPU run carrying a known correction, fitted by the CLI with the
option, the saved profile loaded back with and without its table."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine.pricing.cost_coefficients import TABLE_FIELDS
from engine.pricing.costmodel import CostCoefficients, CostModel
from engine.pricing.hardware import HARDWARE, get_hardware
from engine.pricing.models import get_model

RUN_OUTPUTS = ["kv.num_blocks=4096", "output.mlflow=false", "output.plots=false", "output.progress=false",
               "output.trace=full", "output.microbatches=true", "cost.stage_overhead_s=4e-3",
               "cost.memory_efficiency=0.3"]


@dataclass
class FittedCorrection:
    saved: dict  # the profile's YAML
    table: list  # its calibration[<table field>]
    cost: CostModel  # the fitted profile, with its correction
    plain: CostModel  # the same without it
    samples: list  # the fit run's forwards (run_fit.ForwardSample)
    run_dir: Path


def fit_correction(tmp_path: Path, monkeypatch, prefix: str, run_values: list[str], truth: str, option: str,
                   field: str) -> FittedCorrection:
    """Simulate tiny-llama P=1 on a roofline CPU-like base `<prefix>-cpu` with `run_values` and the
    correction `truth` (an override), write it as a CPU engine run, fit `<prefix>-fit` with `option`,
    and load it back; the caller pops the two profiles from HARDWARE (`forget`)."""
    from test_calibrate_runs import as_cpu_engine_run
    from testbed.calibrate.fit import save_hardware_profile
    from testbed.calibrate.run_fit import engine_samples
    from testbed.calibrate.runs import load_run
    from testbed.cli import main
    from testbed.config.composer import load_saved_profiles
    from testbed.config.overrides import merge
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    cpu = dataclasses.replace(get_hardware("a100-80g"), name=f"{prefix}-cpu", kernels=None, calibration={})
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path / "profiles"))
    save_hardware_profile(cpu, tmp_path / "profiles" / f"{prefix}-cpu.yaml")
    res = run_experiment(compose_spec(merge(
        ["executor=sim", "model=tiny-llama", f"hardware={prefix}-cpu", "parallel.pp=1", "workload=synthetic",
         "workload.arrival=offline", f"output.dir={tmp_path}", *RUN_OUTPUTS, *run_values], [truth])))
    run_dir = as_cpu_engine_run(res, tmp_path / "cpu")
    assert main(["calibrate", "runs", str(run_dir), "--base", f"{prefix}-cpu", "--name", f"{prefix}-fit", option,
                 "--out", str(tmp_path / "profiles")]) == 0
    saved = yaml.safe_load((tmp_path / "profiles" / f"{prefix}-fit.yaml").read_text())
    load_saved_profiles()
    fitted = get_hardware(f"{prefix}-fit")
    cost = CostModel(get_model("tiny-llama"), fitted, 1, coefficients=CostCoefficients(**fitted.calibration))
    off = () if field in TABLE_FIELDS else 0.0  # a per-stage table, or one number
    plain = CostModel(get_model("tiny-llama"), fitted, 1,
                      coefficients=CostCoefficients(**dict(fitted.calibration, **{field: off})))
    samples = engine_samples([load_run(run_dir, need_trace=True)], cost).forward
    return FittedCorrection(saved, saved["calibration"][field], cost, plain, samples, run_dir)


def forget(prefix: str) -> None:
    for name in (f"{prefix}-cpu", f"{prefix}-fit"):
        HARDWARE.pop(name, None)
