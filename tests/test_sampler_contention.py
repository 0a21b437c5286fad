"""SiPipe's CPU-sampling path with a term per stage working beside the samplers (`calibrate runs
--sampler-contention`, set 18's candidate): the fit recovers a known term, the cost model adds it per
busy stage, the simulator counts the stages before the last that are working when the path starts,
and the real runs' count reads the same from their traces."""
from __future__ import annotations

import numpy as np
import pytest

from engine.core.batch import BatchShape
from engine.pricing.costmodel import CostCoefficients, CostModel
from engine.pricing.hardware import get_hardware
from engine.pricing.models import get_model
from testbed.calibrate.cpu_sampling_fit import SamplingPath, fit_cpu_sampling

VOCAB = 32_000
FIXED, PER_VOCAB, PER_BUSY = 0.8e-3, 2.0e-9, 0.9e-3


def _paths(contention: float = PER_BUSY) -> list[SamplingPath]:
    rng = np.random.default_rng(3)
    out = []
    for _ in range(400):
        rows, busy = int(rng.integers(1, 32)), int(rng.integers(0, 2))
        out.append(SamplingPath(rows, 2, FIXED + PER_VOCAB * rows * VOCAB / 2 + contention * busy, busy))
    return out


def test_the_fit_recovers_a_known_term_per_busy_stage():
    got = fit_cpu_sampling(_paths(), VOCAB, return_s=0.0, contention=True)
    assert got["cpu_sample_per_busy_stage_s"] == pytest.approx(PER_BUSY, rel=1e-6)
    assert got["cpu_sample_fixed_s"] == pytest.approx(FIXED, rel=1e-6)
    assert got["cpu_sample_per_token_vocab_s"] == pytest.approx(PER_VOCAB, rel=1e-6)


def test_off_the_busy_stages_are_averaged_into_the_fixed_part_and_no_term_is_written():
    paths = _paths()
    got = fit_cpu_sampling(paths, VOCAB, return_s=0.0)
    assert "cpu_sample_per_busy_stage_s" not in got
    mean_busy = sum(p.busy_stages for p in paths) / len(paths)
    assert got["cpu_sample_fixed_s"] == pytest.approx(FIXED + PER_BUSY * mean_busy, rel=0.05)


def test_a_count_that_never_varies_fits_no_term():
    """At P=1 no stage before the last exists: the term is 0, the rest as without the option."""
    paths = [p._replace(busy_stages=0, seconds=p.seconds - PER_BUSY * p.busy_stages) for p in _paths()]
    on, off = fit_cpu_sampling(paths, VOCAB, 0.0, contention=True), fit_cpu_sampling(paths, VOCAB, 0.0)
    assert on.pop("cpu_sample_per_busy_stage_s") == 0.0
    assert on == pytest.approx(off, rel=1e-9)


def test_the_cost_model_adds_the_term_per_busy_stage():
    hw = get_hardware("a100-80g")
    shape = BatchShape.decode(4, 100)
    plain = CostModel(get_model("tiny-llama"), hw, 2, coefficients=CostCoefficients())
    busy = CostModel(get_model("tiny-llama"), hw, 2, coefficients=CostCoefficients(cpu_sample_per_busy_stage_s=1e-3))
    assert busy.cpu_sample_s(shape, workers=2, busy_stages=0) == plain.cpu_sample_s(shape, workers=2)
    assert busy.cpu_sample_s(shape, workers=2, busy_stages=1) == pytest.approx(plain.cpu_sample_s(shape, 2) + 1e-3)
    assert plain.cpu_sample_s(shape, workers=2, busy_stages=1) == plain.cpu_sample_s(shape, workers=2)


def _sipipe_run(pp: int, overrides: list[str] = ()):
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    return run_experiment(compose_spec([
        "output.mlflow=false", "policy=sipipe", "model=tiny-llama", "hardware=a100-80g", f"parallel.pp={pp}",
        "workload=synthetic", "workload.num_requests=60", "workload.rate=40", *overrides]))


def test_the_simulator_counts_the_stages_before_the_last_working_as_the_path_starts(monkeypatch):
    seen: dict[int, list[int]] = {}
    original = CostModel.cpu_sample_s

    def counting(self, shape, workers=1, sampling=None, busy_stages=0):
        seen.setdefault(self.pp, []).append(busy_stages)
        return original(self, shape, workers, sampling, busy_stages)

    monkeypatch.setattr(CostModel, "cpu_sample_s", counting)
    _sipipe_run(1)
    _sipipe_run(2)
    assert set(seen[1]) == {0}  # no stage before the last
    assert set(seen[2]) == {0, 1}, sorted(set(seen[2]))


def test_a_busy_stage_term_slows_the_pipelined_runs_decode_only_at_p2():
    term = ["cost.cpu_sample_per_busy_stage_s=2e-3"]
    assert _sipipe_run(1, term).summary == _sipipe_run(1).summary  # bit for bit: never a busy stage
    assert _sipipe_run(2, term).summary["tpot_mean_s"] > _sipipe_run(2).summary["tpot_mean_s"]


def test_calibrate_runs_sampler_contention_recovers_the_term_from_a_run(tmp_path, monkeypatch):
    """End to end: a simulated SiPipe P=2 run whose sampling path costs a known 2 ms more per stage
    working beside it, written as a CPU engine run; the traces' count of busy stages and the fit
    give the term back."""
    from correction_fit import fit_correction, forget

    try:
        f = fit_correction(tmp_path, monkeypatch, "smc", [
            "policy=sipipe", "parallel.pp=2", "workload.num_requests=60", "workload.arrival=poisson",
            "workload.rate=40", "cost.cpu_handoff_fixed_s=1e-4", "cost.cpu_sample_fixed_s=5e-4"],
            "cost.cpu_sample_per_busy_stage_s=2e-3", "--sampler-contention", "cpu_sample_per_busy_stage_s")
        assert f.saved["profile"]["sampler_contention"] is True
        assert f.table == pytest.approx(2e-3, rel=1e-3)
    finally:
        forget("smc")
