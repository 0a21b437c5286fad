"""The journal of ends a host could not write (testbed/cluster/unwritten.py): a `tune` host that
gave up on its PostgreSQL left its trial and its runs RUNNING until another host's `tune`
reclaimed them (issue 48); now what it could not write waits in its output folder and the next
command of that folder that reaches the store writes it. The two-host study itself is
tests/test_two_host_outage.py (`services`)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import optuna
import pytest

from engine.base.settings import OutputSettings
from mlflow_db import fresh_mlflow_db
from testbed.cluster import unwritten
from testbed.tracking.tracker import Tracker


def _tracker(tmp_path, uri: str) -> Tracker:
    return Tracker(OutputSettings(dir=str(tmp_path / "runs")), "t", uri=uri)


def test_a_run_its_host_could_not_end_is_ended_by_the_folders_next_tracker(tmp_path, capsys):
    uri = fresh_mlflow_db(tmp_path)
    first = _tracker(tmp_path, uri)
    run_id = first.client.create_run(first.experiment_id).info.run_id
    resumed = first.client.create_run(first.experiment_id).info.run_id
    folder = tmp_path / "runs"
    unwritten.record(folder, unwritten.run_end(uri, run_id, "interrupted: postgres gone", "KILLED"),
                     unwritten.run_end(uri, resumed, "gone", "FAILED"),
                     unwritten.run_end("http://other:5000", "abc", "gone", "FAILED"))
    first.client.set_tag(resumed, "testbed.resumed_at", "9999999999")  # a study run another host resumed since
    _tracker(tmp_path, uri)  # any command of the folder that opens the store
    run = first.client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["error"] == "interrupted: postgres gone"
    assert first.client.get_run(resumed).info.status == "RUNNING"
    assert f"MLflow run {run_id} ended KILLED" in capsys.readouterr().err
    assert [e.store for e in unwritten.read(folder / unwritten.FILE)] == ["http://other:5000"]  # another store's


def test_a_trial_its_host_could_not_end_is_ended_by_the_next_tune(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    folder = tmp_path / "runs"
    unwritten.record(folder, unwritten.trial_end(storage, "s", trial._trial_id, trial.number, "interrupted: gone"),
                     unwritten.trial_end(storage, "other-study", 7, 0, "gone"))
    marked = []

    def mark(trial_id: int, reason: str) -> bool:
        marked.append((trial_id, reason))
        study._storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
        return True

    notes = unwritten.end_trials(folder, storage, study, lambda t: False, mark)
    assert marked == [(trial._trial_id, "interrupted: gone")] and "trial 0: failed" in notes[0]
    assert [e.study for e in unwritten.read(folder / unwritten.FILE)] == ["other-study"]
    assert unwritten.end_trials(folder, storage, study, lambda t: False, mark) == []  # nothing left to end


def test_the_journal_is_typed_json_without_passwords(tmp_path):
    folder = tmp_path / "runs"
    unwritten.record(folder, unwritten.trial_end("postgresql://lab:secret@db/optuna", "s", 1, 0, "gone"))
    path = folder / unwritten.FILE
    text = path.read_text()
    assert "secret" not in text and json.loads(text)["store"] == "postgresql://lab:***@db/optuna"
    with open(path, "a") as f:  # a line that is not an entry is never acted on
        f.write('{"kind": "run", "store": 1}\n[1, 2]\nnot json\n')
    assert len(unwritten.read(path)) == 1
    with pytest.raises(ValueError):
        unwritten.End("shell", "x", "r", "KILLED", "h", 0.0)


def test_a_trial_runner_that_loses_both_stores_journals_its_trial_and_run(tmp_path):
    from testbed.cluster.reconnect import ServiceLost
    from testbed.tune.trial import TrialRunner

    class Gone:
        uri = "http://127.0.0.1:9"

        def __getattr__(self, name):
            raise ConnectionError("gone")

    def lost(*_a, **_k):
        raise ConnectionError("gone")

    runner = TrialRunner.__new__(TrialRunner)
    runner.p = SimpleNamespace(storage_url="postgresql://lab:pw@db/o", study="s",
                               base=SimpleNamespace(output=SimpleNamespace(dir=str(tmp_path / "runs"))))
    runner.tracker = SimpleNamespace(uri="http://127.0.0.1:9", client=Gone())
    study = SimpleNamespace(_storage=SimpleNamespace(get_trial=lost))
    runner._lost(study, SimpleNamespace(_trial_id=4, number=3), "run-1", ServiceLost("tune.storage stayed away"))
    ends = unwritten.read(tmp_path / "runs" / unwritten.FILE)
    assert [(e.kind, e.status) for e in ends] == [("run", "KILLED"), ("trial", "FAIL")]
    assert ends[0].run_id == "run-1" and (ends[1].trial_id, ends[1].number) == (4, 3)
    assert "pw" not in (tmp_path / "runs" / unwritten.FILE).read_text().replace("postgresql://lab:***", "")
