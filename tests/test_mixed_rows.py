"""A mixed step's price corrected by its sampled rows (`calibrate runs --mixed-by-rows`, issue 47):
the fit recovers a known term per stage and row count, the cost model adds it to steps with a
prefill chunk and nothing else, and a bad value is one `error:` line (engine/pricing/mixed_rows.py)."""
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
from testbed.calibrate.decode_batch_fit import MIN_SAMPLES
from testbed.calibrate.mixed_rows_fit import extra_row, fit_mixed_rows
from testbed.cli import main

TRUTH_MS = ([-0.7, 0.1, 0.4, 1.0, None, 1.1], [0.0, 0.3, -0.2, 2.0, None, 0.5])  # rows 0..5; None: too few


def _cost(pp: int = 2, **terms) -> CostModel:
    """tiny-llama on a CPU-like roofline (0.1 TFLOP/s, 46 GB/s, as the shared CPU's profiles): a mixed
    step of 32-256 tokens costs milliseconds, as on the engine."""
    hw = dataclasses.replace(get_hardware("a100-80g"), kernels=None, calibration={}, peak_tflops=0.1, mem_bw_gbs=46.0)
    return CostModel(get_model("tiny-llama"), hw, pp, coefficients=CostCoefficients(**terms))


def _mixed(rows: int, tokens: int) -> BatchShape:
    """A 64-token chunk that ends its prompt (when rows > 0) beside `rows` - 1 decodes, or a chunk
    alone that does not (rows 0); `tokens` moves the chunk's size."""
    if rows == 0:
        return BatchShape.from_parts([(0, tokens, False)])
    return BatchShape.from_parts([(0, tokens, True)], [300] * (rows - 1))


def _samples(cost: CostModel, seed: int = 1) -> list:
    """Mixed forwards priced by `cost` + TRUTH_MS +-0.2 ms of noise at chunk sizes 32-256 (4 rows:
    too few to count), and decode-only steps 3x their price (which the correction must ignore)."""
    rng, out = random.Random(seed), []
    for stage, row in enumerate(TRUTH_MS):
        for rows, x in enumerate(row):
            for i in range(5 if x is None else MIN_SAMPLES + 10):
                shape = _mixed(rows, 32 * (1 + i % 8))
                extra = 1e-3 * ((x if x is not None else 9.0) + rng.uniform(-0.2, 0.2))
                out.append(SimpleNamespace(kind="mixed", stage=stage, shape=shape,
                                           time_s=cost.stage_compute_s(stage, shape) + extra))
        d = BatchShape.decode(3, 300)
        out += [SimpleNamespace(kind="decode", stage=stage, shape=d, time_s=3 * cost.stage_compute_s(stage, d))] * 40
    return out


def test_the_fit_recovers_a_known_term_per_stage_and_row_count():
    cost = _cost()
    table = fit_mixed_rows(_samples(cost), cost)
    assert len(table) == 2
    for row, truth in zip(table, TRUTH_MS):
        assert len(row) == 6
        for r, (got, want) in enumerate(zip(row, truth)):
            if want is not None:
                assert 1e3 * got == pytest.approx(want, abs=0.08), (r, row)
        # 5 forwards at 4 rows (9 ms off) are too few: 4 is interpolated between 3 and 5
        assert row[4] == pytest.approx((row[3] + row[5]) / 2, abs=1e-6)


def test_a_count_without_enough_forwards_gets_no_term_and_below_the_smallest_is_held():
    assert extra_row({1: [0.001] * (MIN_SAMPLES - 1)}) == [0.0]
    assert extra_row({2: [0.001] * MIN_SAMPLES, 4: [0.003] * MIN_SAMPLES}) == [0.001, 0.001, 0.001, 0.002, 0.003]


def test_a_stall_is_not_a_steps_cost():
    cost = _cost(pp=1)
    shape = _mixed(2, 64)
    price = cost.stage_compute_s(0, shape)
    base = [SimpleNamespace(kind="mixed", stage=0, shape=shape, time_s=price + 1e-3)] * MIN_SAMPLES
    stalls = [SimpleNamespace(kind="mixed", stage=0, shape=shape, time_s=10 * price)] * 5
    assert fit_mixed_rows(base + stalls, cost)[0][2] == pytest.approx(1e-3, abs=1e-9)


