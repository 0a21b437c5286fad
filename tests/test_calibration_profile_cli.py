"""`testbed profile` end to end on CPU at a tiny scale: grids with mixed batches, the saved hardware
profile's provenance and GPU terms, bad --grid values."""
from __future__ import annotations

import pytest
import yaml

from engine.calibration import GPU_FORWARD_PARAMS, load_hardware_profile, read_profile
from engine.profile_grid import ProfileGrid

TINY = ProfileGrid("serving-cpu", prefill_tokens=(16, 96), prefill_batch=(1,), prefill_prefix=(0, 64),
                   decode_batch=(1, 8), decode_context=(24, 160), mixed=((4, 64, 32),), max_batch_tokens=256)


def test_profile_cli_tiny_grid_records_terms_and_provenance(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    import testbed.calibrate as cal
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
    import engine.calibration as calibration
    from engine.calibration import calibrated_spec, FitResult, save_hardware_profile
    from engine.hardware import HARDWARE, get_hardware
    from testbed.config import load_saved_profiles

    spec = calibrated_spec(get_hardware("h100-80g"), "h100-shipped-test",
                           FitResult({"kv_read_efficiency": 0.4, "decode_overhead_ratio": 0.2}))
    save_hardware_profile(spec, tmp_path / "shipped" / "h100-shipped-test.yaml", {"gpu": "test"})
    monkeypatch.setattr(calibration, "SHIPPED_PROFILES_DIR", tmp_path / "shipped")
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path / "user"))
    try:
        assert "h100-shipped-test" in load_saved_profiles()
        assert get_hardware("h100-shipped-test").calibration["kv_read_efficiency"] == 0.4
    finally:
        HARDWARE.pop("h100-shipped-test", None)
