"""The decode-only price corrected by batch size (`calibrate runs --decode-by-batch`, issue 47):
the fit recovers a known factor per stage and batch size, the cost model scales decode-only steps
and nothing else, and a bad value is one `error:` line (engine/pricing/decode_batch.py)."""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import yaml

from engine.base.errors import ConfigError
from engine.pricing.costmodel import BatchShape, CostCoefficients, CostModel
from engine.pricing.hardware import get_hardware
from engine.pricing.models import get_model
from testbed.calibrate.decode_batch_fit import MIN_SAMPLES, factor_row, fit_decode_batch
from testbed.cli import main

TRUTH = ([1.10, 0.82, 0.79, 1.12, 1.15, 1.11, None, 0.97], [0.90, 1.05, 1.20, 1.00, 0.95, 0.93, None, 1.02])


def _cost(pp: int = 2, **terms) -> CostModel:
    hw = get_hardware("a100-80g")
    return CostModel(get_model("tiny-llama"), hw, pp, coefficients=CostCoefficients(**dict(hw.calibration or {}, **terms)))


def _samples(cost: CostModel, seed: int = 1) -> list:
    """Decode forwards priced by `cost` x TRUTH x +-4% noise (batch size 7: too few to count), and
    mixed steps 3x their price (which the correction must ignore)."""
    rng, out = random.Random(seed), []
    for stage, row in enumerate(TRUTH):
        for n, f in enumerate(row, start=1):
            shape = BatchShape.decode(n, 200 + 10 * n)
            count = 5 if f is None else MIN_SAMPLES + 10
            for _ in range(count):
                noise = 1.0 + rng.uniform(-0.04, 0.04)
                out.append(SimpleNamespace(kind="decode", stage=stage, shape=shape,
                                           time_s=cost.stage_compute_s(stage, shape) * (f or 2.0) * noise))
        mixed = BatchShape.from_parts([(0, 64, True)], [300] * 3)
        out += [SimpleNamespace(kind="mixed", stage=stage, shape=mixed, time_s=3 * cost.stage_compute_s(stage, mixed))] * 40
    return out


def test_the_fit_recovers_a_known_factor_per_stage_and_batch_size():
    cost = _cost()
    rows = fit_decode_batch(_samples(cost), cost)
    assert len(rows) == 2
    for row, truth in zip(rows, TRUTH):
        assert len(row) == 8
        for n, (got, want) in enumerate(zip(row, truth), start=1):
            if want is not None:
                assert got == pytest.approx(want, rel=0.02), (n, row)
        # 5 forwards of 7 sequences (2x their price) are too few: 7 is interpolated between 6 and 8
        assert row[6] == pytest.approx((row[5] + row[7]) / 2, abs=1e-4)


def test_a_size_without_enough_forwards_gets_no_factor_and_below_the_smallest_is_held():
    assert factor_row({1: [1.5] * (MIN_SAMPLES - 1)}) == [1.0]
    # a stall (10x its price) is not a step's cost: left out of the mean, and not counted
    assert factor_row({1: [1.2] * MIN_SAMPLES + [10.0] * 5}) == [1.2]
    assert factor_row({1: [1.2] * (MIN_SAMPLES - 1) + [10.0] * 5}) == [1.0]
    assert factor_row({3: [0.8] * MIN_SAMPLES, 5: [1.2] * MIN_SAMPLES}) == [0.8, 0.8, 0.8, 1.0, 1.2]


def test_the_cost_model_scales_decode_only_steps_and_holds_the_last_factor():
    plain, scaled = _cost(), _cost(decode_batch_factors=[[0.5, 2.0], [1.5]])
    for n, f0 in ((1, 0.5), (2, 2.0), (9, 2.0)):
        d = BatchShape.decode(n, 300)
        assert scaled.stage_compute_s(0, d) == pytest.approx(f0 * plain.stage_compute_s(0, d))
        assert scaled.stage_compute_s(-1, d) == pytest.approx(1.5 * plain.stage_compute_s(1, d))
        assert scaled.stage_compute_all_s(d) == (scaled.stage_compute_s(0, d), scaled.stage_compute_s(1, d))
    for shape in (BatchShape.from_parts([(0, 64, True)], [300] * 2), BatchShape.prefill(128)):
        assert scaled.stage_compute_all_s(shape) == plain.stage_compute_all_s(shape)
    d = BatchShape.decode(2, 300)
    assert scaled.sample_s(d) == plain.sample_s(d) and scaled.prep_s(d) == plain.prep_s(d)


