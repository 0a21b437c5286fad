"""Calibration: profile tables, TD-Pipe import, fitting, saved profiles, one small real profile run."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.pricing.profile_table import ProfileRow, ProfileTable, parse_profile, read_profile, write_profile

from testbed.calibrate.fit import calibrated_spec, fit_profile, import_tdpipe, load_hardware_profile, save_hardware_profile, synthetic_profile
from engine.pricing.costmodel import BatchShape, CostCoefficients, CostModel
from engine.base.errors import ConfigError
from engine.pricing.hardware import HARDWARE, get_hardware
from engine.pricing.models import get_model

TRUE = dict(linear_efficiency=0.6, attention_efficiency=0.3, memory_efficiency=0.7, stage_overhead_s=5e-4,
            per_layer_overhead_s=4e-5, prep_fixed_s=1e-3, prep_per_seq_s=1e-5, prep_per_token_s=3e-7,
            sample_fixed_s=2e-4, sample_per_token_vocab_s=1e-10)


def test_fit_recovers_known_coefficients():
    model, hw = get_model("qwen2.5-32b"), get_hardware("l20-48g-roofline")
    table = synthetic_profile(model, hw, 3, TRUE)
    fit = fit_profile(table, model, hw, 3)
    for k in ("linear_efficiency", "attention_efficiency", "memory_efficiency"):
        assert fit.coefficients[k] == pytest.approx(TRUE[k], rel=0.01), k
    # the two overheads trade off (all stages have ~the same layers); their sum per stage is what counts
    for k in ("prep_fixed_s", "prep_per_seq_s", "prep_per_token_s", "sample_fixed_s", "sample_per_token_vocab_s"):
        assert fit.coefficients[k] == pytest.approx(TRUE[k], rel=1e-3), k
    assert fit.p2p_bw_gbs == pytest.approx(hw.p2p_bw_gbs, rel=1e-3)
    assert fit.p2p_latency_s == pytest.approx(hw.p2p_latency_s, rel=1e-2)
    assert fit.errors["forward"]["max_abs_rel"] < 0.01
    # with noise, predictions stay close
    noisy = fit_profile(synthetic_profile(model, hw, 3, TRUE, noise=0.05, seed=1), model, hw, 3)
    assert noisy.errors["forward"]["median_abs_rel"] < 0.05
    assert noisy.coefficients["linear_efficiency"] == pytest.approx(0.6, rel=0.1)


def test_profile_table_round_trip(tmp_path):
    model, hw = get_model("tiny-llama"), get_hardware("a100-80g-roofline")
    table = synthetic_profile(model, hw, 2, TRUE)
    p = write_profile(table, tmp_path / "p.csv")
    back = read_profile(p)
    assert back.meta["model"] == "tiny-llama"
    assert len(back.rows) == len(table.rows)
    for a, b in zip(table.rows, back.rows):
        assert (a.op, a.stage, a.kind, a.batch, a.tokens, a.prefix, a.context, a.nbytes) == \
               (b.op, b.stage, b.kind, b.batch, b.tokens, b.prefix, b.context, b.nbytes)
        assert b.time_s == pytest.approx(a.time_s, rel=1e-8)


@pytest.mark.parametrize("bad_line, message", [
    ("forward,0,prefill,1,16,0,0,0,abc", "time_s='abc' is not a number"),
    ("forward,0,prefill,1,16,0,0", "7 fields, the header has 9"),
    ("launch,0,prefill,1,16,0,0,0,0.1", "unknown op 'launch'"),
    ("forward,0,decode,4,0,0,0,0,0.1", "needs context >= 1"),
    ("forward,0,prefill,1,16,0,0,0,-1", "must be a positive number"),
])
def test_malformed_profile_names_the_line(tmp_path, bad_line, message):
    lines = ["# model=tiny-llama", "op,stage,kind,batch,tokens,prefix,context,nbytes,time_s",
             "forward,0,prefill,1,16,0,0,0,0.01", "forward,1,decode,4,0,0,64,0,0.02",
             "", "# a comment", bad_line]
    p = tmp_path / "profile.csv"
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as exc:
        read_profile(p)
    text = str(exc.value)
    assert text.startswith("profile.csv line 7: ") and message in text and "\n" not in text


def test_bad_header_and_empty():
    with pytest.raises(ConfigError, match="x.csv line 1: bad header"):
        parse_profile("op,stage,time,foo\n", "x.csv")
    with pytest.raises(ConfigError, match="no measurements"):
        parse_profile("# only=comments\n", "x.csv")


def _tdpipe_csv(path: Path, cost: CostModel, unit_scale: float) -> None:
    lines = ["Total Length,Execute Time"]
    for n in (64, 128, 256, 512, 1024, 2048, 4096, 8192):
        t = cost.bottleneck_s(BatchShape.prefill(n), include_sampling=False)
        lines.append(f"{n},{t / unit_scale:.9g}")
    path.write_text("\n".join(lines) + "\n")


def test_tdpipe_import_round_trip_and_profile_selectable(tmp_path, monkeypatch):
    model, hw = get_model("qwen2.5-32b"), get_hardware("l20-48g-roofline")
    truth = dict(linear_efficiency=0.55, attention_efficiency=0.35, stage_overhead_s=1e-3)
    cost = CostModel(model, hw, 4, coefficients=CostCoefficients(**truth))
    src = tmp_path / "tdpipe.csv"
    _tdpipe_csv(src, cost, 1e-3)
    with pytest.raises(ConfigError, match="time unit"):
        import_tdpipe(src, "minutes")
    table = import_tdpipe(src, "ms")
    assert len(table.rows) == 8 and all(r.stage is None and r.kind == "prefill" for r in table.rows)
    assert table.rows[0].time_s == pytest.approx(cost.bottleneck_s(BatchShape.prefill(64), False), rel=1e-6)
    fit = fit_profile(table, model, hw, 4)
    assert set(fit.coefficients) == {"linear_efficiency", "attention_efficiency", "stage_overhead_s"}
    assert fit.coefficients["linear_efficiency"] == pytest.approx(0.55, rel=0.02)
    assert fit.errors["forward"]["max_abs_rel"] < 0.02
    # save as a named profile; a fresh process selects it with hardware=<name>
    prof_dir = tmp_path / "profiles"
    spec = calibrated_spec(hw, "l20-tdpipe-test", fit)
    save_hardware_profile(spec, prof_dir / "l20-tdpipe-test.yaml", {"table": str(src)})
    loaded = load_hardware_profile(prof_dir / "l20-tdpipe-test.yaml")
    assert loaded == spec
    code = (
        "from testbed.config.spec import compose_spec\n"
        "from testbed.run.runner import build_cost_model\n"
        "from engine.pricing.costmodel import BatchShape\n"
        "for h in ('l20-48g', 'l20-tdpipe-test'):\n"
        "    cfg = compose_spec(['hardware=' + h, 'model=qwen2.5-32b', 'parallel.pp=4'])\n"
        "    print(build_cost_model(cfg).bottleneck_s(BatchShape.prefill(2048), False))\n"
    )
    env = dict(**__import__("os").environ, TESTBED_PROFILE_DIR=str(prof_dir))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    base_t, cal_t = map(float, out.stdout.split())
    assert cal_t == pytest.approx(cost.bottleneck_s(BatchShape.prefill(2048), False), rel=0.02)
    assert abs(cal_t / base_t - 1) > 0.1  # the calibration changes the simulated times


def test_profile_dir_loading_and_duplicates(tmp_path):
    from testbed.calibrate.fit import load_profiles_dir

    hw = get_hardware("a100-80g-roofline")
    spec = calibrated_spec(hw, "a100-cal-dup-test", fit_profile(
        synthetic_profile(get_model("tiny-llama"), hw, 2, TRUE), get_model("tiny-llama"), hw, 2))
    save_hardware_profile(spec, tmp_path / "a.yaml")
    try:
        assert load_profiles_dir(tmp_path) == ["a100-cal-dup-test"]
        assert load_profiles_dir(tmp_path) == []  # same content: nothing new
        assert HARDWARE["a100-cal-dup-test"].calibration["memory_efficiency"] == pytest.approx(0.7, rel=0.01)
    finally:
        HARDWARE.pop("a100-cal-dup-test", None)
    (tmp_path / "b.yaml").write_text("name: x\npeak_tflops: 1\nbogus: 2\n")
    with pytest.raises(ConfigError, match="unknown keys bogus"):
        load_profiles_dir(tmp_path)


def test_small_real_profile_run(tmp_path):
    """A tiny grid on the real torch engine (P=2): the table is complete and the fit is sane."""
    pytest.importorskip("torch")
    from engine.torch_exec.driver.profile import profile_engine
    from engine.core.request import Request
    from testbed.config.spec import compose_spec
    from testbed.run.runner import prepare_experiment

    grid = {"prefill_tokens": (16, 128), "prefill_batch": (1,), "prefill_prefix": (0,),
            "decode_batch": (1, 16), "decode_context": (32,)}
    cfg = compose_spec(["executor=torch", "model=tiny-llama", "parallel.pp=2", "kv.num_blocks=32",
                                f"executor.model_cache_dir={tmp_path / 'models'}", "policy=vllm"])
    prepared = prepare_experiment(cfg, requests=[Request(0, 0.0, 1, 1)])
    ex, cost = prepared.controller.executor, prepared.cost
    try:
        table = profile_engine(ex, grid, block_size=16, repeats=1, warmup=1,
                               bytes_of=lambda r: cost.activation_bytes(r.shape()))
    finally:
        ex.shutdown()
    ops = {(r.op, r.stage) for r in table.rows}
    assert {("forward", 0), ("forward", 1), ("prepare", 0), ("prepare", 1), ("sample", 1), ("transfer", 0)} <= ops
    assert len(table.select("forward")) == 2 * 4
    assert all(r.time_s > 0 for r in table.rows)
    p = write_profile(table, tmp_path / "real.csv")
    assert len(read_profile(p).rows) == len(table.rows)
    from dataclasses import replace

    hw = replace(get_hardware("a100-80g-roofline"), name="cpu-test", peak_tflops=0.05, mem_bw_gbs=10.0)
    fit = fit_profile(table, get_model("tiny-llama"), hw, 2, list(cost.layers))
    assert all(math.isfinite(v) and v >= 0 for v in fit.coefficients.values())
    assert fit.p2p_bw_gbs > 0


def test_validate_error_table_and_overlay(tmp_path):
    from engine.core.trace import Tracer
    from testbed.calibrate.profile import error_table, format_table, overlay_figure

    real = {"throughput_tok_s": 100.0, "ttft_mean_s": 0.5, "num_microbatches": 10, "bubble_ratio": 0.2}
    sim = {"throughput_tok_s": 95.0, "ttft_mean_s": 0.55, "num_microbatches": 10, "bubble_ratio": 0.0}
    rows = {r["metric"]: r for r in error_table(real, sim)}
    assert rows["throughput_tok_s"]["rel_error"] == pytest.approx(-0.05)
    assert rows["ttft_mean_s"]["rel_error"] == pytest.approx(0.1)
    assert "throughput" in format_table(list(rows.values()))

    class R:
        def __init__(self, off):
            self.tracer = Tracer()
            self.stage_tracks = ["stage0", "stage1"]
            for mb in range(5):
                for s in range(2):
                    t = off + mb * 0.01 + s * 0.01
                    self.tracer.span(f"stage{s}", "forward:decode", t, t + 0.008, mb)

    out = overlay_figure(R(0.0), R(1.0), tmp_path / "o.png", num_mbs=4)
    assert out.exists() and out.stat().st_size > 1000


def test_cli_profile_import(tmp_path):
    from testbed.cli import main

    model, hw = get_model("qwen2.5-32b"), get_hardware("l20-48g-roofline")
    src = tmp_path / "td.csv"
    _tdpipe_csv(src, CostModel(model, hw, 4), 1.0)
    assert main(["profile", "--import", str(src), "model=qwen2.5-32b", "hardware=l20-48g", "parallel.pp=4",
                 "--out", str(tmp_path)]) == 2  # --time-unit is required
    assert main(["profile", "--import", str(src), "--time-unit", "s", "--name", "l20-cli-test",
                 "model=qwen2.5-32b", "hardware=l20-48g", "parallel.pp=4", "--out", str(tmp_path)]) == 0
    spec = load_hardware_profile(tmp_path / "l20-cli-test.yaml")
    assert spec.calibration["linear_efficiency"] == pytest.approx(0.75, rel=0.02)
    assert (tmp_path / "l20-cli-test.csv").exists()
    _ = ProfileRow, ProfileTable
