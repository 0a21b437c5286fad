"""The `testbed` command: bad input gives one clear line and exit code 2; a run writes its
directory and one MLflow run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, needle", [
    (["policy=nope"], "unknown policy 'nope'; valid choices:"),
    (["workload=nope"], "unknown workload 'nope'; valid choices: azure, sharegpt, synthetic"),
    (["hardware=tpu"], "unknown hardware 'tpu'; valid choices: a100-40g"),
    (["model=gpt5"], "unknown model 'gpt5'; valid choices:"),
    (["executor=gpu"], "unknown executor 'gpu'"),
    (["executor=torch", "executor.start_method=fork"], "executor.start_method='fork'"),
    (["foo.bar=1"], "unknown config key 'foo.bar'"),
    (["parallel.ppp=2"], "unknown config key 'parallel.ppp'; valid keys under 'parallel': layer_split, num_microbatches, pp, tp"),
    (["policy.token_budgt=5", "policy=sarathi"], "unknown config key 'policy.token_budgt'"),
    (["workload=sharegpt", "workload.rate=-1"], "workload.rate"),
    (["workload=sharegpt", "workload.rate=0"], "workload.rate"),
    (["model=llama2-70b", "hardware=rtx4090", "parallel.pp=1"], "does not fit"),
    (["policy=sarathi", "policy.token_budget=0"], "policy.token_budget"),
    (["parallel.pp=0"], "parallel.pp"),
    (["slo.ttft_s=-1"], "slo.ttft_s"),
    (["link.bandwidth=fast"], "fast"),
    (["noequals"], "is not key=value"),
])
def test_bad_input_is_one_clear_line_and_exit_2(args, needle, capsys, tmp_path):
    code = main(["run", f"output.dir={tmp_path}", "output.mlflow=false", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err, err
    assert needle in err
    assert "Traceback" not in err


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "run", "policy=nope", f"output.dir={tmp_path}"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: unknown policy 'nope'") and "Traceback" not in proc.stderr


def test_run_writes_run_dir_and_logs_to_mlflow(tmp_path, capsys):
    code = main(["run", "policy=sarathi", "workload=azure", "workload.num_requests=150", "workload.rate=3",
                 "hardware=a100-80g", "model=llama2-13b", "parallel.pp=2", f"output.dir={tmp_path}",
                 "output.progress=false"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    run_dir = Path(out[-1])
    assert run_dir.parent == tmp_path.resolve()
    for name in ("summary.json", "run_info.json", "config.yaml", "requests.csv", "trace.json",
                 "timeline.png", "kv_usage.png"):
        assert (run_dir / name).stat().st_size > 0, name
    assert not (run_dir / "microbatches.csv").exists()  # the simulator's: behind output.microbatches=true
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("num_requests", "num_finished", "throughput_tok_s", "output_throughput_tok_s", "ttft_mean_s",
                "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "e2el_mean_s", "slo_attainment", "bubble_ratio",
                "stage_utilization", "num_preemptions", "num_microbatches"):
        assert key in summary
    assert summary["num_finished"] == 150
    trace = json.loads((run_dir / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"stage0", "stage1", "link0-1"} <= names

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    exp = client.get_experiment_by_name("testbed")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["policy.name"] == "sarathi"
    assert run.data.params["parallel.pp"] == "2"
    assert run.data.metrics["num_finished"] == 150
    assert "stage_utilization.stage1" in run.data.metrics
    hist = client.get_metric_history(run.info.run_id, "step.kv_usage")
    assert len(hist) > 10
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "trace.json", "timeline.png"} <= arts


def test_failed_run_is_recorded_failed(tmp_path, monkeypatch, capsys):
    import testbed.run.runner as runner
    from test_controller import LazyPolicy

    from mlflow_db import fresh_mlflow_db

    fresh_mlflow_db(tmp_path)  # the first-run migration is covered by the test above
    monkeypatch.setattr(runner, "build_policy", lambda cfg: LazyPolicy())
    code = main(["run", "workload=synthetic", "workload.num_requests=20", "model=llama2-13b", "hardware=a100-80g",
                 f"output.dir={tmp_path}", "output.progress=false", "output.plots=false"])
    assert code == 1
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])[0]
    assert run.info.status == "FAILED"
    assert "scheduled nothing" in run.data.tags["error"]
    summary = json.loads((Path(capsys.readouterr().out.strip().splitlines()[-1]) / "summary.json").read_text())
    assert summary["num_failed"] == 20


def test_list_shows_every_group(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for line in ("policy:", "workload:", "executor:", "hardware:", "model:"):
        assert line in out
    assert "l20-48g" in out and "qwen2.5-32b" in out


def test_data_sharegpt_command_builds_a_usable_pairs_file(tmp_path, capsys):
    from test_workloads import sharegpt_source, word_tokenizer

    src = sharegpt_source(tmp_path / "sg.json", truncate=True)
    tok = word_tokenizer(tmp_path / "tok.json", False)
    out = tmp_path / "pairs.jsonl.gz"
    assert main(["data", "sharegpt", "--source", str(src), "--tokenizer", str(tok), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "truncated: True" in printed and printed.strip().splitlines()[-1] == str(out.resolve())
    code = main(["run", "policy=sarathi", "workload=sharegpt", f"workload.path={out}", "workload.num_requests=3",
                 "workload.arrival=offline", "model=llama2-13b", "hardware=a100-80g", "output.mlflow=false",
                 "output.plots=false", "output.progress=false", f"output.dir={tmp_path}"])
    assert code == 0
    run_dir = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads((run_dir / "summary.json").read_text())["num_finished"] == 3


def test_predictor_train_prints_accuracy_and_saves_the_model(tmp_path, capsys, shared_data):
    code = main(["predictor", "train", "workload=azure", "workload.trace=code", f"output.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    acc = float(out.split("bin accuracy (test): ")[1].split()[0])
    assert 0.2 < acc <= 1.0
    assert "256 requests:" in out
    saved = Path(out.strip().splitlines()[-1])
    assert (saved / "model.json").is_file() and (saved / "meta.json").is_file() and not (saved / "model.pkl").exists()


def test_bench_sim_prints_figures(capsys):
    code = main(["bench", "sim", "--policies", "vllm", "workload.num_requests=80", "model=llama2-13b"])
    out = capsys.readouterr().out
    assert code == 0
    assert "simulator benchmark (reference)" in out and "vllm" in out and "peak RSS MB" in out
    assert "bare e2e s" in out and "workload=sharegpt" in out


def test_bench_sim_main_setting_is_the_main_jobs_workload(capsys):
    code = main(["bench", "sim", "--setting", "main", "--no-e2e", "--policies", "vllm",
                 "workload.num_requests=60", "model=llama2-13b"])
    out = capsys.readouterr().out
    assert code == 0 and "simulator benchmark (main): workload=azure" in " ".join(out.split())


def test_run_help_points_to_testbed_list(capsys):
    """`testbed run --help` says where the choices are (issue 40 item 6)."""
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_.value.code == 0 and "`testbed list` shows every group's choices" in out


def test_a_test_node_id_is_passed_to_pytest_whole(tmp_path, monkeypatch):
    """`./tb test tests/test_x.py::test_y` gave pytest `.../test_x.py::test_y::test_y` (no tests ran)."""
    from testbed.cli import absolute_test_paths

    (tmp_path / "test_x.py").write_text("")
    monkeypatch.chdir(tmp_path)
    assert absolute_test_paths(["-x", "test_x.py::test_y", "test_x.py", "nope.py::t"]) == \
        ["-x", f"{tmp_path.resolve()}/test_x.py::test_y", f"{tmp_path.resolve()}/test_x.py", "nope.py::t"]
