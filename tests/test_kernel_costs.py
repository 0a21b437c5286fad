"""The measured cost model: reading the published GPU tables, fitting kernel coefficients, pricing
with them, the shipped fitted profiles and `testbed calibrate tables` (docs/calibration.md#measured-kernels)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.pricing.profile_table import parse_profile, write_profile
from engine.pricing.costmodel import BatchShape, CostCoefficients, CostModel
from engine.base.errors import ConfigError
from testbed.calibrate.gpu_tables import read_published
from engine.pricing.hardware import HARDWARE, get_hardware
from testbed.calibrate.kernel_fit import Device, attention_split, fit_kernels, fit_link
from engine.pricing.kernels import KernelCoefficients, LayerKernels, LayerShape
from engine.pricing.models import get_model
from kernel_tables import A100, MODELS, TOKENS, TRUTH, write_tables

DEVICE = Device("a100", **A100)


@pytest.fixture(scope="module")
def tables_dir(tmp_path_factory) -> Path:
    return write_tables(tmp_path_factory.mktemp("tables"))


def test_reader_turns_published_tables_into_profile_rows(tables_dir):
    t = read_published(tables_dir.parent, "a100")
    assert sorted(t.compute) == sorted(MODELS)
    rows = t.compute["Llama-2-7b-hf"].rows
    # 10 ops a token count (two norms) x TOKENS x TP 1 and 2
    assert len(rows) == 10 * len(TOKENS) * 2
    qkv = [r for r in rows if r.op == "gemm_qkv" and r.tp == 2 and r.tokens == 256]
    lk = LayerKernels(LayerShape(4096, 32, 32, 128, 11008, 32000, True, 2), TRUTH, **A100)
    assert qkv[0].time_s == pytest.approx(float(lk.op_s("gemm_qkv", 256)), rel=1e-9)  # ms -> s
    assert sum(r.op == "norm" for r in rows if r.tokens == 1 and r.tp == 1) == 2
    meta = t.compute["Llama-2-70b-hf"].meta
    assert (meta["hidden"], meta["q_heads"], meta["kv_heads"], meta["intermediate"]) == ("8192", "64", "8", "28672")
    att = t.attention[0]
    assert {r.op for r in att.rows} == {"attn_decode", "attn_prefill"}
    dec = [r for r in att.rows if r.op == "attn_decode" and r.batch == 55 and r.context == 1024]
    assert dec[0].tp == 2 and dec[0].time_s == pytest.approx(
        LayerKernels(LayerShape(8192, 64, 8, 128, 28672, 32000, True, 2), TRUTH, **A100).decode_s(55, 55 * 1024))
    sr = t.network["a100_testbox/send_recv"].rows
    assert {r.link for r in sr} == {"node"} and all(r.nbytes >= 2048 for r in sr)
    ar = t.network["a100_testbox/all_reduce"].rows
    assert sorted({r.tp for r in ar}) == [2, 4, 8]
    host = t.host[0]
    assert {r.op for r in host.rows} == {"prepare", "sample", "schedule"}
    assert [r.time_s for r in host.rows if r.op == "schedule" and r.batch == 8] == [pytest.approx(0.074e-3)]


def test_operator_rows_round_trip_through_the_profile_format(tables_dir):
    table = read_published(tables_dir.parent, "a100").network["a100_testbox/all_reduce"]
    text_path = write_profile(table, tables_dir.parent / "ar.csv")
    back = parse_profile(text_path.read_text())
    assert [replace(r, time_s=0.0) for r in back.rows] == [replace(r, time_s=0.0) for r in table.rows]
    assert [r.time_s for r in back.rows] == pytest.approx([r.time_s for r in table.rows], rel=1e-8)
    with pytest.raises(ConfigError, match="line 2: op=attn_decode needs batch >= 1"):
        parse_profile("op,batch,context,time_s\nattn_decode,0,10,1e-5\n")


def test_samples_file_keeps_flash_attention_and_reports_what_it_skips(tmp_path):
    d = tmp_path / "gpu-op-profiles"
    (d / "compute" / "a100").mkdir(parents=True)
    (d / "attention_samples").mkdir()
    (d / "attention_samples" / "a100_x.txt").write_text(
        "# source: x (FLASH_ATTENTION, n_embd 4096, 32 q heads, 8 kv heads)\n"
        "D 1 512 0.002 | 1:0.010 4:0.020\nP 2 256 0.004 | 0:0.050 128:0.070\nDB 4 384 0.002 | 11:0.019\n"
        "# source B: y (FLASHINFER, n_embd 4096, 32 q, 8 kv)\nD 1 64 0.001 | 1:0.5\n")
    from testbed.calibrate.gpu_tables import read_attention_samples

    table, skipped = read_attention_samples(d / "attention_samples" / "a100_x.txt", "a100")
    assert [(r.op, r.tp, r.batch, r.context, r.tokens, r.prefix, r.time_s) for r in table.rows] == [
        ("attn_decode", 1, 1, 512, 0, 0, pytest.approx(10e-6)), ("attn_decode", 1, 4, 512, 0, 0, pytest.approx(20e-6)),
        ("kv_write", 2, 1, 0, 256, 0, pytest.approx(4e-6)), ("attn_prefill", 2, 1, 0, 256, 0, pytest.approx(50e-6)), ("attn_prefill", 2, 1, 0, 256, 128, pytest.approx(70e-6))]
    assert any("'DB'" in s for s in skipped) and any("FLASHINFER" in s for s in skipped)


def test_fit_recovers_known_kernel_coefficients(tables_dir):
    t = read_published(tables_dir.parent, "a100")
    fit = fit_kernels(list(t.compute.values()), t.attention, t.network, t.host, DEVICE,
                      fit_models=("Llama-2-7b-hf", "Llama-2-70b-hf"))
    c = fit.coefficients
    assert c.gemm_token_quantum == TRUTH.gemm_token_quantum
    assert c.decode_waves == TRUTH.decode_waves
    # prefill: with an SM count the fit prices blocks (tests/test_prefill_blocks.py), not the
    # fixture's pairs form (recovered without an SM count in tests/test_kernel_shapes.py)
    for name in ("gemm_compute_efficiency", "gemm_memory_efficiency", "norm_efficiency", "add_efficiency",
                 "decode_floor_s"):
        assert getattr(c, name) == pytest.approx(getattr(TRUTH, name), rel=0.03), name
    assert c.decode_efficiency(8.0) == pytest.approx(0.72, rel=0.02)
    sr = fit.links["a100_testbox/send_recv/node"]
    assert (sr.latency_s, sr.bw_Bps) == (pytest.approx(12e-6, rel=0.02), pytest.approx(200e9, rel=0.02))
    ar = fit.links["a100_testbox/all_reduce/node"]
    assert (ar.latency_s, ar.bw_Bps) == (pytest.approx(5e-6, rel=0.02), pytest.approx(150e9, rel=0.02))
    assert fit.host.schedule_per_seq_s == pytest.approx(3e-6, rel=0.01)
    assert fit.host.prepare_fixed_s == pytest.approx(0.3e-3, rel=0.01)


def test_fit_of_noisy_tables_predicts_the_held_out_model(tmp_path):
    t = read_published(write_tables(tmp_path, noise=0.03, seed=1).parent, "a100")
    fit = fit_kernels(list(t.compute.values()), t.attention, {}, [], DEVICE, fit_models=("Llama-2-7b-hf",))
    held = t.compute["Held-Out-13b"]
    from testbed.calibrate.kernel_fit import layer_shape

    errs = [float(LayerKernels(layer_shape(held.meta, r.tp), fit.coefficients, **A100).op_s(r.op, r.tokens)) / r.time_s - 1
            for r in held.rows]
    assert np.median(np.abs(errs)) < 0.03


def test_attention_split_holds_out_alternate_grid_points(tables_dir):
    table = read_published(tables_dir.parent, "a100").attention[0]
    fit, held = attention_split(table.rows)
    assert len(fit) + len(held) == len(table.rows)
    assert not {r.context for r in fit if r.op == "attn_decode"} & {r.context for r in held if r.op == "attn_decode"}


def test_decode_waves_jump_once_blocks_exceed_resident_capacity():
    lk = LayerKernels(LayerShape(8192, 64, 8, 128, 28672, tp=2), replace(TRUTH, decode_floor_s=0.0), **A100)
    per_seq = [lk.decode_s(b, b * 2048) / b for b in (40, 54, 55)]
    assert per_seq[0] == pytest.approx(per_seq[1])  # 216 blocks = 2 x 108 SMs: one wave
    assert per_seq[2] > per_seq[1] * 1.4  # 220 blocks: a third wave


def test_kernel_coefficients_validate():
    with pytest.raises(ConfigError, match="gemm_compute_efficiency"):
        KernelCoefficients(gemm_compute_efficiency=1.5)
    with pytest.raises(ConfigError, match="decode_kv_efficiency"):
        KernelCoefficients(decode_kv_efficiency=((8.0, 0.7), (4.0, 0.8)))
    with pytest.raises(ConfigError, match="unknown kernels keys bogus"):
        KernelCoefficients.from_mapping({"bogus": 1})
    c = KernelCoefficients(decode_kv_efficiency=((1.0, 0.9), (16.0, 0.5)))
    assert c.decode_efficiency(4.0) == pytest.approx(0.7) and c.decode_efficiency(64.0) == 0.5


# ---- the cost model with fitted kernels ------------------------------------------------------
def test_cost_model_prices_stages_from_the_fitted_kernels():
    hw = get_hardware("a100-80g")
    assert hw.kernels is not None and hw.version.startswith("vidur-")
    model = get_model("llama2-70b")
    cost = CostModel(model, hw, pp=4, coefficients=CostCoefficients(**hw.calibration))  # as the runner builds it
    assert cost.coefficients.per_layer_overhead_s == 0.0  # kernel floors are priced per operator instead
    lk = cost.kernels.k
    shape = BatchShape.decode(32, 512)
    layer = float(lk.token_part_s(32)) + float(lk.kv_write_s(32)) + lk.decode_s(32, 32 * 512)
    middle = cost.stage_compute_s(1, shape)
    assert middle == pytest.approx(20 * layer + cost.coefficients.stage_overhead_s, rel=1e-12)
    last = cost.stage_compute_s(3, shape)
    assert last - middle == pytest.approx(float(lk.gemm_s(32, model.hidden_size, model.vocab_size)), rel=1e-9)
    pre = BatchShape.from_parts([(0, 2048, True)])
    assert cost.stage_compute_all_s(pre) == tuple(cost.stage_compute_s(s, pre) for s in range(4))


def test_fitted_profile_is_slower_than_the_roofline_where_the_tables_say_so():
    """The roofline underpriced small decode batches most (kernel floors, KV read rate); the fitted
    profile must put a 1-sequence short decode well above it, and a big prefill closer."""
    model = get_model("llama2-70b")
    fitted, roof = CostModel(model, get_hardware("a100-80g"), 4), CostModel(model, get_hardware("a100-80g-roofline"), 4)
    small = BatchShape.decode(1, 128)
    assert fitted.layer_parts_s(small)[2] > 3 * roof.layer_parts_s(small)[2]
    big = BatchShape.from_parts([(0, 2048, True)])
    assert fitted.layer_parts_s(big)[3] > roof.layer_parts_s(big)[3]


def test_every_default_gpu_is_fitted_and_the_roofline_stays_reachable():
    for name in ("a100-80g", "h100-80g", "a40-48g", "l20-48g", "rtx4090", "a100-40g", "a800-80g"):
        spec = HARDWARE[name]
        assert spec.kernels is not None and spec.sm_count, name
        roof = HARDWARE[f"{name}-roofline"]
        assert roof.kernels is None and roof.version == "roofline-1"
        assert (roof.peak_tflops, roof.mem_bw_gbs, roof.mem_gib) == (spec.peak_tflops, spec.mem_bw_gbs, spec.mem_gib)
    assert "no table" in HARDWARE["l20-48g"].description


# ---- the shipped profiles against the shared tables -------------------------------------------
def _shared_tables() -> Path | None:
    for base in (os.environ.get("TESTBED_DATA_DIR"), Path(__file__).resolve().parents[2] / "shared" / "data"):
        if base and (Path(base) / "gpu-op-profiles" / "compute" / "a100").is_dir():
            return Path(base)
    return None


SHARED = _shared_tables()
needs_tables = pytest.mark.skipif(SHARED is None, reason="the published GPU tables (gpu-op-profiles/) are not in "
                                                         "the data directory ($TESTBED_DATA_DIR or ../shared/data)")


@needs_tables
def test_shipped_a100_profile_meets_the_targets_on_held_out_rows():
    """Linear part and whole layer on held-out models (phi-2 included); attention per shape with
    the shipped coefficients (fitted on every shape: the leave-one-shape-out errors are the
    report's, docs/calibration.md)."""
    from testbed.calibrate.kernel_fit import KernelFit, attention_shapes
    from testbed.calibrate.tables import as_device, attention_rows, layer_rows, linear_rows
    import pandas as pd

    t = read_published(SHARED, "a100")
    fitted, roof = get_hardware("a100-80g"), get_hardware("a100-80g-roofline")
    shipped, shapes = KernelCoefficients.from_mapping(fitted.kernels), attention_shapes(t.attention)
    fit = KernelFit(shipped, as_device("a100"), attention=shapes, held_out={s.label: shipped for s in shapes})
    df = pd.DataFrame(linear_rows(t, fitted, roof) + attention_rows(fit, fitted, roof)
                      + layer_rows(t, fit, fitted, roof))
    df = df[df.held]
    assert "phi-2" in set(df[df.family == "linear"].model)
    err = (df.fitted / df.measured - 1).abs()
    med, p90 = err.groupby(df.family).median(), err.groupby(df.family).quantile(0.9)
    assert med["linear"] <= 0.05 and p90["linear"] <= 0.12 and med["layer"] <= 0.08
    att = df.family.isin(["decode", "prefill"])
    per_shape = err[att].groupby([df.family[att], df.model[att]]).median()
    assert (per_shape["decode"] <= 0.12).all() and (per_shape["prefill"] <= 0.15).all()
    roof_err = (df.default / df.measured - 1).abs().groupby(df.family).median()
    assert (med[["linear", "decode", "prefill", "layer"]] < roof_err[["linear", "decode", "prefill", "layer"]]).all()


@needs_tables
@pytest.mark.parametrize("device, p90_max", [("h100", 0.14), ("a40", 0.12)])
def test_shipped_h100_a40_linear_part_meets_the_median_target(device, p90_max):
    """phi-2 held out and priced as a GELU MLP; H100's p90 (13.5%, was 18.1%) still misses 12%:
    tile steps at different token counts per GEMM shape (docs/calibration.md)."""
    from testbed.calibrate.tables import DEVICE_HARDWARE, linear_rows
    import pandas as pd

    t = read_published(SHARED, device)
    name = DEVICE_HARDWARE[device]
    df = pd.DataFrame(linear_rows(t, get_hardware(name), get_hardware(f"{name}-roofline")))
    df = df[df.held & (df.family == "linear")]
    err = (df.fitted / df.measured - 1).abs()
    assert "phi-2" in set(df.model) and err.median() <= 0.05 and err.quantile(0.9) <= p90_max


@needs_tables
def test_shipped_h100_link_matches_the_send_recv_table_above_1_mib():
    t = read_published(SHARED, "h100").network["h100_dgx/send_recv"]
    hw = get_hardware("h100-80g")
    rows = [r for r in t.rows if r.link == "node" and r.nbytes >= 1 << 20]
    errs = [(hw.p2p_latency_s + r.nbytes / hw.p2p_bw_Bps) / r.time_s - 1 for r in rows]
    assert len(rows) > 10 and np.median(np.abs(errs)) <= 0.10
    assert fit_link(rows).bw_Bps == pytest.approx(hw.p2p_bw_Bps, rel=0.25)


# ---- the command ------------------------------------------------------------------------------
def test_calibrate_tables_command_on_fixture_tables(tables_dir, tmp_path, capsys):
    from testbed.cli import main

    out = tmp_path / "report"
    save = tmp_path / "profiles"
    assert main(["calibrate", "tables", str(tables_dir), "--device", "a100", "--out", str(out), "--save", str(save),
                 "--json"]) == 0
    printed = capsys.readouterr().out
    head = json.loads((out / "report.json").read_text())["headline"]
    assert json.loads(printed[printed.index("{"):printed.rindex("}") + 1])["a100"][0]["family"] == "linear"
    linear = {r["family"]: r for r in head["a100"]}["linear"]
    assert linear["fitted_median"] < 0.01  # noise-free tables of the model's own form
    assert (out / "report.md").read_text().count("| linear |") == 1
    for png in ("linear.png", "attention.png"):
        assert (out / png).stat().st_size > 10_000
    saved = sorted(p.name for p in save.glob("*.yaml"))
    assert "a100-80g.yaml" in saved and "l20-48g.yaml" in saved
    from testbed.calibrate.fit import load_hardware_profile

    spec = load_hardware_profile(save / "a100-80g.yaml")
    assert KernelCoefficients.from_mapping(spec.kernels).gemm_token_quantum == 64


def test_calibrate_tables_bad_input_is_one_error_line(tables_dir, capsys):
    from testbed.cli import main

    assert main(["calibrate", "tables", str(tables_dir), "--device", "v100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: invalid --device 'v100'; valid: a100, h100, a40") and "Traceback" not in err
    assert main(["calibrate", "tables", str(tables_dir), "--holdout", "Nope-7b"]) == 2
    assert "valid models: Held-Out-13b, Llama-2-70b-hf, Llama-2-7b-hf" in capsys.readouterr().err


def _edit_csv(path: Path, edit) -> None:
    import csv

    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    edit(rows)
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)


def _set_cell(column: str, value: str):
    def edit(rows):
        rows[3][rows[0].index(column)] = value
    return edit


MLP_7B = "compute/a100/org/Llama-2-7b-hf/mlp.csv"  # under the fixture's gpu-op-profiles/
SEND_RECV = "network/a100_testbox/send_recv.csv"


@pytest.mark.parametrize("table, edit, words", [
    (MLP_7B, _set_cell("time_stats.attn_pre_proj.median", "nan"), "line 4: invalid time_stats.attn_pre_proj.median='nan'"),
    (MLP_7B, _set_cell("time_stats.attn_pre_proj.median", "inf"), "line 4: invalid time_stats.attn_pre_proj.median='inf'"),
    (SEND_RECV, _set_cell("time_stats.send_recv.median", "0"), "line 4: invalid time_stats.send_recv.median='0'"),
    (SEND_RECV, lambda rows: rows[0].__setitem__(rows[0].index("num_workers"), "n_workers"),
     "has no column(s) num_workers"),
    (MLP_7B, lambda rows: rows[0].__setitem__(rows[0].index("num_tokens"), "tokens"), "has no column(s) num_tokens"),
])
def test_tables_with_broken_cells_or_other_columns_are_one_error_line(tables_dir, tmp_path, capsys, table, edit,
                                                                      words):
    """nan/0 cells ended in "Residuals are not finite" from the fit, other network columns in a
    KeyError, inf was fitted silently (issue 38 item 7)."""
    import shutil

    from testbed.cli import main

    root = tmp_path / "gpu-op-profiles"
    shutil.copytree(tables_dir, root)
    _edit_csv(root / table, edit)
    assert main(["calibrate", "tables", str(root), "--device", "a100", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert words in err and table in err, err


def test_tables_without_network_or_an_op_column_are_reported_with_a_warning(tables_dir, tmp_path, capsys):
    import shutil

    from testbed.cli import main

    root = tmp_path / "gpu-op-profiles"
    shutil.copytree(tables_dir, root)
    shutil.rmtree(root / "network")
    _edit_csv(root / MLP_7B, lambda rows: [r.pop(rows[0].index("time_stats.mlp_act.median")) for r in rows[::-1]])
    assert main(["calibrate", "tables", str(root), "--device", "a100", "--out", str(tmp_path / "out")]) == 0
    cap = capsys.readouterr()
    out = " ".join((cap.out + cap.err).split())
    assert "warning: a100: no network tables" in out and "links are not fitted" in out, out
    assert "warning: a100: Llama-2-7b-hf/mlp.csv has no column time_stats.mlp_act.median (act not measured)" in out


def test_summary_names_the_cost_profile(tmp_path):
    from testbed.cli import main

    out = tmp_path / "runs"
    assert main(["run", "policy=sarathi", "workload=synthetic", "workload.num_requests=20", "hardware=a100-80g",
                 "model=llama2-70b", f"output.dir={out}", "output.mlflow=false", "output.plots=false"]) == 0
    summary = json.loads(next(out.glob("*/summary.json")).read_text())
    assert summary["hardware_profile"] == "a100-80g"
    assert summary["hardware_version"] == get_hardware("a100-80g").version
    assert math.isfinite(summary["tpot_mean_s"])


@pytest.mark.parametrize("hw", ["a100-80g", "h100-80g"])
def test_inlined_attention_of_the_hot_path_equals_the_kernel_definitions(hw):
    cost = CostModel(get_model("llama2-70b"), get_hardware(hw), pp=4, tp=2)
    lk = cost.kernels.k
    for prefills, decodes in (([(0, 700, True)], []), ([(1024, 256, False), (0, 64, True)], [300] * 130),
                              ([], [17] * 5), ([], [4000] * 200)):
        shape = BatchShape.from_parts(prefills, decodes)
        chunks = len(prefills)
        expected = (float(lk.token_part_s(shape.num_tokens)) + float(lk.kv_write_s(shape.num_tokens))
                    + cost.kernels._ar_tok * shape.num_tokens
                    + cost.kernels._ar_fix + lk.decode_s(shape.num_decode_seqs, shape.decode_context_sum)
                    + lk.prefill_s(shape.num_prefill_tokens, chunks, shape.prefill_attention_pairs,
                                   shape.prefill_context_sum))
        assert cost.kernels.layer_s(shape, shape.num_tokens) == pytest.approx(expected, rel=1e-12)


def test_a_users_operator_profile_goes_through_the_same_fit(tables_dir, tmp_path, capsys):
    """One fitting path: the published tables' rows of one model, written in testbed's own CSV as a
    user's GPU profile would be, fit to the same coefficients and are reported by family."""
    from engine.pricing.profile_table import ProfileTable
    from testbed.calibrate.fit import load_hardware_profile
    from testbed.cli import main

    t = read_published(tables_dir.parent, "a100")
    compute = t.compute["Llama-2-70b-hf"]
    meta = {k: compute.meta[k] for k in ("hidden", "q_heads", "kv_heads", "intermediate", "vocab")}
    profile = write_profile(ProfileTable(compute.rows + t.attention[0].rows, {"model": "my-70b", **meta}),
                            tmp_path / "mine.csv")
    assert main(["calibrate", "tables", "--profile", str(profile), "--hardware", "a100-80g-roofline",
                 "--out", str(tmp_path / "r"), "--save", str(tmp_path / "p")]) == 0
    printed = capsys.readouterr().out
    assert "linear" in printed and "decode" in printed and "prefill" in printed
    spec = load_hardware_profile(tmp_path / "p" / "a100-80g-fit.yaml")
    c = KernelCoefficients.from_mapping(spec.kernels)
    assert c.gemm_token_quantum == 64 and c.gemm_compute_efficiency == pytest.approx(0.68, rel=0.03)
    assert main(["calibrate", "tables", "--profile", str(profile)]) == 2
    assert "needs --hardware" in capsys.readouterr().err


def test_mlflow_tags_name_the_cost_profile_version():
    from testbed.tracking.tracker import run_tags

    from testbed.config.spec import compose_spec

    tags = run_tags(compose_spec(["policy=gllm", "hardware=h100-80g", "parallel.pp=2"]))
    assert tags["hardware"] == "h100-80g" and tags["hardware_version"].startswith("vidur-7d47513-fit-")


def test_a_stage_profile_fitted_on_a_fitted_base_fits_the_roofline_form():
    """`testbed profile` fits the roofline's coefficients to stage times; on a base whose kernels
    are fitted, the saved profile must drop them (they would ignore the fit) and say what it is."""
    from testbed.calibrate.fit import calibrated_spec, fit_profile, synthetic_profile

    base, model = get_hardware("a100-80g"), get_model("tiny-llama")
    truth = {"linear_efficiency": 0.6, "memory_efficiency": 0.7}
    table = synthetic_profile(model, replace(base, kernels=None), 2, truth)
    fit = fit_profile(table, model, base, 2)
    assert fit.coefficients["memory_efficiency"] == pytest.approx(0.7, rel=0.02)
    spec = calibrated_spec(base, "a100-cal-test", fit)
    assert spec.kernels is None and spec.version.startswith("profile-")
