"""The fit on a synthetic GPU: measurements from a known H100-like ground truth that is not the
cost model (testbed/calibrate/synthetic.py), +-3% seeded noise, judged on held-out points."""
from __future__ import annotations

import pytest

from engine.pricing.profile_table import ProfileRow, parse_profile, read_profile, write_profile

from testbed.calibrate.fit import CLASSIC_FORWARD_PARAMS, GPU_FORWARD_PARAMS, fit_profile, forward_errors
from testbed.calibrate.synthetic import HELDOUT_GRID, GpuTruth, synthetic_gpu_profile, truth_forward_s
from engine.pricing.costmodel import BatchShape
from engine.base.errors import ConfigError
from engine.pricing.models import get_model
from engine.pricing.profile_grid import GRIDS, ProfileGrid, design, get_grid

MODEL = get_model("qwen2.5-7b")


@pytest.fixture(scope="module")
def fitted():
    truth = GpuTruth()
    hw = truth.hardware()
    table = synthetic_gpu_profile(MODEL, GRIDS["serving"], truth, seed=1)
    held = synthetic_gpu_profile(MODEL, HELDOUT_GRID, truth, seed=2).select("forward")
    new = fit_profile(table, MODEL, hw, 1, classic=True)
    old = fit_profile(table, MODEL, hw, 1, forward_params=CLASSIC_FORWARD_PARAMS)
    return hw, held, new, old


def test_new_terms_fit_a_gpu_on_held_out_points(fitted):
    hw, held, new, _ = fitted
    assert set(GPU_FORWARD_PARAMS) <= set(new.coefficients)
    err = forward_errors(held, MODEL, hw, 1, None, new.coefficients)
    assert err["n"] == len(held) >= 30
    assert err["median_abs_rel"] <= 0.10
    assert err["max_abs_rel"] <= 0.30


def test_classic_model_fails_the_same_bound(fitted):
    hw, held, new, old = fitted
    assert not set(GPU_FORWARD_PARAMS) & set(old.coefficients)
    err = forward_errors(held, MODEL, hw, 1, None, old.coefficients)
    assert err["median_abs_rel"] > 0.10 or err["max_abs_rel"] > 0.30
    # fit_profile(classic=True) reports the same comparison on the fitted table
    assert new.errors["forward_classic"]["median_abs_rel"] > new.errors["forward"]["median_abs_rel"]
    lines = new.summary_lines()
    assert any(line.startswith("  fit error forward ") and line.endswith("met)") for line in lines)
    assert any("forward_classic" in line and line.endswith("missed)") for line in lines)


def test_fitted_terms_point_the_right_way(fitted):
    _, _, new, _ = fitted
    c = new.coefficients
    truth = GpuTruth()
    assert c["kv_read_efficiency"] < c["memory_efficiency"]  # paged KV reads slower than weights
    assert c["kv_read_efficiency"] == pytest.approx(truth.kv_bw_eff, rel=0.25)
    assert c["decode_overhead_ratio"] < 0.5  # graph replay much cheaper than eager launches
    assert 20 < c["linear_half_tokens"] < 1000
    assert 20 < c["attention_half_context"] < 2000


def test_ground_truth_is_not_the_cost_model():
    truth = GpuTruth()
    # GEMM efficiency rises with M: per-token time falls from M=16 to M=4096
    small = truth_forward_s(truth, MODEL, 28, BatchShape.prefill(16, samples=False), False, False)
    big = truth_forward_s(truth, MODEL, 28, BatchShape.prefill(4096, samples=False), False, False)
    assert small > 0 and big / 4096 < small / 16
    # decode-only steps replay a graph: cheaper fixed cost than an eager mixed step of one more token
    d = truth_forward_s(truth, MODEL, 28, BatchShape.decode(8, 64), False, False)
    mixed = truth_forward_s(truth, MODEL, 28, BatchShape.from_parts([(0, 1, False)], [64] * 8), False, False)
    assert mixed - d > 2e-3


def test_noise_is_seeded_and_bounded():
    a = synthetic_gpu_profile(MODEL, GRIDS["quick"], seed=3)
    b = synthetic_gpu_profile(MODEL, GRIDS["quick"], seed=3)
    c = synthetic_gpu_profile(MODEL, GRIDS["quick"], seed=4)
    clean = synthetic_gpu_profile(MODEL, GRIDS["quick"], noise=0.0)
    assert [r.time_s for r in a.rows] == [r.time_s for r in b.rows] != [r.time_s for r in c.rows]
    for r, r0 in zip(a.rows, clean.rows):
        assert abs(r.time_s / r0.time_s - 1) <= 0.03 + 1e-12


def test_serving_grid_covers_what_serving_produces():
    pts = GRIDS["serving"].points()
    dec = [(b, c) for k, b, _, _, c in pts if k == "decode"]
    assert {b for b, _ in dec} == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert {c for _, c in dec} == {64, 256, 1024, 2048, 4096}
    assert all(b * c <= 2 ** 19 for b, c in dec)  # the KV pool must hold every decode batch
    pre = [(x, L) for k, _, x, L, _ in pts if k == "prefill"]
    assert min(x for x, _ in pre) == 16 and max(x for x, _ in pre) == 4096
    assert {L for _, L in pre} == {0, 1024}
    assert sum(k == "mixed" for k, *_ in pts) >= 6
    # the CPU grids are unchanged: same points as before the serving grid existed
    assert len(design(GRIDS["quick"])) == 3 * 2 + 3 * 2
    assert len(design({"prefill_tokens": (8, 32), "prefill_batch": (1,), "prefill_prefix": (0,),
                       "decode_batch": (1,), "decode_context": (16,)})) == 3
    assert get_grid("serving-cpu").max_context() <= 1024
    with pytest.raises(ConfigError, match="unknown profile grid 'huge'; valid choices: default, quick"):
        get_grid("huge")
    with pytest.raises(ConfigError, match="unknown profile grid keys bogus"):
        ProfileGrid.from_mapping({"bogus": (1,)})


def test_mixed_rows_round_trip(tmp_path):
    table = synthetic_gpu_profile(MODEL, GRIDS["serving-cpu"], seed=0)
    mixed = [r for r in table.rows if r.kind == "mixed"]
    assert mixed and all(r.shape().num_decode_seqs == r.batch and r.shape().num_prefill_tokens == r.tokens
                         for r in mixed)
    back = read_profile(write_profile(table, tmp_path / "p.csv"))
    assert [(r.op, r.kind, r.batch, r.tokens, r.context) for r in back.rows] == \
           [(r.op, r.kind, r.batch, r.tokens, r.context) for r in table.rows]
    assert back.meta["grid"] == "serving-cpu"
    head = "op,stage,kind,batch,tokens,prefix,context,nbytes,time_s\n"
    with pytest.raises(ConfigError, match="line 2: a mixed row needs context >= 1"):
        parse_profile(head + "forward,0,mixed,4,16,0,0,0,0.1\n")
    _ = ProfileRow
