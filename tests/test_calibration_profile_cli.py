"""`testbed profile` end to end on CPU at a tiny scale: grids with mixed batches, the saved hardware
profile's provenance and GPU terms, bad --grid values."""
from __future__ import annotations

import pytest
import yaml

from engine.pricing.profile_table import read_profile

from testbed.calibrate.fit import GPU_FORWARD_PARAMS, load_hardware_profile
from engine.pricing.profile_grid import ProfileGrid

TINY = ProfileGrid("serving-cpu", prefill_tokens=(16, 96), prefill_batch=(1,), prefill_prefix=(0, 64),
                   decode_batch=(1, 8), decode_context=(24, 160), mixed=((4, 64, 32),), max_batch_tokens=256)


def test_profile_cli_tiny_grid_records_terms_and_provenance(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    import testbed.calibrate.profile as cal
    from testbed.cli import main

    monkeypatch.setattr(cal, "get_grid", lambda name: TINY if name == "serving-cpu" else pytest.fail(name))
    rc = main(["profile", "--grid", "serving-cpu", "--repeats", "1", "--name", "cpu-prov-test", "--out", str(tmp_path),
               "executor=torch", "model=tiny-llama", "parallel.pp=2", "policy=vllm",
               f"executor.model_cache_dir={tmp_path / 'models'}"])
    cap = capsys.readouterr()
    out = cap.out + cap.err  # the console may print to either
    assert rc == 0, out
    assert "(serving-cpu grid)" in out and "wall timing" in out
    assert "fit error forward " in out and "fit error forward_classic" in out
    table = read_profile(tmp_path / "cpu-prov-test.csv")
    assert table.meta["grid"] == "serving-cpu"
    mixed = [r for r in table.rows if r.kind == "mixed"]
    assert {(r.op, r.stage) for r in mixed} >= {("forward", 0), ("forward", 1), ("prepare", 0), ("sample", 1),
                                                 ("transfer", 0)}
    spec = load_hardware_profile(tmp_path / "cpu-prov-test.yaml")
    assert set(GPU_FORWARD_PARAMS) <= set(spec.calibration)
    prof = yaml.safe_load((tmp_path / "cpu-prov-test.yaml").read_text())["profile"]
    for key in ("date_utc", "torch", "device", "model_shape", "grid", "fit_errors", "fitted_terms",
                "measured_gemm_flops", "peak_timer", "dtype"):
        assert key in prof, key
    assert prof["device"] == "cpu" and prof["peak_timer"] == "wall" and prof["peaks_from"] == "measured"
    assert prof["model_shape"]["num_layers"] == sum(prof["layers"])
    assert {"forward", "forward_classic", "prepare", "sample", "transfer"} <= set(prof["fit_errors"])


@pytest.mark.parametrize("args, message", [
    (["--grid", "huge"], "error: unknown profile grid 'huge'; valid choices: default, quick, serving, serving-cpu"),
    (["--grid", "serving", "--quick"], "error: --quick is --grid quick; it contradicts --grid serving"),
])
def test_profile_cli_bad_grid(args, message, capsys):
    from testbed.cli import main

    assert main(["profile", *args, "model=tiny-llama"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [message]


def test_shipped_profiles_are_registered_at_start_up(tmp_path, monkeypatch):
    import testbed.config.profiles as profiles
    from testbed.calibrate.fit import calibrated_spec, FitResult, save_hardware_profile
    from engine.pricing.hardware import HARDWARE, get_hardware
    from testbed.config.composer import load_saved_profiles

    spec = calibrated_spec(get_hardware("h100-80g"), "h100-shipped-test",
                           FitResult({"kv_read_efficiency": 0.4, "decode_overhead_ratio": 0.2}))
    save_hardware_profile(spec, tmp_path / "shipped" / "h100-shipped-test.yaml", {"gpu": "test"})
    monkeypatch.setattr(profiles, "SHIPPED_PROFILES_DIR", tmp_path / "shipped")
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path / "user"))
    try:
        assert "h100-shipped-test" in load_saved_profiles()
        assert get_hardware("h100-shipped-test").calibration["kv_read_efficiency"] == 0.4
    finally:
        HARDWARE.pop("h100-shipped-test", None)


def test_fit_base_is_a_table_gpu_when_named():
    """hardware=<table GPU>: the fit is relative to its datasheet peaks (efficiencies comparable with
    the defaults); otherwise to the measured peaks."""
    from engine.pricing.hardware import get_hardware
    from testbed.calibrate.profile import _measured_base

    from engine.torch_exec.settings import TorchSettings

    cfg = TorchSettings(dtype="bfloat16", threads_per_stage=1)
    peaks = {"peak_flops": 7.0e14, "mem_bw_Bps": 2.9e12}
    prov = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "550.00", "cuda": "12.4", "torch": "2.x",
            "date_utc": "2026-11-22T00:00:00Z"}
    table = _measured_base("h100-80g-measured", cfg, "cpu", peaks, prov, "qwen2.5-7b", 1, get_hardware("h100-80g"))
    assert (table.name, table.peak_tflops, table.mem_bw_gbs) == ("h100-80g-measured", 989.0, 3350.0)
    assert table.calibration is None and "peaks of h100-80g" in table.description
    measured = _measured_base(None, cfg, "cpu", peaks, prov, "qwen2.5-7b", 1, None)
    assert measured.name == "cpu-qwen2.5-7b-pp1" and measured.peak_tflops == pytest.approx(700.0)
    assert measured.mem_bw_gbs == pytest.approx(2900.0)


