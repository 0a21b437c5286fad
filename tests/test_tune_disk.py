"""`tune`'s output folder and a full disk (issue 48 item 5): a study on a journal file (or PostgreSQL)
with a fresh `output.dir` was refused ("not a writable directory": it only did not exist yet); a
full disk was a traceback. The full disk here is a file-size limit (RLIMIT_FSIZE: a write past it
fails with EFBIG, SQLite's "database or disk is full"), which needs no mount."""
from __future__ import annotations

import os
import resource
import subprocess
import sys

from signal_helpers import REPO, WAIT_S

BASE = ["policy=sarathi", "workload=synthetic", "workload.num_requests=30", "workload.arrival=offline",
        "model=llama2-13b", "hardware=a100-80g", "parallel.pp=2", "output.plots=false", "output.progress=false",
        "tune.trials=1"]


def _tune(*args: str, fsize: int | None = None) -> subprocess.CompletedProcess:
    def limit() -> None:
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "testbed.cli", "tune", *BASE, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=WAIT_S, preexec_fn=limit)


def test_a_journal_study_takes_a_fresh_output_dir(tmp_path):
    (tmp_path / "j").mkdir()
    out = _tune(f"tune.storage=journal:{tmp_path / 'j' / 'study.log'}", f"output.dir={tmp_path / 'fresh' / 'runs'}",
                "tune.study=fresh")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "fresh" / "runs" / "mlflow.db").is_file()


def test_a_full_disk_is_one_line(tmp_path):
    out = _tune(f"output.dir={tmp_path / 'runs'}", "tune.study=full", fsize=400 * 1024)
    err = out.stderr
    assert out.returncode == 1, err[-3000:]
    assert "Traceback" not in err and err.count("error:") == 1 and "no room left" in err, err[-3000:]
