"""`testbed compare`: one row per grid point carrying the metrics of its MLflow run; a point that
fails is a failed row, not a failed grid; a typo fails before anything runs."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pandas as pd
import pytest

from mlflow_db import fresh_mlflow_db
from testbed.cli import main
from testbed.tracking.tracker import HEADLINE_METRICS

# llama2-13b does not fit one 24 GiB RTX 4090 (pp=1) but fits two (pp=2): half the grid fails.
BASE = ["workload=synthetic", "workload.num_requests=60", "model=llama2-13b", "hardware=rtx4090",
        "output.plots=false", "output.progress=false"]
METRICS = ("throughput_tok_s", "ttft_p99_s", "tpot_p99_s", "e2el_mean_s", "slo_attainment", "num_finished")


def test_grid_rows_match_their_mlflow_runs(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    fresh_mlflow_db(tmp_path)
    code = main(["compare", *BASE, f"output.dir={tmp_path}", "policy=sarathi,vllm", "parallel.pp=1,2",
                 "compare.workers=2", "compare.experiment=grid"])
    captured = capsys.readouterr()
    assert code == 1  # two points do not fit: the command fails, after writing the whole table
    assert captured.err.count("error: 2 of 4 point(s) failed") == 1 and "does not fit" in captured.err
    out_dir = Path(captured.out.strip().splitlines()[-1])
    assert out_dir == (tmp_path / "compare" / "grid").resolve()
    table = pd.read_csv(out_dir / "table.csv")
    assert len(table) == 4
    assert list(zip(table["point"], table["policy"], table["parallel.pp"])) == [
        (0, "sarathi", 1), (1, "sarathi", 2), (2, "vllm", 1), (3, "vllm", 2)]
    failed = table[table["parallel.pp"] == 1]
    assert (failed["status"] == "failed").all()
    assert failed["error"].str.contains("does not fit").all()
    done = table[table["parallel.pp"] == 2]
    assert (done["status"] == "finished").all() and (done["num_finished"] == 60).all()

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    exp = client.get_experiment_by_name("grid")
    runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    parent = [r for r in runs.values() if r.data.tags.get("testbed.kind") == "compare"]
    assert len(parent) == 1 and len(runs) == 5
    # the printed link opens this experiment's chart view (issue 25, item 11)
    assert f"#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning&compareRunsMode=CHART" in captured.err
    # ... in a saved view that shows every run (MLflow shows the first 10 otherwise: issue 40 item 1)
    assert "viewStateShareKey=testbed-all-runs" in captured.err
    state = json.loads(json.loads(exp.tags["mlflow.sharedViewState.testbed-all-runs"])["state"])
    assert state["runsHiddenMode"] == "SHOW_ALL" and state["compareRunSections"][0]["name"] == "headline"
    for _, row in table.iterrows():
        run = runs[row["run_id"]]
        assert run.data.tags["testbed.parent_run"] == parent[0].info.run_id
        assert "mlflow.parentRunId" not in run.data.tags  # not nested: MLflow's UI would collapse it
        assert run.data.params["policy.name"] == row["policy"]
        assert run.data.params["parallel.pp"] == str(row["parallel.pp"])
        assert run.data.tags["axis.parallel.pp"] == str(row["parallel.pp"])
        assert run.info.run_name == f"{row['policy']} · pp={row['parallel.pp']}"  # what varies, `testbed run`'s style
        if row["status"] == "finished":
            assert run.info.status == "FINISHED"
            for m in METRICS:
                assert run.data.metrics[m] == pytest.approx(row[m], rel=1e-12), m
            # the one named chart section, so MLflow shows it first: the headline metrics
            assert {k for k in run.data.metrics if "/" in k} == {f"headline/{m}" for m in HEADLINE_METRICS}
            assert run.data.metrics["headline/throughput_tok_s"] == run.data.metrics["throughput_tok_s"]
        else:
            assert run.info.status == "FAILED" and "does not fit" in run.data.tags["error"]
    # the same rows as Markdown, and a figure per metric: x = the numeric axis, one line per policy
    md = (out_dir / "table.md").read_text().splitlines()
    assert md[0].startswith("| point | policy | parallel.pp | status | throughput_tok_s")
    assert len(md) == 2 + 4
    for name in ("throughput_tok_s_vs_parallel.pp.png", "ttft_p99_s_vs_parallel.pp.png", "overview.png"):
        assert (out_dir / name).stat().st_size > 0
    assert {"table.csv", "table.md", "overview.png"} <= {a.path for a in client.list_artifacts(parent[0].info.run_id)}
    assert sorted(p.name for p in (out_dir / "runs").iterdir()) == [  # run directories of the finished points
        "001_policy=sarathi_parallel.pp=2", "003_policy=vllm_parallel.pp=2"]
    # the run folder budget: summaries by default, no trace or per-request tables (output.* asks for them)
    assert sorted(p.name for p in (out_dir / "runs" / "001_policy=sarathi_parallel.pp=2").iterdir()) == [
        "breakdown.json", "config.yaml", "run_info.json", "summary.json"]  # breakdown: a few KB (engine/core/breakdown.py)


def test_points_keep_traces_and_tables_when_asked_and_overload_is_warned(tmp_path, capsys):
    """`output.requests=true output.trace=sampled` keep what the budget leaves out; a point offered
    more than it serves gets `testbed run`'s overload warning (issue 40 item 2)."""
    code = main(["compare", "workload=synthetic", "workload.num_requests=300", "model=llama2-13b", "hardware=a100-80g",
                 "parallel.pp=2", "output.mlflow=false", "output.progress=false", f"output.dir={tmp_path}",
                 "output.requests=true", "output.microbatches=true", "output.trace=sampled", "workload.rate=0.5,200",
                 "compare.experiment=load"])
    captured = capsys.readouterr()
    assert code == 0
    table = pd.read_csv(tmp_path / "compare" / "load" / "table.csv")
    assert (table["offered_tok_s"] > 0).all()
    warning = " ".join(captured.err.split())  # the console wraps lines
    assert "warning: overloaded: in 1 of 2 points" in warning and "points 1 (rate=200);" in warning
    assert "(rate=0.5)" not in warning
    for run_dir in (tmp_path / "compare" / "load" / "runs").iterdir():
        assert {"requests.csv", "microbatches.csv", "trace.json"} <= {p.name for p in run_dir.iterdir()}


