"""First-hour friction (issue 25, item 14): the data cache honours XDG_CACHE_HOME, tests stay out
of the checkout's runs/, piped output is not wrapped at 80 columns, run folders follow one
pattern."""
from __future__ import annotations

import os
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
    from testbed.outputs import folder_name

    cfg = small_config(out_dir=tmp_path)
    assert folder_name(cfg).startswith(f"{cfg['policy']['name']}_synthetic_")
    assert folder_name(cfg, who="served").startswith("served_synthetic_")  # bench serve: its label
    assert folder_name(cfg, who="gllm", what="serve-sim").startswith("gllm_serve-sim_")
    assert folder_name(cfg, who="my label/x").startswith("my-label-x_synthetic_")
