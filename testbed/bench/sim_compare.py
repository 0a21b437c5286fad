"""`testbed bench sim --compare REF`: this checkout and another commit side by side, alternating.

On a machine shared with other work a single timing says little: the load moves it by 2x. Two
checkouts measured back to back, in alternating order, share the load of each round, so the
ratio of the pair is the figure to quote (with the load beside it). REF is checked out in a
temporary git worktree (removed afterwards) and runs its own code through the same child
(testbed/bench/sim_child.py, sent as text).
"""
from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

from engine.base.errors import bad_value
from testbed.bench.sim import REPO, SETTINGS, measure


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def resolve(ref: str) -> str:
    """REF's commit id; a ConfigError naming REF when this checkout has no such commit."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except (subprocess.CalledProcessError, FileNotFoundError):
        raise bad_value("--compare", ref, f"a git ref (commit, branch or tag) of the repository at {REPO}") from None


def describe_here() -> str:
    """This checkout's commit, marked when its tree has uncommitted changes."""
    try:
        head = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "this checkout"
    return f"{head}+changes" if dirty else head


@contextmanager
def worktree(commit: str):
    tmp = Path(tempfile.mkdtemp(prefix="testbed-compare-"))
    path = tmp / commit[:12]
    try:
        _git("worktree", "add", "--detach", "--quiet", str(path), commit)
        yield path
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], capture_output=True,
                       check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def compare_rounds(policies: list[str], extra: list[str], setting: str, ref_dir: Path, rounds: int) -> list[dict]:
    """Per policy and round: both sides' figures (this checkout first on even rounds)."""
    from testbed.config.overrides import merge

    rows = []
    for p in policies:
        overrides = merge([f"policy={p}", *SETTINGS[setting]], extra)
        for r in range(rounds):
            load = os.getloadavg()[0]
            sides = [("this", REPO), ("ref", ref_dir)]
            got = {name: measure(overrides, where) for name, where in (sides if r % 2 == 0 else sides[::-1])}
            rows.append({"policy": p, "round": r + 1, "load": load, "this": got["this"], "ref": got["ref"]})
    return rows


def run_compare(ref: str, policies: list[str], extra: list[str], setting: str = "reference", rounds: int = 3) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    if rounds < 1:
        raise bad_value("--rounds", rounds, "must be >= 1")
    commit = resolve(ref)
    here = describe_here()
    with worktree(commit) as ref_dir:
        rows = compare_rounds(policies, extra, setting, ref_dir, rounds)
    t = Table(title=f"simulator side by side ({setting}): {here} vs {ref} ({commit[:9]}): "
                    + " ".join(SETTINGS[setting] + extra))
    for col in ["policy", "round", "load", "loop s", "ref loop s", "loop ratio", "loop CPU s", "ref loop CPU s",
                "CPU ratio", "child CPU s", "ref child CPU s", "peak RSS MB", "ref RSS MB", "micro-batches"]:
        t.add_column(col, justify="right")
    for row in rows:
        a, b = row["this"], row["ref"]
        same = a["num_microbatches"] == b["num_microbatches"]
        t.add_row(row["policy"], str(row["round"]), f"{row['load']:.2f}", f"{a['simulate_s']:.3f}",
                  f"{b['simulate_s']:.3f}", f"{a['simulate_s'] / b['simulate_s']:.3f}", f"{a['loop_cpu_s']:.3f}",
                  f"{b['loop_cpu_s']:.3f}", f"{a['loop_cpu_s'] / b['loop_cpu_s']:.3f}", f"{a['child_cpu_s']:.2f}",
                  f"{b['child_cpu_s']:.2f}", f"{a['peak_rss_mb']:.0f}", f"{b['peak_rss_mb']:.0f}",
                  str(a["num_microbatches"]) + ("" if same else f" vs {b['num_microbatches']}"))
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        med = {k: statistics.median(r["this"][k] / r["ref"][k] for r in mine) for k in ("simulate_s", "loop_cpu_s")}
        t.add_row(p, "median", "", "", "", f"{med['simulate_s']:.3f}", "", "", f"{med['loop_cpu_s']:.3f}",
                  "", "", "", "", "", style="bold")
    Console(width=max(200, Console().width)).print(t)
    Console().print("ratio: this checkout / REF (below 1: this one is faster); each round runs both, "
                    "in alternating order, under the load shown")
    return rows