def test_a_typo_in_the_grid_fails_before_anything_runs(tmp_path, capsys):
    code = main(["compare", *BASE, f"output.dir={tmp_path}", "policy=sarathi,nope", "compare.experiment=typo"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: unknown policy 'nope'; valid choices:") and "\n" not in err
    assert not (tmp_path / "compare").exists() and not (tmp_path / "mlflow.db").exists()
    code = main(["compare", *BASE, f"output.dir={tmp_path}", "compare.wrokers=2"])
    assert code == 2 and "unknown compare key 'compare.wrokers'; valid keys: experiment, metrics, workers, x" in \
        capsys.readouterr().err


def test_grid_expansion():
    from testbed.sweep.compare import grid

    axes, points = grid(["policy=sarathi,vllm", "workload.rate=range(2,7,2)", "parallel.layer_split=[20,20]",
                         "seed=1"])
    assert axes == ["policy", "workload.rate"]
    assert len(points) == 6
    assert points[0].overrides == ("parallel.layer_split=[20,20]", "seed=1", "policy=sarathi", "workload.rate=2")
    assert points[-1].label == "vllm · rate=6"


# --- signals: SIGTERM is Ctrl-C, nothing keeps running, nothing stays RUNNING -------------------------

# point 0 finishes at once; the others (30k requests) are still running when the signal comes
SIGNAL_GRID = ["workload=synthetic", "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2", "output.plots=false",
               "workload.num_requests=40,30000,30001,30002,30003,30004", "compare.workers=2"]


def _signalled_grid(tmp_path: Path, send: str):
    from signal_helpers import WAIT_S, Command, run_states, running_kinds, survivors

    fresh_mlflow_db(tmp_path)
    cmd = Command("compare", *SIGNAL_GRID, f"output.dir={tmp_path}", "compare.experiment=sig")
    cmd.wait_for("point   0 done")
    deadline = time.monotonic() + WAIT_S  # a 30k-request point has opened its MLflow run (slow on a loaded machine)
    while time.monotonic() < deadline and not any(kind == "point" for kind, _ in running_kinds(tmp_path / "mlflow.db")):
        time.sleep(0.2)
    children = cmd.descendants()
    assert len(children) >= 2  # the two workers (and multiprocessing's resource tracker)
    code = {"TERM": cmd.terminate, "INT": cmd.interrupt, "TERM,TERM": cmd.terminate_repeatedly}[send]()
    return code, survivors(children), run_states(tmp_path / "mlflow.db"), cmd


# Default set (issue 25 item 15: 8-13 s of CPU a variant): Ctrl-C here, which reaches the whole process
# group, workers included; tests/test_capacity.py sends SIGTERM to the parent alone, through the same
# worker pool (testbed/sweep/jobs.py). SIGTERM here runs with `-m slow`.
# TERM,TERM: SIGTERM again every 0.1 s for 3 s; a second one killed compare by the raw signal
# (status -15, not 143) or cut its cleanup (issue 38 item 6).
@pytest.mark.parametrize("send, exit_code", [pytest.param("TERM", 143, marks=pytest.mark.slow), ("INT", 130),
                                             ("TERM,TERM", 143)])
def test_a_signal_stops_the_grid_at_once_and_kills_its_runs(tmp_path, send, exit_code):
    code, alive, runs, cmd = _signalled_grid(tmp_path, send)
    assert code == exit_code, "".join(cmd.err)[-2000:]
    assert "Traceback" not in "".join(cmd.err), "".join(cmd.err)[-2000:]
    assert alive == []  # no orphaned worker
    assert "RUNNING" not in {r["status"] for r in runs.values()}, runs
    parent = [r for r in runs.values() if r["kind"] == "compare"]
    assert len(parent) == 1 and parent[0]["status"] == "KILLED"
    points = {r["name"]: r["status"] for r in runs.values() if r["kind"] == "point"}
    assert points["num_requests=40"] == "FINISHED"  # named by what varies
    assert "KILLED" in points.values()  # the 30k-request point(s) in flight
    assert len(points) <= 4  # 2 workers: no point was launched after the signal (6 in the grid)
    # the table of the points done so far
    table = pd.read_csv(tmp_path / "compare" / "sig" / "table.csv")
    assert list(table["workload.num_requests"]) == [40] and list(table["status"]) == ["finished"]


def test_the_micro_batch_count_is_an_ordinary_axis(tmp_path, capsys):
    code = main(["compare", *BASE, f"output.dir={tmp_path}", "output.mlflow=false",
                 "policy=sarathi", "parallel.pp=2", "parallel.num_microbatches=2,3,4", "compare.experiment=mb"])
    assert code == 0
    table = pd.read_csv(tmp_path / "compare" / "mb" / "table.csv")
    assert list(table["parallel.num_microbatches"]) == [2, 3, 4] and (table["status"] == "finished").all()


def test_the_printed_table_is_never_cut_to_the_console_width(tmp_path):
    from rich.console import Console

    from testbed.sweep.report import print_table

    console = Console(width=80, record=True, file=open(tmp_path / "out.txt", "w"))
    df = pd.DataFrame([{"point": 0, "policy": "sarathi", "workload.rate": 2.0, "parallel.num_microbatches": 4,
                        "status": "finished", "throughput_tok_s": 12345.6, "ttft_p99_s": 0.123456,
                        "tpot_p99_s": 0.0456, "e2el_mean_s": 3.21, "slo_attainment": 0.987}])
    print_table(console, df, ["policy", "workload.rate", "parallel.num_microbatches"], "wide")
    text = console.export_text()
    for column in ("parallel.num_microbatches", "throughput_tok_s", "slo_attainment", "1.235e+04", "0.987"):
        assert column in text, text
    assert "…" not in text


def test_a_killed_sweep_kills_its_own_running_points_only(tmp_path):
    """The summary run finds its points by the `testbed.parent_run` tag (they are not nested)."""
    from conftest import small_config

    from testbed.sweep import jobs as sweep

    fresh_mlflow_db(tmp_path)
    cfg = small_config("output.mlflow=true", out_dir=tmp_path)
    summary = sweep.ParentRun(cfg.output, "kc", "kc", {"testbed.kind": "compare"})
    tracker = sweep._tracker(cfg.output, "kc")
    point = tracker.start(cfg, "p0", tags={sweep.PARENT_TAG: summary.run_id})
    unrelated = tracker.start(cfg, "another sweep's point", tags={sweep.PARENT_TAG: "someone-else"})
    summary.end("KILLED")
    status = {rid: tracker.client.get_run(rid).info.status for rid in (summary.run_id, point, unrelated)}
    assert status == {summary.run_id: "KILLED", point: "KILLED", unrelated: "RUNNING"}
    assert tracker.client.get_run(point).data.tags["error"] == "interrupted"


def test_runs_left_running_by_a_killed_sweep_are_ended_by_the_next_one(tmp_path, capsys):
    """SIGKILL (or the OOM killer) leaves no handler to end the summary run: it stayed RUNNING for
    good (issue 38 item 6). The next sweep on this host ends it KILLED, with its point runs, and
    says so; its own runs are not touched. One worker (the command itself): no orphaned worker
    ends them first (tests/test_orphaned_workers.py)."""
    from signal_helpers import WAIT_S, Command, run_states, running_kinds, survivors

    fresh_mlflow_db(tmp_path)
    grid = [a.replace("compare.workers=2", "compare.workers=1") for a in SIGNAL_GRID]
    cmd = Command("compare", *grid, f"output.dir={tmp_path}", "compare.experiment=killed")
    cmd.wait_for("point   0 done")
    deadline = time.monotonic() + WAIT_S  # 60 s once: under load the kill could come before that run opened
    while time.monotonic() < deadline and not any(kind == "point" for kind, _ in running_kinds(tmp_path / "mlflow.db")):
        time.sleep(0.2)
    children = cmd.descendants()
    cmd.kill()
    assert survivors(children) == []
    assert "compare" in {kind for kind, _ in running_kinds(tmp_path / "mlflow.db")}
    code = main(["compare", *BASE, f"output.dir={tmp_path}", "parallel.pp=2", "policy=sarathi",
                 "compare.experiment=next"])
    assert code == 0
    assert "note: ended KILLED 1 run(s) left RUNNING by a sweep that was killed: killed" in capsys.readouterr().err
    runs = run_states(tmp_path / "mlflow.db")
    assert "RUNNING" not in {r["status"] for r in runs.values()}, runs
    assert [r["status"] for r in runs.values() if r["kind"] == "compare" and r["name"] == "killed"] == ["KILLED"]
    assert [r["status"] for r in runs.values() if r["kind"] == "compare" and r["name"] == "next"] == ["FINISHED"]