def test_off_by_default_the_cost_model_keeps_its_plain_methods():
    assert CostCoefficients().decode_batch_factors == ()
    assert _cost().stage_compute_s.__func__ is CostModel.stage_compute_s


@pytest.mark.parametrize("bad", [[[0.0]], [[]], [[1.0, -2.0]], [1.0]])
def test_a_bad_factor_is_refused(bad):
    with pytest.raises(ConfigError, match="decode_batch_factors"):
        CostCoefficients(decode_batch_factors=bad)


def test_a_profile_fitted_at_another_depth_is_one_error_line(tmp_path, monkeypatch, capsys):
    from testbed.calibrate.fit import save_hardware_profile

    hw = get_hardware("a100-80g")
    spec = dataclasses.replace(hw, name="dbb-test", calibration=dict(hw.calibration or {},
                                                                     decode_batch_factors=[[1.1, 0.9]]))
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path / "profiles"))
    path = save_hardware_profile(spec, tmp_path / "profiles" / "dbb-test.yaml")
    assert yaml.safe_load(path.read_text())["calibration"]["decode_batch_factors"] == [[1.1, 0.9]]
    code = main(["run", f"output.dir={tmp_path / 'out'}", "output.mlflow=false", "output.plots=false",
                 "output.progress=false", "workload=synthetic", "workload.num_requests=20", "model=tiny-llama",
                 "hardware=dbb-test", "parallel.pp=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert "decode_batch_factors" in err and "parallel.pp=2" in err, err


def test_calibrate_runs_decode_by_batch_stores_the_factors_and_the_profile_prices_with_them(tmp_path, monkeypatch):
    """End to end on a simulated CPU run whose decodes of 4 sequences cost 1.3x the roofline (a bump
    no smooth term of the forward fit absorbs): the
    option writes one row of factors, and the saved profile, loaded back, prices the fit run's
    decode forwards of each well-sampled size at their mean (measured / priced 1 there)."""
    from correction_fit import fit_correction, forget
    from testbed.calibrate.decode_batch_fit import decode_ratios
    from testbed.calibrate.run_fit import fit_runs
    from testbed.calibrate.runs import load_run

    try:
        f = fit_correction(tmp_path, monkeypatch, "dbb", [
            "policy=gllm", "workload.num_requests=5", "workload.input_mean=64", "workload.output_dist=uniform",
            "workload.output_min=40", "workload.output_max=400"],
            "cost.decode_batch_factors=[[1.0, 1.0, 1.0, 1.3, 1.0]]", "--decode-by-batch", "decode_batch_factors")
        rows = f.table
        assert f.saved["profile"]["decode_by_batch"] is True and len(rows) == 1
        before, after = decode_ratios(f.samples, f.plain)[0], decode_ratios(f.samples, f.cost)[0]
        sized = [n for n, v in before.items() if len(v) >= MIN_SAMPLES]
        assert 2 in sized and 4 in sized, sorted((n, len(v)) for n, v in before.items())
        # the forward fit's smooth terms absorb part of the bump at 4 sequences, not all of it ...
        assert max(abs(sorted(before[n])[len(before[n]) // 2] - 1.0) for n in sized) > 0.05, rows
        assert rows[0][3] > rows[0][2] * 1.1, rows  # 4 sequences dearer than 3 beyond the smooth terms
        # ... and the factors take the rest: every well-sampled size priced at its mean
        for n in sized:
            assert sum(after[n]) / len(after[n]) == pytest.approx(1.0, abs=0.005), n
        # refitted on that profile as its base without the option: its correction is not carried over
        fitted = get_hardware("dbb-fit")
        assert "decode_batch_factors" not in fit_runs([load_run(f.run_dir, need_trace=True)], fitted).coefficients
    finally:
        forget("dbb")