@pytest.mark.gpu
@pytest.mark.parametrize("pp", [1, 2])
def test_profile_on_cuda_records_gpu_provenance(tmp_path, pp):
    """On the device: CUDA-event spans, GPU peaks and provenance (P=2: both stages on one GPU)."""
    from testbed.cli import main

    name = f"gpu-test-pp{pp}"
    assert main(["profile", "--grid", "quick", "--repeats", "1", "--name", name, "--out", str(tmp_path),
                 "executor=torch", "executor.device=cuda", "executor.dtype=bfloat16", "model=tiny-llama",
                 f"parallel.pp={pp}", "policy=vllm", f"executor.model_cache_dir={tmp_path / 'models'}"]) == 0
    prof = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())["profile"]
    assert prof["peak_timer"] == "cuda-event" and prof["gpu"] and prof["driver"] and prof["cuda"]
    assert prof["measured_peak_flops"] > 1e13  # a GPU's bf16 GEMM, not the host's fp32
    table = read_profile(tmp_path / f"{name}.csv")
    assert all(r.time_s > 0 for r in table.rows) and table.meta["device"] == prof["gpu"]


def test_a_rewritten_profile_is_read_again_and_the_next_compose_uses_it(tmp_path, monkeypatch):
    """Profiles are parsed once per file version (every compose loads the folders): a profile
    saved again under its name (a new `testbed profile`) must reach the next compose in the same
    process, not the cached copy."""
    from engine.pricing.hardware import HARDWARE, get_hardware
    from testbed.calibrate.fit import FitResult, calibrated_spec, save_hardware_profile
    from testbed.config.spec import compose_spec

    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path))
    path = tmp_path / "h100-resaved-test.yaml"
    args = ["hardware=h100-resaved-test", "workload=synthetic", "model=llama2-13b", "output.mlflow=false"]
    try:
        for eff in (0.4, 0.45):
            spec = calibrated_spec(get_hardware("h100-80g"), "h100-resaved-test",
                                   FitResult({"kv_read_efficiency": eff, "decode_overhead_ratio": 0.2}))
            save_hardware_profile(spec, path, {"gpu": "test"})
            assert load_hardware_profile(path) is load_hardware_profile(path)  # parsed once per version
            assert compose_spec(args).settings.hardware.calibration["kv_read_efficiency"] == eff
    finally:
        HARDWARE.pop("h100-resaved-test", None)
