"""`testbed report`: tables and figures rebuilt from MLflow equal what the runs logged."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from mlflow_db import fresh_mlflow_db
from testbed.cli import main

BASE = ["workload=synthetic", "workload.num_requests=60", "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2",
        "output.plots=false", "output.progress=false"]


def test_report_rebuilds_the_comparison_from_mlflow(tmp_path, capsys):
    uri = fresh_mlflow_db(tmp_path)
    assert main(["compare", *BASE, f"output.dir={tmp_path}", "policy=sarathi,vllm", "workload.rate=2,4,8",
                 "compare.experiment=rates"]) == 0
    compare_dir = Path(capsys.readouterr().out.strip().splitlines()[-1])
    out = tmp_path / "report"
    assert main(["report", "rates", "--tracking-uri", uri, "--out", str(out)]) == 0
    assert Path(capsys.readouterr().out.strip().splitlines()[-1]) == out.resolve()
    original = pd.read_csv(compare_dir / "table.csv")
    rebuilt = pd.read_csv(out / "table.csv")
    assert len(rebuilt) == len(original) == 6
    key = ["policy", "workload.rate"]
    a = original.sort_values(key).reset_index(drop=True)
    b = rebuilt.sort_values(key).reset_index(drop=True)
    assert list(a["run_id"]) == list(b["run_id"])
    for col in key + ["status"]:
        assert list(a[col]) == list(b[col])
    for m in ("throughput_tok_s", "ttft_p99_s", "tpot_p99_s", "e2el_mean_s", "slo_attainment", "num_finished"):
        assert list(b[m]) == pytest.approx(list(a[m]), rel=1e-12), m
    assert (out / "throughput_tok_s_vs_workload.rate.png").stat().st_size > 0
    md = (out / "table.md").read_text()
    assert md.startswith("| policy | workload.rate | status | throughput_tok_s")


def test_report_infers_axes_of_plain_runs(tmp_path, capsys):
    """Runs of `testbed run` carry no axis tags: the params that differ become the axes."""
    uri = fresh_mlflow_db(tmp_path)
    for budget in (256, 2048):
        assert main(["run", *BASE, "policy=sarathi", "workload.arrival=offline", f"policy.token_budget={budget}",
                     f"output.dir={tmp_path}", "output.experiment=plain"]) == 0
    capsys.readouterr()
    out = tmp_path / "report"
    assert main(["report", "plain", "--tracking-uri", uri, "--out", str(out), "--metrics",
                 "throughput_tok_s,ttft_p99_s"]) == 0
    table = pd.read_csv(out / "table.csv")
    assert list(table["policy.token_budget"]) == [256, 2048]  # the one param that differs, sorted
    assert list(table["status"]) == ["finished", "finished"]
    assert (table["num_finished"] == 60).all()
    assert (out / "throughput_tok_s_vs_policy.token_budget.png").stat().st_size > 0
    # two experiments combined: the experiment becomes an axis (e.g. defaults vs tuned)
    assert main(["run", *BASE, "policy=sarathi", "workload.arrival=offline", "policy.token_budget=256",
                 f"output.dir={tmp_path}", "output.experiment=other"]) == 0
    assert main(["report", "plain", "other", "--tracking-uri", uri, "--out", str(tmp_path / "both")]) == 0
    both = pd.read_csv(tmp_path / "both" / "table.csv")
    assert sorted(zip(both["experiment"], both["policy.token_budget"])) == [
        ("other", 256), ("plain", 256), ("plain", 2048)]


def test_report_errors_are_one_clear_line(tmp_path, capsys):
    code = main(["report", "x", "--tracking-uri", f"sqlite:///{tmp_path}/nothing.db"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: no tracking database at") and "\n" not in err
    uri = fresh_mlflow_db(tmp_path)
    code = main(["report", "missing", "--tracking-uri", uri])
    assert code == 2 and "unknown experiment 'missing'" in capsys.readouterr().err
