"""Stages sharing a device (P above the GPUs): the simulator lets them take turns on it
(`executor.devices`), and `calibrate runs --shared-gpu` fits each forward's own work from a run whose
stages shared one (engine/simulator/shared_device.py, testbed/calibrate/shared_device.py)."""
from __future__ import annotations

import pytest

from engine.simulator.shared_device import device_map
from testbed.calibrate.manifest import MEASUREMENTS_DIR, load_manifest
from testbed.calibrate.shared_device import own_work
from testbed.cli import main
from testbed.run.runner import run_experiment
from conftest import small_config

BASE = ["policy=gllm", "workload=synthetic", "workload.num_requests=60", "workload.arrival=offline",
        "model=qwen2.5-7b", "hardware=h100-80g", "output.trace=full"]
G1 = MEASUREMENTS_DIR / "gpu-h200-qwen2.5-7b-2026-11-28"


def test_stages_are_placed_as_the_engine_places_them():
    assert device_map(4, 2) == (0, 1, 0, 1)  # cuda:(s mod GPUs), engine/torch_exec/shared/placement.py
    assert device_map(2, 1) == (0, 0)
    assert device_map(2, 0) is None and device_map(2, 2) is None and device_map(2, 3) is None


def _device_spans(res, stages):
    rows = res.tracer.rows() if hasattr(res.tracer, "rows") else res.tracer.spans
    return sorted((r[2], r[3]) for r in rows if r[0] in stages and not r[1].startswith(("prepare", "recv", "schedule")))


def test_stages_on_one_device_never_overlap_on_it_and_serve_less():
    own = run_experiment(small_config(*BASE, "parallel.pp=2"))
    shared = run_experiment(small_config(*BASE, "parallel.pp=2", "executor.devices=1"))
    assert own.error is None and shared.error is None
    assert shared.summary["num_finished"] == own.summary["num_finished"]
    spans = _device_spans(shared, {"stage0", "stage1"})
    assert all(b[0] >= a[1] - 1e-12 for a, b in zip(spans, spans[1:]))  # one forward at a time
    overlapping = _device_spans(own, {"stage0", "stage1"})
    assert any(b[0] < a[1] - 1e-9 for a, b in zip(overlapping, overlapping[1:]))  # two devices: they overlap
    assert shared.summary["throughput_tok_s"] < 0.8 * own.summary["throughput_tok_s"]


def test_as_many_devices_as_stages_is_the_default_bit_for_bit():
    a = run_experiment(small_config(*BASE, "parallel.pp=2"))
    b = run_experiment(small_config(*BASE, "parallel.pp=2", "executor.devices=2"))
    assert a.summary == b.summary


@pytest.mark.parametrize("value", ["-1", "1.5", "true"])
def test_a_bad_device_count_is_one_error_line(tmp_path, capsys, value):
    code = main(["run", *BASE, "parallel.pp=2", f"executor.devices={value}", f"output.dir={tmp_path}",
                 "output.mlflow=false"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "executor.devices" in err and "\n" not in err, err


def test_overlapping_forwards_share_the_time_they_overlap():
    spans = {(0, 0): {"forward": (0.0, 4.0)}, (0, 1): {"forward": (2.0, 4.0)},  # overlap 2..4 on cuda:0
             (1, 0): {"forward": (10.0, 1.0)}, (1, 1): {"prepare": (10.0, 0.5)}}
    work = own_work(spans, {0: "cuda:0", 1: "cuda:0"})
    assert work == {(0, 0): pytest.approx(3.0), (0, 1): pytest.approx(3.0), (1, 0): pytest.approx(1.0)}
    assert own_work(spans, {0: "cuda:0", 1: "cuda:1"})[(0, 1)] == pytest.approx(4.0)  # no sharing: as measured


def test_shared_gpu_fit_on_g1_prices_own_work_and_its_replays_take_turns(tmp_path, monkeypatch):
    import yaml

    from testbed.calibrate.replay_sim import simulate_run
    from testbed.calibrate.runs import load_run

    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path))
    manifest = load_manifest(G1 / "manifest-g1.yaml")
    args = ["calibrate", "runs", str(G1 / "manifest-g1.yaml"), "--profile", "gpu-h200-q7-g1-pp2-runs",
            "--table-option", "0", "--own-attention", "--hop", "receive", "--out", str(tmp_path)]
    assert main([*args, "--shared-gpu", "--name", "g1-shared"]) == 0
    assert main([*args, "--name", "g1-measured"]) == 0
    shared = yaml.safe_load((tmp_path / "g1-shared.yaml").read_text())
    measured = yaml.safe_load((tmp_path / "g1-measured.yaml").read_text())
    assert shared["calibration"]["shared_device_fit"] == 1 and "shared_device_fit" not in measured["calibration"]
    assert shared["profile"]["shared_gpu"] is True
    run = load_run(manifest.run_dir("pp2-sharegpt-sarathi-r1"))
    for profile, devices in (("g1-shared", 1), ("g1-measured", 0)):  # the stages took turns on cuda:0, or not
        simulate_run(run, profile, out_dir=tmp_path / profile)
        assert yaml.safe_load((tmp_path / profile / "config.yaml").read_text())["executor"]["devices"] == devices


def test_shared_gpu_without_a_shared_run_is_refused(tmp_path, capsys):
    code = main(["calibrate", "runs", str(G1 / "manifest-g1.yaml"), "--profile", "gpu-h200-q7-g1-pp1-runs",
                 "--table-option", "1", "--own-attention", "--hop", "receive", "--shared-gpu", "--name", "x",
                 "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --shared-gpu: none of the runs had stages sharing a GPU"), err
    assert not (tmp_path / "x.yaml").exists()
