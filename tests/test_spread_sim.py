"""Issue 47: a run predicted as the mean over a spread of machine speeds (`validate --runs --spread`,
testbed/calibrate/spread_sim.py) and the simulator's `executor.compute_scale` it is built on."""
from __future__ import annotations

import pytest

from conftest import small_config
from testbed.calibrate.spread_sim import compute_scales, simulate_spread
from testbed.run.runner import run_experiment
from test_calibrate_runs import as_cpu_engine_run


def test_the_scales_are_even_around_one_and_no_spread_is_one_point():
    assert compute_scales(0.0) == (1.0,)
    scales = compute_scales(0.05)
    assert len(scales) == 9 and scales[0] == pytest.approx(0.95) and scales[-1] == pytest.approx(1.05)
    assert sum(scales) / len(scales) == pytest.approx(1.0) and 1.0 in scales


def test_a_slower_machine_takes_longer_and_scale_one_is_the_default():
    base = ("policy=sarathi", "workload.num_requests=40")  # llama2-13b on an A100: the forward dominates
    default = run_experiment(small_config(*base)).summary
    assert run_experiment(small_config(*base, "executor.compute_scale=1.0")).summary == default
    slow = run_experiment(small_config(*base, "executor.compute_scale=1.5")).summary
    assert slow["tpot_mean_s"] > 1.3 * default["tpot_mean_s"]


def test_the_spread_prediction_is_the_mean_of_the_scaled_replays(tmp_path):
    from testbed.calibrate.replay_sim import simulate_run
    from testbed.calibrate.runs import load_run

    res = run_experiment(small_config("policy=sarathi", "workload.num_requests=40", "workload.arrival=poisson",
                                      "workload.rate=40", "output.trace=full", "output.microbatches=true"))
    run = load_run(as_cpu_engine_run(res, tmp_path / "real"))
    point, predicted = simulate_spread(run, "a100-80g", 0.05)
    singles = [simulate_run(run, "a100-80g", compute_scale=s).summary for s in compute_scales(0.05)]
    for key in ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s"):
        assert predicted[key] == pytest.approx(sum(s[key] for s in singles) / len(singles), rel=1e-12)
    assert predicted["tpot_mean_s"] != point.summary["tpot_mean_s"]
    assert simulate_spread(run, "a100-80g", 0.0)[1] == point.summary


@pytest.mark.parametrize("args, message", [
    (["validate", "--spread", "0.1", "policy=gllm"], "--spread=0.1: it applies to replays of real runs only"),
    (["validate", "--runs", "nowhere", "hardware=a100-80g", "--spread", "0.7"], "--spread=0.7: must be a number in [0, 0.5]"),
    (["run", "executor.compute_scale=0", "workload.num_requests=5"], "executor.compute_scale=0"),
])
def test_a_bad_spread_or_scale_is_one_error_line(capsys, args, message):
    from testbed.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def test_validate_runs_reports_the_spread_prediction(tmp_path, capsys):
    import json

    from testbed.calibrate.runs import load_run
    from testbed.cli import main

    res = run_experiment(small_config("policy=sarathi", "workload.num_requests=40", "workload.arrival=poisson",
                                      "workload.rate=40", "output.trace=full", "output.microbatches=true"))
    run_dir = as_cpu_engine_run(res, tmp_path / "real")
    want = simulate_spread(load_run(run_dir), "a100-80g", 0.05)[1]
    assert main(["validate", "--runs", str(run_dir), "hardware=a100-80g", "--spread", "0.05",
                 "--out", str(tmp_path / "v")]) == 0
    assert "mean of 9 simulations at compute scales 0.95-1.05" in capsys.readouterr().out
    row = json.loads((tmp_path / "v" / "errors.json").read_text())[0]
    tpot = next(e for e in row["errors"] if e["metric"] == "tpot_mean_s")
    assert tpot["sim"] == pytest.approx(want["tpot_mean_s"], rel=1e-12)
