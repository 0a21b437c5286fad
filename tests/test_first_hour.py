"""First-hour friction (issue 25, item 14): the data cache honours XDG_CACHE_HOME, tests stay out
of the checkout's runs/, piped output is not wrapped at 80 columns, run folders follow one
pattern."""
from __future__ import annotations

import os
import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_data_cache_honours_xdg_cache_home(monkeypatch, tmp_path):
    from workloads.data import CACHE_DIR_ENV, cache_dir

    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "testbed" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec: only absolute paths count
    assert cache_dir() == Path("~/.cache/testbed/data").expanduser()
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_a_run_with_default_paths_does_not_write_into_the_checkout(capsys):
    from testbed.cli import main

    assert not Path.cwd().resolve().is_relative_to(REPO)
    before = set((REPO / "runs").iterdir())
    assert main(["run", "output.mlflow=false", "output.plots=false", "output.progress=false", "workload=synthetic",
                 "workload.num_requests=5", "output.run_name=default-paths"]) == 0
    assert (Path.cwd() / "runs" / "default-paths" / "summary.json").is_file()
    assert set((REPO / "runs").iterdir()) == before


def test_piped_output_is_not_wrapped_at_80_columns(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "run", f"output.dir={tmp_path}", "output.mlflow=false",
                           "output.plots=false", "workload=synthetic", "workload.num_requests=5"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    timing = [ln for ln in proc.stderr.splitlines() if ln.startswith("time:")]
    assert len(timing) == 1 and "peak RSS" in timing[0] and timing[0].rstrip().endswith("MB)"), proc.stderr
    assert len(timing[0]) > 80


def test_run_folders_follow_one_pattern(tmp_path):
    from conftest import small_config
    from testbed.run.outputs import folder_name

    cfg = small_config(out_dir=tmp_path)
    assert folder_name(cfg).startswith(f"{cfg.policy_name}_synthetic_")
    assert folder_name(cfg, who="served").startswith("served_synthetic_")  # bench serve: its label
    assert folder_name(cfg, who="gllm", what="serve-sim").startswith("gllm_serve-sim_")
    assert folder_name(cfg, who="my label/x").startswith("my-label-x_synthetic_")


def test_run_prints_its_experiments_chart_view_with_the_headline_first(tmp_path, capsys):
    """Issue 25, item 11: the link opens MLflow's chart view of this run's experiment, whose
    first section (MLflow puts named sections before "Model metrics") holds the headline."""
    from mlflow.tracking import MlflowClient

    from mlflow_db import fresh_mlflow_db
    from testbed.cli import main
    from testbed.tracking.tracker import HEADLINE_METRICS

    uri = fresh_mlflow_db(tmp_path)
    assert main(["run", f"output.dir={tmp_path}", "output.plots=false", "output.progress=false", "workload=synthetic",
                 "workload.num_requests=20"]) == 0
    err = capsys.readouterr().err
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("testbed")
    link = [ln for ln in err.splitlines() if ln.startswith("MLflow charts:")]
    assert len(link) == 1 and link[0].endswith(
        f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}/runs?workflowType=machine_learning"
        f"&compareRunsMode=CHART&viewStateShareKey=testbed-all-runs"), err
    assert f"/mlflow ui --workers 1 --backend-store-uri {uri}" in link[0]  # the venv's mlflow by path (issue 49 item 8)
    exe = link[0].split("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false ", 1)[1].split(" ui ", 1)[0]
    assert Path(exe).is_absolute() and Path(exe).is_file()
    # the view the link opens: every run, headline first (MLflow's chart view shows the first 10 runs)
    state = json.loads(json.loads(exp.tags["mlflow.sharedViewState.testbed-all-runs"])["state"])
    assert state["runsHiddenMode"] == "SHOW_ALL"
    assert [c["metricKey"] for c in state["compareRunCharts"]] == [f"headline/{m}" for m in HEADLINE_METRICS]
    metrics = client.search_runs([exp.experiment_id])[0].data.metrics
    assert {k for k in metrics if "/" in k} == {f"headline/{m}" for m in HEADLINE_METRICS}
    assert all(metrics[f"headline/{m}"] == metrics[m] for m in HEADLINE_METRICS)


def test_test_command_keeps_its_summary_with_q_and_counts_as_it_goes():
    """Issue 25, item 15: `./tb test -q` printed dots only (-q twice with pyproject's addopts)."""
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "test", "-q", "tests/test_kv.py", "-p",
                           "no:cacheprovider"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    passed = re.search(r"(\d+) passed", lines[-1])
    assert passed and f"/{passed.group(1)}]" in proc.stdout, proc.stdout  # counts as it goes: [n/N]
    # at once a header with the count and an estimate (tests/progress.py, issue 49 item 5)
    assert re.match(rf"\[suite\] {passed.group(1)} tests collected; estimate [0-9.]+ (s|min) of wall time", lines[0]), lines[0]


def test_the_multi_host_recipe_installs_what_it_runs():
    """docs/beyond-one-machine.md ran `optuna-dashboard` after installing only the postgres extra,
    and its `mlflow server` refused workers that name it by host name (MLflow 3 needs
    `--allowed-hosts`): issue 38 item 11 and item 7."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (REPO / "docs" / "beyond-one-machine.md").read_text()
    installed: set[str] = set()
    for line in text.splitlines():
        for group in re.findall(r"pip install -e '\.\[([a-z,]+)\]'", line):
            installed.update(dep for extra in group.split(",") for dep in extras[extra])
        if line.startswith("optuna-dashboard "):
            assert any(dep.startswith("optuna-dashboard") for dep in installed), line
    server = text[text.index("mlflow server --backend-store-uri"):]
    assert "--allowed-hosts" in server[:server.index("```")]


def test_the_doc_figures_check_still_finds_every_quote_it_reruns():
    """scripts/check_doc_figures.py reruns each quoted command's cheap form (minutes of CPU, not
    in the fast set); here only that every page still quotes what it checks, so an edit that
    rewords a figure updates the check with it (issue 49 item 9)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_doc_figures", REPO / "scripts" / "check_doc_figures.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    for check in mod.CHECKS:
        found = re.search(check.pattern, (REPO / check.page).read_text())
        assert found and all(found.groups()), f"{check.page} no longer quotes /{check.pattern}/"
    assert mod.main(["--only", "nope"]) == 2


def test_the_recipes_allowed_hosts_keep_the_servers_own_host():
    """`--allowed-hosts` replaces MLflow's defaults (localhost, private addresses): the recipe's
    list refused 127.0.0.1 and localhost on the server's own host (issue 48 item 6). Checked with
    MLflow's own matcher."""
    import shlex

    from mlflow.server.security_utils import is_allowed_host_header

    text = (REPO / "docs" / "beyond-one-machine.md").read_text()
    server = text[text.index("mlflow server --backend-store-uri"):]
    words = shlex.split(server[:server.index("```")].replace("\\\n", " "))
    hosts = words[words.index("--allowed-hosts") + 1].split(",")
    for host in ("mlflow-host", "mlflow-host:5000", "127.0.0.1:5000", "localhost:5000", "localhost"):
        assert is_allowed_host_header(hosts, host), (host, hosts)
    assert not is_allowed_host_header(hosts, "evil.example:5000")
