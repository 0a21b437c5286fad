"""Declare a GPU set's split before its device call (issue 47): the manifest for `scripts/engine_runs_gpu.sh`'s
plan, written into measurements/gpu-<device>-<model>-<date>/ to be committed BEFORE the call.

    python scripts/declare_gpu_set.py --device h200 --date 2026-11-30 [--model qwen2.5-7b] [--plan g2]

Why: a lent device gives 15 minutes, start-up included, and the split must be in git before any run exists
(G1's was written by hand at the call, 2026-11-28). The run names come from the plan itself (`DRY=1`: the
script names every run in order and runs nothing), so the manifest cannot name a run the call will not take.
The split follows G1's lessons (docs/measurements/gpu-h200-2026-11-28.md): fit on gllm at every workload and
on SiPipe (G1 fitted on gllm ShareGPT alone: SiPipe's CPU hand-off was priced 0, Azure's mixed steps barely
seen); the first repeat of the other policies chooses the options; the second repeat of every policy is the
test, reported once. Runs the call's budget does not reach are left absent (`validate --test` says so).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FIT_POLICIES = ("gllm", "sipipe")  # fitted at every workload the plan gives them
SHORT = {"qwen2.5-7b": "q7"}
HEADER = """# GPU set {set_id} of issue 47 ({device}, {model}, {date}), taken by `PLAN={plan} bash scripts/engine_runs_gpu.sh` in
# one device call. Written by scripts/declare_gpu_set.py BEFORE any of its runs was taken and before any fit (git log
# shows the order); run names are the plan's (`DRY=1`). Runs the budget does not reach stay absent.
# fit: the first repeat (r1) of {fit} at every workload the plan runs them. validation: r1 of the other policies.
# candidates: P=1 decode_by_batch {{off, on}}; P=2 (stages sharing the GPU) decode_by_batch {{off, on}} x
#   inflight_handover {{off, on}}; no table (the engine changed since G1's, 7e0e141); own_attention (the engine's
#   Triton decode kernel on CUDA); hop receive; no spread.
# criterion (G1's): the least max(|throughput error|, |mean TPOT error|) over the validation runs, then the mean of
#   the two, then the earlier-listed candidate.
# test: r2 of every policy at every setting the plan runs, reported once after the chosen profiles are frozen.
"""


def fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def plan_runs(plan: str) -> list[str] | str:
    """The runs the plan takes, in order, as the script names them (`DRY=1`)."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "DRY": "1", "OUT": out, "PLAN": plan, "TMPDIR": out}
        done = subprocess.run(["bash", str(ROOT / "scripts" / "engine_runs_gpu.sh")], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return done.stdout.strip().splitlines()[-1].removeprefix("error: ") if done.stdout.strip() else "failed"
    return [ln.split()[1] for ln in done.stdout.splitlines() if ln.startswith("RUN ")]


def split(runs: list[str], depth: int) -> dict[str, list[str]]:
    mine = [r for r in runs if r.startswith(f"pp{depth}-")]
    first = [r for r in mine if r.endswith("-r1")]
    return {"fit": [r for r in first if r.split("-")[2] in FIT_POLICIES],
            "validation": [r for r in first if r.split("-")[2] not in FIT_POLICIES],
            "test": [r for r in mine if r.endswith("-r2")]}


def manifest(runs: list[str], set_id: str, model: str, device: str) -> dict:
    profiles = {}
    for depth in sorted({int(r[2]) for r in runs}):
        name = f"gpu-{device}-{SHORT.get(model, model)}-{set_id}-pp{depth}-runs"
        options = {"table": [None], "hop": ["receive"], "own_attention": [True], "decode_by_batch": [False, True],
                   "inflight_handover": [False, True] if depth > 1 else [False], "spread": [0.0]}
        profiles[name] = {"base": "h100-80g", "options": options, **split(runs, depth)}
    return {"runs": [f"runs-{set_id}.tar.xz"], "profiles": profiles}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", required=True, help="the lent device, as status names it (e.g. h200, h100)")
    p.add_argument("--date", default=dt.date.today().isoformat(), help="the call's date (default today, UTC)")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--plan", default="g2")
    p.add_argument("--root", default=str(ROOT / "measurements"), help="where the set's folder goes")
    a = p.parse_args(argv)
    try:
        dt.date.fromisoformat(a.date)
    except ValueError:
        return fail(f"--date {a.date!r} is not a date; write YYYY-MM-DD")
    folder = Path(a.root) / f"gpu-{a.device}-{a.model}-{a.date}"
    path = folder / f"manifest-{a.plan}.yaml"
    if path.exists():
        return fail(f"{path} exists: a declared split is never rewritten; declare a new set instead")
    runs = plan_runs(a.plan)
    if isinstance(runs, str):
        return fail(runs)
    body = manifest(runs, a.plan, a.model, a.device)
    folder.mkdir(parents=True, exist_ok=True)
    header = HEADER.format(set_id=a.plan.upper(), device=a.device, model=a.model, date=a.date, plan=a.plan,
                           fit=" and ".join(FIT_POLICIES))
    path.write_text(header + yaml.safe_dump(body, sort_keys=False, width=10000, default_flow_style=None))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
