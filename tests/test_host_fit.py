"""The host-overhead fit (testbed/calibrate/host_fit.py): by code version, TP class and vocabulary,
held-out models declared before fitting (issue 46 item 2)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.pricing.profile_table import ProfileRow, ProfileTable
from testbed.calibrate.host_fit import HELD_OUT_MODELS, error_rows, fit_host_model

VOCAB = {"a/Small-32k": 32000, "b/Big-152k": 152064, "c/Mid-51k": 51200, "internlm/internlm-20b": 103168,
         "meta-llama/Llama-2-70b-hf": 32000}
# true costs (ms): per (commit, TP class) fixed and per-sequence; sampling per sequence x 32k entries
TRUE = {"prepare": {("v1", "1"): (0.3, 0.005), ("v1", "2"): (0.8, 0.006), ("v2", "1"): (0.15, 0.002)},
        "schedule": {("v1", "1"): (0.03, 0.015), ("v1", "2"): (0.04, 0.016), ("v2", "1"): (0.01, 0.003)},
        "sample": {("v1", "1"): (0.5, 0.004), ("v1", "2"): (0.9, 0.004), ("v2", "1"): (0.6, 0.002)}}


def _tables(noise: float = 0.0) -> list[ProfileTable]:
    rng = np.random.default_rng(0)
    out = []
    for commit, tp in (("v1", 1), ("v1", 2), ("v2", 1)):
        for model, vocab in VOCAB.items():
            rows = []
            for batch in (8, 16, 32, 64, 128):
                for op, groups in TRUE.items():
                    fixed, per = groups[(commit, "1" if tp == 1 else "2")]
                    ms = fixed + per * batch * (vocab / 32000 if op == "sample" else 1)
                    rows.append(ProfileRow(op, None, "decode", batch, 0, 0, 256, 0,
                                           ms * 1e-3 * (1 + noise * rng.standard_normal()), tp=tp))
            out.append(ProfileTable(rows, {"model": model, "source": f"cpu_overheads/a100-{commit}.csv"}))
    return out


def _vocab_of(model: str) -> int:
    return VOCAB[model]


def test_the_fit_recovers_costs_by_version_tp_and_vocabulary():
    model = fit_host_model(_tables(), _vocab_of)
    assert model.fixed["prepare"][("v1", "2")] == pytest.approx(0.8e-3, rel=1e-3)
    assert model.per_seq["schedule"][("v2", "1")] == pytest.approx(0.003e-3, rel=1e-3)
    assert model.per_seq_vocab[("v1", "2")] == pytest.approx(0.004e-3, rel=1e-3)


def test_held_out_models_are_predicted_not_fitted():
    """The held-out models (a 103k vocabulary between the fitted ones, and a TP-2 model) are in no
    fit; with 5% noise on every row their rows are still predicted within 5% at the median."""
    assert set(HELD_OUT_MODELS) == {"internlm-20b", "Llama-2-70b-hf"}
    tables = _tables(noise=0.05)
    model = fit_host_model(tables, _vocab_of)
    rows = error_rows(tables, model, _vocab_of)
    held = [r for r in rows if r["held"]]
    assert held and {r["model"].split("/")[-1] for r in held} == set(HELD_OUT_MODELS)
    err = np.array([r["fitted"] / r["measured"] - 1 for r in held])
    assert np.median(np.abs(err)) < 0.05 and abs(np.median(err)) < 0.03


def test_one_line_for_every_version_misses_what_the_groups_fit():
    """What the groups are for: one fixed + per-sequence line over both versions and TP classes
    (the earlier fit) is off by far more than the grouped one on the same rows."""
    tables = _tables()
    rows = error_rows(tables, fit_host_model(tables, _vocab_of), _vocab_of)
    grouped = np.median([abs(r["fitted"] / r["measured"] - 1) for r in rows])
    errs = []
    for op in TRUE:
        y = np.array([r["measured"] for r in rows if r["bucket"] == op])
        x = np.array([r["x"] for r in rows if r["bucket"] == op], dtype=float)
        a = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
        coef, *_ = np.linalg.lstsq(a, np.ones_like(y), rcond=None)
        errs += list(np.abs(a @ coef - 1))
    one_line = np.median(errs)
    assert grouped < 0.01 < 0.1 < one_line


@pytest.mark.parametrize("device", ["a100", "a40"])
def test_the_published_host_tables_meet_the_target_held_out(device):
    """Issue 46's target on the published tables' held-out rows: median <= 15%, |bias| <= 5%
    (2026-11-27: A100 6.1% / +2.5%, A40 10.7% / -2.4%)."""
    from test_kernel_costs import SHARED, needs_tables  # the shared tables, found as that module finds them

    if SHARED is None:
        needs_tables(lambda: None)
        pytest.skip("the published GPU tables are not in the data directory")
    from testbed.calibrate.gpu_tables import read_published
    from testbed.calibrate.tables import _vocab_of

    t = read_published(SHARED, device)
    lm_head = _shipped_lm_head(t)
    rows = error_rows(t.host, fit_host_model(t.host, _vocab_of(t), lm_head), _vocab_of(t), lm_head)
    err = np.array([r["fitted"] / r["measured"] - 1 for r in rows if r["held"]])
    assert len(err) > 100 and np.median(np.abs(err)) <= 0.15 and abs(np.median(err)) <= 0.05


def _shipped_lm_head(t):
    """The lm_head price of the device's shipped profile (its fitted kernels) on the links of the
    node the host tables were measured in (fitted here from the device's NCCL tables)."""
    from types import SimpleNamespace

    from engine.pricing.hardware import get_hardware
    from testbed.calibrate.kernel_fit import fit_link
    from testbed.calibrate.tables import DEVICE_HARDWARE, host_table_spec, lm_head_pricer

    links = {f"{name}/{link}": fit_link([r for r in table.rows if r.link == link])
             for name, table in t.network.items() for link in {r.link for r in table.rows}}
    hw = host_table_spec(SimpleNamespace(links=links), t, get_hardware(DEVICE_HARDWARE[t.device]))
    return lm_head_pricer(hw, t)


def test_the_lm_head_in_the_sample_rows_is_not_fitted_twice():
    """The tables' sampler rows hold the lm_head GEMM (Sarathi's `Sampler.forward` computes the
    logits; the cost model prices them in the last stage's forward). Rows built as true sampling +
    an lm_head price: the fit recovers the true sampling alone, and fit + lm_head meets the rows."""
    lm = lambda model, tp, rows: (0.2e-3 + 1e-6 * rows) * VOCAB[model] / 32000 / tp  # noqa: E731
    tables = _tables()
    for t in tables:
        t.rows[:] = [r if r.op != "sample" else
                     ProfileRow(r.op, None, "decode", r.batch, 0, 0, 256, 0, r.time_s + lm(t.meta["model"], r.tp, r.batch),
                                tp=r.tp) for r in t.rows]
    model = fit_host_model(tables, _vocab_of, lm)
    assert model.fixed["sample"][("v1", "2")] == pytest.approx(0.9e-3, rel=1e-3)
    assert model.per_seq_vocab[("v2", "1")] == pytest.approx(0.002e-3, rel=1e-3)
    rows = error_rows(tables, model, _vocab_of, lm)
    assert max(abs(r["fitted"] / r["measured"] - 1) for r in rows) < 1e-3
    naive = fit_host_model(tables, _vocab_of)  # the double count: the lm_head left in the fit
    assert naive.fixed["sample"][("v1", "2")] > 1.05 * model.fixed["sample"][("v1", "2")]


def test_cpu_sampling_is_priced_from_the_committed_measurement():
    """The CPU sampler's per-entry cost is the fit of engine/pricing/measured/cpu_sampler.json for
    SiPipe's settings (penalties on), measured with its provenance, not a hand-set constant."""
    import json
    from pathlib import Path

    from engine.pricing.cost_coefficients import CostCoefficients

    rec = json.loads((Path(__file__).resolve().parents[1] / "engine/pricing/measured/cpu_sampler.json").read_text())
    assert {"date", "commit", "cpu", "torch", "command", "points"} <= set(rec)
    fit = rec["fit"]["top_p_top_k_penalties"]
    assert CostCoefficients().cpu_sample_per_token_vocab_s == pytest.approx(fit["cpu_sample_per_token_vocab_s"])
    assert CostCoefficients().cpu_sample_per_row_s == pytest.approx(fit["cpu_sample_per_row_s"])
    greedy = rec["fit"]["greedy"]["cpu_sample_per_token_vocab_s"]
    assert fit["cpu_sample_per_token_vocab_s"] > 10 * greedy  # topk + penalties: a few passes more
    assert fit["median_error"] < 0.1  # with the per-row term (20% without it)


def test_the_cpu_sampler_fit_has_a_per_row_term_that_the_points_need(tmp_path):
    """Refitting the stored points gives the stored fit; the per-row cost is what a row costs
    whatever its vocabulary (32k and 152k rows of one setting share it)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    rec = json.loads((root / "engine/pricing/measured/cpu_sampler.json").read_text())
    copy = tmp_path / "s.json"
    copy.write_text(json.dumps(rec))
    subprocess.run([sys.executable, str(root / "scripts/measure_cpu_sampler.py"), "--refit", str(copy)], check=True,
                   capture_output=True)
    again = json.loads(copy.read_text())["fit"]
    for name, f in rec["fit"].items():
        assert again[name]["cpu_sample_per_row_s"] == pytest.approx(f["cpu_sample_per_row_s"], rel=1e-6)
    assert rec["fit"]["top_p_top_k_penalties"]["cpu_sample_per_row_s"] > 1e-5
