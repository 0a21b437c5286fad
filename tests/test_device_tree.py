"""scripts/device_tree.sh: a device call's copy leaves measurements/ behind, and the checkout comes back intact."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_tree.sh"


def sh(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(list(args), cwd=repo, env=env, capture_output=True, text=True, check=check)


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    sh(tmp_path, "git", "init", "-q", "-b", "main")
    (tmp_path / "measurements" / "set").mkdir(parents=True)
    (tmp_path / "measurements" / "set" / "runs.tar.xz").write_bytes(os.urandom(300_000))
    (tmp_path / "code.py").write_text("x = 1\n")
    sh(tmp_path, "git", "add", ".")
    sh(tmp_path, "git", "commit", "-q", "-m", "init")
    return tmp_path


def travelling_bytes(repo: Path) -> int:
    out = sh(repo, "bash", str(SCRIPT), "size").stdout
    return int(out.split("tree ")[1].split(" bytes")[0])


def test_slim_leaves_measurements_behind_and_restore_brings_all_back(repo: Path) -> None:
    before = travelling_bytes(repo)
    assert before > 300_000
    sh(repo, "bash", str(SCRIPT), "slim")
    assert sh(repo, "git", "branch", "--show-current").stdout.strip() == "device-slim"
    assert (repo / "measurements" / "set" / "runs.tar.xz").stat().st_size == 300_000  # still on disk
    assert travelling_bytes(repo) < 1_000  # only code.py travels
    (repo / "brought_back.json").write_text("{}")  # what a call brings back, not yet committed
    sh(repo, "bash", str(SCRIPT), "restore")
    assert sh(repo, "git", "branch", "--show-current").stdout.strip() == "main"
    assert "device-slim" not in sh(repo, "git", "branch").stdout
    assert sh(repo, "git", "status", "--porcelain").stdout.strip() == "?? brought_back.json"
    assert "measurements" not in (repo / ".git" / "info" / "exclude").read_text()
    assert travelling_bytes(repo) == before + 2


def test_slim_refuses_uncommitted_changes_and_restore_refuses_commits_made_while_slim(repo: Path) -> None:
    (repo / "code.py").write_text("x = 2\n")
    bad = sh(repo, "bash", str(SCRIPT), "slim", check=False)
    assert bad.returncode == 2 and bad.stderr.startswith("error: uncommitted changes")
    sh(repo, "git", "checkout", "-q", "code.py")
    sh(repo, "bash", str(SCRIPT), "slim")
    (repo / "new.txt").write_text("n")
    sh(repo, "git", "add", "new.txt")
    sh(repo, "git", "commit", "-q", "-m", "made while slim")
    bad = sh(repo, "bash", str(SCRIPT), "restore", check=False)
    assert bad.returncode == 2 and "cherry-pick" in bad.stderr
    assert sh(repo, "git", "branch", "--show-current").stdout.strip() == "device-slim"


def test_unknown_command_names_the_choices(repo: Path) -> None:
    bad = sh(repo, "bash", str(SCRIPT), "shrink", check=False)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: unknown command 'shrink'; valid choices: size [carried paths...], slim, restore"
