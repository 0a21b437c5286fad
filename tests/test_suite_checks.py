"""The suite's own guard: it fails for files the test process writes into the checkout's runs/,
never for files another process (the user's own `testbed compare`) writes there meanwhile."""
from __future__ import annotations

import sqlite3
import subprocess
import sys

from conftest import WritesUnder


def test_only_this_process_writes_are_judged(tmp_path):
    folder = tmp_path / "runs"
    folder.mkdir()
    (folder / "old.txt").write_text("the user's")
    writes = WritesUnder(folder)
    sys.addaudithook(writes)
    try:
        # another process writes there meanwhile: the check before issue 40 failed the suite for it
        subprocess.run([sys.executable, "-c", f"open({str(folder / 'user.csv')!r}, 'w').write('x')"], check=True)
        (folder / "old.txt").read_text()  # reading is not writing
        assert writes.seen == []
        (folder / "mine.csv").write_text("x")
        (folder / "sub").mkdir()
        sqlite3.connect(folder / "mlflow.db").close()
        (tmp_path / "elsewhere.txt").write_text("x")  # outside the folder: not judged
    finally:
        writes.active = False
    assert sorted(writes.seen) == sorted(str(folder / n) for n in ("mine.csv", "sub", "mlflow.db"))
