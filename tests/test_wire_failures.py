"""Small failures of the torch engine reported right (issue 13 items 7 and 9).

- `executor.device=cuda` on a machine without CUDA: one `error:` line naming the device, exit 2.
- A fault injected on stage 1 is reported as stage 1 (also when stage 0's own wait on it fails).
- A very slow paced link (10 kbps) is slow, not hung: bytes still moving count as progress.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("zmq")

import engine.torch_exec  # noqa: E402,F401
from engine.pricing.models import get_model  # noqa: E402
from engine.core.request import Request  # noqa: E402
from engine.torch_exec.weights.checkpoint import random_checkpoint  # noqa: E402
from test_torch_engine import _assert_no_children  # noqa: E402


@pytest.fixture(scope="module")
def model_cache(model_cache):  # conftest's folder, with tiny-llama built
    random_checkpoint(get_model("tiny-llama"), 0, model_cache)
    return model_cache


def _cfg(model_cache, tmp_path, *extra):
    from testbed.config.spec import compose_spec

    return compose_spec([
        "executor=torch", "model=tiny-llama", "parallel.pp=2", "policy=sarathi", "workload=synthetic",
        "workload.num_requests=4", "workload.arrival=offline", "workload.input_mean=32",
        "workload.output_mean=200", "kv.num_blocks=64", "kv.block_size=16",
        f"executor.model_cache_dir={model_cache}", f"output.dir={tmp_path}", *extra])


def test_cuda_without_a_gpu_is_one_error_line(monkeypatch, capsys, tmp_path):
    from testbed.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = main(["run", "executor=torch", "executor.device=cuda", "model=tiny-llama", "workload=synthetic",
                 "workload.num_requests=2", f"output.dir={tmp_path}", "output.mlflow=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: executor.device=cuda"), err
    assert "no CUDA device is available" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("fault", ["exit:1:3", "hang:1:3", "raise:1:3"])
def test_fault_on_stage_1_is_reported_as_stage_1(fault, model_cache, tmp_path):
    from testbed.run.runner import run_experiment

    res = run_experiment(_cfg(model_cache, tmp_path, f"executor.fault={fault}", "executor.stage_timeout_s=3"))
    assert res.error is not None
    assert res.error.startswith("stage 1"), res.error
    _assert_no_children()


def test_slow_paced_link_is_not_hung(model_cache, tmp_path):
    """10 kbps = 1250 B/s: a 6-token prefill's activations (6 x 256 x 4 bytes) take about 5 s on
    the link, longer than executor.stage_timeout_s=2; the run still finishes."""
    from testbed.run.runner import prepare_experiment

    cfg = _cfg(model_cache, tmp_path, "link.bandwidth=10kbps", "link.latency=0", "executor.stage_timeout_s=2")
    res = prepare_experiment(cfg, requests=[Request(0, 0.0, 6, 2)]).run()
    assert res.error is None, res.error
    assert res.summary["num_finished"] == 1
    xfers = [b - a for track, name, a, b, _ in res.tracer.spans if track == "link0" and name.startswith("xfer")]
    assert xfers and max(xfers) > 2.0, xfers  # the precondition: one transfer outlasted stage_timeout_s
    _assert_no_children()
