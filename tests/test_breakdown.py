"""Where each stage's time went (engine/core/breakdown.py): the parts add up to each stage's wall
time in the simulator's every path, and they explain why TP beats PP on a known case. The real
engine's sum is checked in tests/test_chunked_pp.py (one engine run serves both)."""
from __future__ import annotations

import json

import pytest

import policies  # noqa: F401
from engine.core.breakdown import PARTS, summary_line
from testbed.config.spec import compose_spec
from testbed.run.runner import run_experiment


def _run(*overrides):
    res = run_experiment(compose_spec(["output.mlflow=false", *overrides]))
    assert res.error is None, res.error
    return res


def assert_parts_sum_to_wall(breakdown: dict, tolerance: float = 0.01) -> None:
    for s, row in enumerate(breakdown["stages"]):
        total = sum(row[p] for p in PARTS)
        assert row["wall_s"] > 0
        assert abs(total - row["wall_s"]) <= tolerance * row["wall_s"], (s, total, row["wall_s"])
        assert all(row[p] >= 0 for p in PARTS), row


@pytest.mark.parametrize("overrides", [
    ("policy=sarathi", "workload=azure", "workload.num_requests=150"),  # the FIFO fast path
    ("policy=sipipe", "workload=synthetic", "workload.num_requests=100"),  # events: CPU sampling, overlap
    ("policy=molink", "workload=synthetic", "workload.num_requests=60", "link.latency=30ms",
     "link.bandwidth=100Mbps"),  # policy-scheduled links
    ("policy=vllm", "workload=synthetic", "workload.num_requests=60", "executor.blocking_send=true"),  # sends on the stage
])
def test_parts_sum_to_each_stages_wall_time_in_the_simulator(overrides):
    res = _run(*overrides)
    bd = res.breakdown
    assert len(bd["stages"]) == len(res.stage_tracks)
    assert_parts_sum_to_wall(bd)
    assert bd["stages"][0]["wall_s"] == pytest.approx(res.summary["duration_s"])
    busy = [bd["stages"][s]["compute"] + bd["stages"][s]["host"] + bd["stages"][s]["transfer"]
            for s in range(len(res.stage_tracks))]
    assert busy == pytest.approx([u * res.summary["duration_s"] for u in res.summary["stage_utilization"]], rel=1e-9)
    if "executor.blocking_send=true" in overrides:
        assert bd["stages"][0]["transfer"] > 0


def test_tp_beats_pp_for_one_sequence_and_the_breakdown_says_why():
    """One request decoding alone on Llama-3.1-70B, 4 x A100: PP=4 runs one micro-batch at a time,
    so each stage works a quarter of the time and waits the rest on the stages before it (or has
    no work: the only sequence is in flight); TP=4 keeps its one stage busy. The busy times predict
    the end-to-end ratio: PP's token passes all four stages in turn (sum of their busy time), TP's
    takes one stage's."""
    common = ("policy=sarathi", "workload=synthetic", "workload.num_requests=1", "workload.input_mean=512",
              "workload.output_mean=256", "hardware=a100-80g", "model=llama-3.1-70b")
    pp = _run(*common, "parallel.pp=4")
    tp = _run(*common, "parallel.pp=1", "parallel.tp=4")
    ratio = pp.summary["e2el_mean_s"] / tp.summary["e2el_mean_s"]
    assert ratio > 2  # measured 2.66 (26.6 s vs 10.0 s)
    for s, f in enumerate(pp.breakdown["fractions"]):
        busy = f["compute"] + f["host"] + f["transfer"]
        idle = 1 - busy
        assert 0.2 < busy < 0.3, (s, busy)  # a quarter: one stage of four works at a time
        assert f["idle_wait_prev"] + f["idle_no_work"] > 0.95 * idle  # not held by downstream
    assert pp.breakdown["fractions"][0]["idle_no_work"] > 0.7  # stage 0: its one sequence is in flight
    assert pp.breakdown["fractions"][3]["idle_wait_prev"] > 0.7  # the last stage waits on the others
    tp_f = tp.breakdown["fractions"][0]
    assert tp_f["compute"] + tp_f["host"] > 0.95
    pp_busy = sum(r["compute"] + r["host"] + r["transfer"] for r in pp.breakdown["stages"])
    tp_busy = tp.breakdown["stages"][0]["compute"] + tp.breakdown["stages"][0]["host"]
    assert pp_busy / tp_busy == pytest.approx(ratio, rel=0.1)


def test_run_folder_has_the_breakdown_and_its_figure(tmp_path):
    from testbed.run.outputs import write_run_dir
    from testbed.tracking.tracker import run_metrics

    res = _run("policy=sarathi", "workload=synthetic", "workload.num_requests=40")
    out = write_run_dir(res, tmp_path / "r", plots=True)
    data = json.loads((out / "breakdown.json").read_text())
    assert data["parts"] == list(PARTS) and len(data["stages"]) == 4
    assert (out / "breakdown.png").stat().st_size > 1000
    keys = {k for k, _, _ in run_metrics(res, steps=False)}
    assert {f"breakdown.{p}_frac.stage3" for p in PARTS} <= keys
    line = summary_line(res.breakdown)
    assert line.count("s") >= 4 and "drain" in line and "\n" not in line
