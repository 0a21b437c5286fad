"""`testbed bench sim`: speed and memory of the simulator, as figures (never as test assertions).

Each measured run is a fresh subprocess so that its peak RSS (ru_maxrss) is its own. Two
settings (`--setting`): `reference`, TD-Pipe's 5,000 ShareGPT requests offline (prompt + output
<= 4,096 tokens, Llama-2's context), Llama2-70B on 4 x A100-80GB; `main`, the main job's
`workload=azure` with the config's defaults.

Per policy, three runs of the same config:
- the simulation alone, in a child that composes the config and calls the runner (no files, no
  MLflow): `simulate s` (the controller's loop), its peak RSS and micro-batches per second;
- the same run end to end as a user starts it, `python -m testbed.cli run ...` with MLflow on and
  the normal outputs (into a temporary output.dir, removed afterwards): `e2e s` is the wall time
  of that whole process (imports, config, simulation, run folder, plots, MLflow), `e2e RSS` its
  peak, and `e2e / sim` the ratio of its wall time to the simulate time it reported itself;
- the same again with `output.mlflow=false output.plots=false`: `bare e2e s` and its ratio, the
  floor that Python, the config and the run folder set without the background processes.
  MLflow's own start (`import mlflow` and its SQLite store: 2.3-2.5 s of CPU on the 2-core
  machine) overlaps the simulation, so once that is shorter the gap between the two ratios is
  the wait for MLflow.

Every measured child also reports its CPU seconds: `loop CPU s`, the process time of the
controller's loop alone, and `child CPU s`, user + system time of the whole child (imports, the
workload, the loop, the summary) from `wait4`. CPU time depends less on the load of a shared
machine than wall time does, but neither is load-free: compare checkouts side by side.

`--compare REF` does that: it checks REF (a git ref) out in a temporary worktree and runs the
simulation-only child of this checkout and of REF alternately, `--rounds` times per policy (the
order flips each round), each child with its own checkout's code (testbed/bench/sim_child.py is
sent as text, so REF needs no bench code of its own). Each round prints both sides and their
ratios, with the load average when the round started; the last rows give the median ratios.

TD-Pipe's predictions are cached (policies/prediction_cache.py): the first, simulation-only run
fits and stores them, the end-to-end runs read them back, as a user's second run would.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {"reference": ["workload=sharegpt", "workload.arrival=offline", "workload.num_requests=5000", "workload.max_total_len=4096",
                           "hardware=a100-80g", "model=llama2-70b", "parallel.pp=4"],
            "main": ["workload=azure"]}  # what `testbed run policy=<p> workload=azure` runs


CHILD = Path(__file__).with_name("sim_child.py")
REPO = Path(__file__).resolve().parents[2]


def measure(overrides: list[str], checkout: Path = REPO) -> dict:
    """The simulation alone in a fresh child running `checkout`'s code: the child's own figures
    (sim_child.py) plus its whole-process CPU time and peak RSS from wait4."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", CHILD.read_text(), json.dumps(overrides)],
                                cwd=checkout, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"benchmark run {overrides} in {checkout} failed:\n{err.read()[-2000:]}")
        row = json.loads(out.read().strip().splitlines()[-1])
    row.update(child_cpu_s=usage.ru_utime + usage.ru_stime, peak_rss_mb=usage.ru_maxrss / 1024)
    return row


def measure_end_to_end(overrides: list[str], bare: bool = False) -> dict:
    """`testbed run` with MLflow on (`bare`: MLflow and figures off), as a subprocess: its wall
    time, peak RSS and the simulate time it recorded in run_info.json (the same run, so the
    ratio has no run-to-run noise)."""
    outputs = ["output.mlflow=false", "output.plots=false"] if bare else ["output.mlflow=true"]
    with tempfile.TemporaryDirectory(prefix="testbed-bench-") as tmp:
        args = [sys.executable, "-m", "testbed.cli", "run", *overrides, *outputs,
                "output.progress=false", f"output.dir={tmp}", "output.run_name=bench"]
        with open(Path(tmp) / "stderr.txt", "w+") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss)
            wall = time.perf_counter() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"end-to-end run {overrides} failed:\n{err.read()[-2000:]}")
        info_path = next(Path(tmp).rglob("run_info.json"), None)
        simulate = json.loads(info_path.read_text())["simulation_s"] if info_path else float("nan")
    return {"e2e_s": wall, "e2e_simulate_s": simulate, "e2e_peak_rss_mb": usage.ru_maxrss / 1024}


def run_sim_bench(policies: list[str], extra: list[str], end_to_end: bool = True,
                  setting: str = "reference") -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    from testbed.config.overrides import merge

    base = SETTINGS[setting]
    rows = []
    for p in policies:
        overrides = merge([f"policy={p}", *base], extra)
        row = measure(overrides)
        if end_to_end:
            row.update(measure_end_to_end(overrides))
            bare = measure_end_to_end(overrides, bare=True)
            row.update(bare_e2e_s=bare["e2e_s"], bare_ratio=bare["e2e_s"] / bare["e2e_simulate_s"])
        rows.append(row)
    t = Table(title=f"simulator benchmark ({setting}): " + " ".join(base + extra))
    cols = ["policy", "simulate s", "loop CPU s", "child CPU s", "peak RSS MB", "micro-batches", "mb / wall s"]
    if end_to_end:
        cols += ["e2e s", "e2e / sim", "e2e RSS MB", "bare e2e s", "bare / sim"]
    for col in cols + ["throughput tok/s", "bubble", "TTFT mean s", "TPOT mean s"]:
        t.add_column(col, justify="right")
    for p, r in zip(policies, rows):
        cells = [p, f"{r['simulate_s']:.2f}", f"{r['loop_cpu_s']:.2f}", f"{r['child_cpu_s']:.2f}",
                 f"{r['peak_rss_mb']:.0f}", str(r["num_microbatches"]),
                 f"{r['microbatches_per_wall_s']:.0f}"]
        if end_to_end:
            cells += [f"{r['e2e_s']:.2f}", f"{r['e2e_s'] / r['e2e_simulate_s']:.2f}", f"{r['e2e_peak_rss_mb']:.0f}",
                      f"{r['bare_e2e_s']:.2f}", f"{r['bare_ratio']:.2f}"]
        t.add_row(*cells, f"{r['throughput_tok_s']:.0f}", f"{r['bubble_ratio']:.3f}",
                  f"{r['ttft_mean_s']:.1f}", f"{r['tpot_mean_s']:.4f}")
    Console(width=max(200, Console().width)).print(t)
    if end_to_end:
        Console().print("e2e / sim: wall time of the whole `testbed run` process (MLflow on, normal outputs) "
                        "over the simulate time that same run reported; bare: the same with MLflow and figures off")
    return rows
