"""`testbed validate` as a matrix: cases x comma-list axes, one table with p99s; a tiny CPU run."""
from __future__ import annotations

import json
import math

import pytest

from engine.base.errors import ConfigError
from testbed.calibrate.profile import format_matrix, matrix_row, parse_case, validate_plan


def test_plan_is_cases_times_axes():
    cases = [parse_case("sharegpt: workload=sharegpt workload.arrival=offline"),
             parse_case("azure-r2: workload=azure workload.rate=2")]
    plan = validate_plan(["hardware=h100-80g", "policy=sarathi,vllm,gllm,tdpipe", "parallel.pp=1,2",
                          "workload=synthetic"], cases)
    assert len(plan) == 2 * 4 * 2
    labels = [label for label, _ in plan]
    assert labels[0] == "sharegpt,sarathi · pp=1" and labels[-1] == "azure-r2,tdpipe · pp=2"
    ovs = dict(plan)[labels[-1]]
    assert "workload=azure" in ovs and "workload=synthetic" not in ovs  # the case's keys win
    assert "workload.rate=2" in ovs and "hardware=h100-80g" in ovs
    assert validate_plan(["hardware=x", "policy=vllm"], [])[0][0] == "base"


@pytest.mark.parametrize("text", ["no-colon workload=azure", "bad name: workload=azure", "x:", "x: notkeyvalue"])
def test_bad_case(text):
    with pytest.raises(ConfigError, match="invalid --case .*expected 'NAME: key=value ...'"):
        parse_case(text)


def test_bad_case_on_the_command_line(capsys):
    from testbed.cli import main

    assert main(["validate", "hardware=a100-80g", "--case", "oops"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: invalid --case 'oops': expected 'NAME: key=value ...', e.g. 'azure-r2: workload=azure workload.rate=2'"]
    assert main(["validate", "hardware=a100-80g", "--case", "a: policy=vllm", "--case", "a: policy=gllm"]) == 2


def test_matrix_table_marks_targets_and_failures():
    from testbed.config.spec import compose_spec

    cfg = compose_spec(["workload=azure", "workload.rate=2.0", "policy=gllm", "parallel.pp=1"])
    rows = [{"metric": m, "real": 1.0, "sim": 1.0 + e, "rel_error": e} for m, e in (
        ("throughput_tok_s", 0.05), ("ttft_mean_s", -0.14), ("ttft_p99_s", 0.5), ("tpot_mean_s", 0.02),
        ("tpot_p99_s", 0.3), ("e2el_p99_s", 0.1))]
    good = matrix_row("azure-r2,policy=gllm", cfg, rows)
    assert good["within_targets"] and good["tpot_p99_s.rel_error"] == 0.3
    bad_rows = [dict(r, rel_error=0.2) if r["metric"] == "tpot_mean_s" else r for r in rows]
    bad = matrix_row("b", cfg, bad_rows)
    failed = matrix_row("c", cfg, None, "the real run failed: boom")
    text = format_matrix([good, bad, failed])
    assert "TTFT p99" in text and "TPOT p99" in text and "E2EL p99" in text
    lines = text.splitlines()
    assert lines[2].endswith("met") and "50.0%" in lines[2]
    assert lines[3].endswith("missed")
    assert "failed: the real run failed: boom" in lines[4]


@pytest.mark.slow  # long real-engine case (issue 25 item 15: the default set's CPU); `./tb test -m slow`
def test_validate_matrix_runs_on_cpu(tmp_path, capsys):
    """Two policies x two cases, the real torch engine at P=1 and the simulator, in one invocation."""
    pytest.importorskip("torch")
    from testbed.cli import main

    out = tmp_path / "v"
    rc = main(["validate", "hardware=a100-80g", "model=tiny-llama", "parallel.pp=1", "policy=sarathi,vllm",
               "workload=synthetic", "workload.num_requests=4", "workload.input_mean=24", "workload.output_mean=4",
               "output.mlflow=false", f"output.dir={tmp_path}", f"executor.model_cache_dir={tmp_path / 'models'}",
               "--case", "offline: workload.arrival=offline", "--case", "r8: workload.rate=8", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    summary = json.loads((out / "matrix.json").read_text())
    assert [r["point"] for r in summary] == ["offline,policy=sarathi", "offline,policy=vllm", "r8,policy=sarathi",
                                            "r8,policy=vllm"]
    assert all(r["status"] == "ok" and r["pp"] == 1 for r in summary)
    assert {r["rate"] for r in summary if r["point"].startswith("r8")} == {8.0}
    for r in summary:
        assert r["throughput_tok_s.real"] > 0 and math.isfinite(r["tpot_p99_s.rel_error"])
    assert (out / "matrix.csv").exists() and "TPOT p99" in (out / "matrix.md").read_text()
    assert len(list(out.glob("00?_*/real/summary.json"))) == 4 and len(list(out.glob("00?_*/sim"))) == 4
    assert "TTFT p99" in text
