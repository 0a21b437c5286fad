"""A real run records its host (testbed/run/host_probe.py) and `validate --runs` says when the checked runs'
host differs from the fit runs' (testbed/calibrate/host_check.py)."""
from __future__ import annotations

import json

import pytest

from testbed.calibrate.host_check import PROBE_TOLERANCE, host_report, run_host
from testbed.run.host_probe import host_info


def _run(tmp_path, name: str, host: dict | None):
    d = tmp_path / name
    d.mkdir()
    info = {"executor": "torch"} if host is None else {"executor": "torch", "host": host}
    (d / "run_info.json").write_text(json.dumps(info))
    return d


def _host(probe: float, model: str = "AMD EPYC") -> dict:
    return {"cpu_model": model, "logical_cpus": 2, "gemm_probe_ms": probe}


def test_the_probe_measures_this_host():
    pytest.importorskip("torch")
    host = host_info()
    assert host["gemm_probe_ms"] > 0 and host["logical_cpus"] >= 1 and host["cpu_model"]


def test_the_same_machine_passes_and_a_slower_one_is_named(tmp_path):
    fit = [_run(tmp_path, f"f{i}", _host(p)) for i, p in enumerate((2.00, 2.02, 1.98))]
    same = [_run(tmp_path, f"s{i}", _host(2.0 * (1 + PROBE_TOLERANCE / 2))) for i in range(3)]
    slow = [_run(tmp_path, f"t{i}", _host(2.0 * (1 + 2 * PROBE_TOLERANCE))) for i in range(3)]
    text = host_report({"fit": fit, "validation": same, "test": slow})
    lines = text.splitlines()
    assert "2.000 ms" in lines[0]
    assert "validation" in lines[1] and "same machine" in lines[1]
    assert "test" in lines[2] and "ANOTHER MACHINE" in lines[2] and "+10.0%" in lines[2]


def test_another_cpu_model_is_another_machine_even_at_the_same_speed(tmp_path):
    fit = [_run(tmp_path, "f", _host(2.0))]
    other = [_run(tmp_path, "t", _host(2.0, "Intel Xeon"))]
    assert "ANOTHER MACHINE" in host_report({"fit": fit, "test": other})


def test_runs_without_a_probe_say_it_cannot_be_told(tmp_path):
    old = [_run(tmp_path, "f", None)]
    assert run_host(old[0]) is None
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "run_info.json").write_text("[1, 2]")  # not an object: no host, no traceback
    assert run_host(tmp_path / "odd") is None
    assert "unknown" in host_report({"fit": old, "test": [_run(tmp_path, "t", _host(2.0))]})
    text = host_report({"fit": [_run(tmp_path, "f2", _host(2.0))], "test": [_run(tmp_path, "t2", None)]})
    assert "cannot tell" in text.splitlines()[1]


def test_on_a_gpu_a_slower_host_is_the_hosts_work_not_another_machine(tmp_path):
    def gpu_run(name: str, probe: float):
        d = _run(tmp_path, name, _host(probe, "Intel Xeon"))
        info = json.loads((d / "run_info.json").read_text()) | {"stages": [{"device": "cuda:0"}]}
        (d / "run_info.json").write_text(json.dumps(info))
        return d

    text = host_report({"fit": [gpu_run("f", 2.0)], "test": [gpu_run("t", 2.4)]})
    assert "host ran at another speed" in text and "ANOTHER MACHINE" not in text
    other = _run(tmp_path, "o", _host(2.0, "AMD EPYC"))  # another CPU model is another machine, GPU or not
    assert "ANOTHER MACHINE" in host_report({"fit": [gpu_run("f2", 2.0)], "test": [other]})


def test_runs_whose_stages_shared_a_gpu_are_named(tmp_path):
    def run(name: str, devices: list[str]):
        d = _run(tmp_path, name, _host(2.0, "Intel Xeon"))
        info = json.loads((d / "run_info.json").read_text()) | {"stages": [{"device": x} for x in devices]}
        (d / "run_info.json").write_text(json.dumps(info))
        return d

    text = host_report({"fit": [run("p1", ["cuda:0"])], "test": [run("p2", ["cuda:0", "cuda:0"])]})
    assert "1 run(s) had stages sharing one GPU (p2)" in text
    apart = host_report({"fit": [run("q1", ["cuda:0", "cuda:1"])], "test": [run("q2", ["cpu", "cpu"])]})
    assert "sharing one GPU" not in apart
    unprobed = _run(tmp_path, "u", None)  # no probe in the fit runs: the shared-GPU line still comes
    info = json.loads((unprobed / "run_info.json").read_text()) | {"stages": [{"device": "cuda:0"}] * 2}
    (unprobed / "run_info.json").write_text(json.dumps(info))
    assert "1 run(s) had stages sharing one GPU (u)" in host_report({"fit": [unprobed]})