def test_the_cost_model_adds_the_term_to_mixed_steps_only_and_holds_the_last():
    plain, fixed = _cost(), _cost(mixed_row_extra_s=[[-0.001, 0.002], [0.004]])
    for rows, x0 in ((0, -0.001), (1, 0.002), (7, 0.002)):
        shape = _mixed(rows, 96)
        assert fixed.stage_compute_s(0, shape) == pytest.approx(plain.stage_compute_s(0, shape) + x0)
        assert fixed.stage_compute_s(-1, shape) == pytest.approx(plain.stage_compute_s(1, shape) + 0.004)
        assert fixed.stage_compute_all_s(shape) == (fixed.stage_compute_s(0, shape), fixed.stage_compute_s(1, shape))
    for n in (1, 3, 9):
        d = BatchShape.decode(n, 300)
        assert fixed.stage_compute_all_s(d) == plain.stage_compute_all_s(d)
        assert fixed.stage_compute_s(1, d) == plain.stage_compute_s(1, d)


def test_a_negative_term_never_prices_a_step_below_a_third_of_its_price():
    plain, fixed = _cost(pp=1), _cost(pp=1, mixed_row_extra_s=[[-10.0]])
    shape = _mixed(1, 64)
    assert fixed.stage_compute_s(0, shape) == pytest.approx(plain.stage_compute_s(0, shape) / 3)


def test_off_by_default_the_cost_model_keeps_its_plain_methods():
    assert CostCoefficients().mixed_row_extra_s == ()
    assert _cost().stage_compute_s.__func__ is CostModel.stage_compute_s


@pytest.mark.parametrize("bad", [[[]], [[0.001, float("nan")]], [0.001], [[True]], "0.001"])
def test_a_bad_term_is_refused(bad):
    with pytest.raises(ConfigError, match="mixed_row_extra_s"):
        CostCoefficients(mixed_row_extra_s=bad)


def test_a_profile_fitted_at_another_depth_is_one_error_line(tmp_path, monkeypatch, capsys):
    from testbed.calibrate.fit import save_hardware_profile

    hw = get_hardware("a100-80g")
    spec = dataclasses.replace(hw, name="mbr-test", calibration=dict(hw.calibration or {},
                                                                     mixed_row_extra_s=[[0.001, -0.0005]]))
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path / "profiles"))
    path = save_hardware_profile(spec, tmp_path / "profiles" / "mbr-test.yaml")
    assert yaml.safe_load(path.read_text())["calibration"]["mixed_row_extra_s"] == [[0.001, -0.0005]]
    code = main(["run", f"output.dir={tmp_path / 'out'}", "output.mlflow=false", "output.plots=false",
                 "output.progress=false", "workload=synthetic", "workload.num_requests=20", "model=tiny-llama",
                 "hardware=mbr-test", "parallel.pp=2"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert "mixed_row_extra_s" in err and "parallel.pp=2" in err, err


def test_calibrate_runs_mixed_by_rows_stores_the_terms_and_the_profile_prices_with_them(tmp_path, monkeypatch):
    """End to end on a simulated CPU run whose mixed steps cost a known amount more at 1 and 3 sampled
    rows (a bump no smooth term of the forward fit absorbs): the option writes one row of terms, and
    the saved profile, loaded back, prices the fit run's mixed forwards of each well-sampled row count
    at their mean (measured - priced 0 there)."""
    from correction_fit import fit_correction, forget
    from testbed.calibrate.mixed_rows_fit import mixed_residuals
    from testbed.calibrate.run_fit import fit_runs
    from testbed.calibrate.runs import load_run

    try:
        f = fit_correction(tmp_path, monkeypatch, "mbr", [
            "policy=sarathi", "workload.num_requests=40", "workload.input_mean=500", "workload.output_dist=uniform",
            "workload.output_min=4", "workload.output_max=60", "policy.token_budget=64", "policy.max_num_seqs=4"],
            "cost.mixed_row_extra_s=[[0.0, 0.006, 0.0, 0.003, 0.0]]", "--mixed-by-rows", "mixed_row_extra_s")
        rows = f.table
        assert f.saved["profile"]["mixed_by_rows"] is True and len(rows) == 1
        before, after = mixed_residuals(f.samples, f.plain)[0], mixed_residuals(f.samples, f.cost)[0]
        counted = [r for r, v in before.items() if len(v) >= MIN_SAMPLES]
        assert 1 in counted and 2 in counted, sorted((r, len(v)) for r, v in before.items())
        # the forward fit's smooth terms absorb part of the bump at 1 row, not all of it ...
        assert rows[0][1] > rows[0][2] + 0.003, rows
        # ... and the terms take the rest: every well-sampled count priced at its mean
        for r in counted:
            assert sum(after[r]) / len(after[r]) == pytest.approx(0.0, abs=2e-4), r
        # refitted on that profile as its base without the option: its correction is not carried over
        fitted = get_hardware("mbr-fit")
        assert "mixed_row_extra_s" not in fit_runs([load_run(f.run_dir, need_trace=True)], fitted).coefficients
    finally:
        forget("mbr")
