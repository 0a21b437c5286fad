"""The smaller silent accepts of issue 48 item 7, each now an `error:` line or a warning (each passed
without a word on the old code)."""
from __future__ import annotations

import sqlite3

import pytest

from engine.base.errors import ConfigError
from testbed.cli import main
from testbed.config.spec import compose_spec

BASE = ["policy=sarathi", "workload=synthetic"]


@pytest.mark.parametrize("override, needle", [
    ("parallel.layer_split=[]", "invalid parallel.layer_split='[]'"),  # meant an even split
    ("output.experiment=", "invalid output.experiment=''"),  # landed in "testbed"
])
def test_empty_values_are_refused(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        compose_spec([*BASE, override])


def test_listing_an_empty_group_is_refused(capsys):
    assert main(["list", ""]) == 2  # listed every group
    assert "unknown group ''" in capsys.readouterr().err


def test_a_data_dir_without_the_file_is_said(tmp_path, capsys, shared_data):
    from workloads.data import resolve_data_file

    path = resolve_data_file("azure/AzureLLMInferenceTrace_conv.csv", data_dir=tmp_path / "none")
    assert path.is_file()
    err = capsys.readouterr().err
    assert f"warning: data_dir={tmp_path / 'none'} has no azure/AzureLLMInferenceTrace_conv.csv" in err, err


def test_another_applications_sqlite_file_is_not_made_an_mlflow_store(tmp_path):
    from testbed.tracking.tracker import Tracker

    db = tmp_path / "mlflow.db"
    with sqlite3.connect(db) as con:
        con.execute("create table notes(x)")
    with pytest.raises(ConfigError, match="not an MLflow database"):
        Tracker(None, "x", uri=f"sqlite:///{db}")
    with sqlite3.connect(db) as con:
        assert [r[0] for r in con.execute("select name from sqlite_master where type = 'table'")] == ["notes"]


@pytest.mark.parametrize("command, override", [
    ("compare", "compare.workers=100000"),  # started 100,000 processes' worth of pool on 2 cores
    ("tune", "tune.workers=1000"),
])
def test_worker_counts_are_bounded(command, override, capsys):
    """Issue 48 item 4: every command that starts worker processes bounds them as capacity does
    (testbed/config/overrides.py MAX_WORKERS): one `error:` line naming the value and the range."""
    assert main([command, *BASE, override, "output.mlflow=false"]) == 2
    err = capsys.readouterr().err
    assert f"invalid {override}: must be an integer in [1, 64]" in err and "Traceback" not in err
