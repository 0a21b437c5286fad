"""One calibration path that holds: `testbed profile` and `testbed validate` lead to `calibrate runs`.

A `testbed profile` table times designed micro-batches one at a time, each alone on an idle engine;
a serving run's micro-batches are mixed, back to back, with the driver, the other stages and the
samplers on the same host. The profile fitted to such a table does not hold on runs: CPU,
tiny-llama, P=2, sarathi on ShareGPT, +42% throughput and +20% mean TPOT (issue 47, load ~3); on
the H100 26-56% on throughput. The profile stays useful as the *base* of a fit on runs
(`testbed calibrate runs ... --base <it> --table <its CSV>`), which held within 10% on every
validation run of measurements/cpu-tiny-llama/ (docs/calibrate-runs.md). So both commands end
with the same note: what to run instead, and why.
"""
from __future__ import annotations

from engine.pricing.hardware import get_hardware

WHY = ("a profile of designed micro-batches (testbed profile) does not hold on serving runs (CPU tiny-llama "
       "P=2, sarathi ShareGPT: +42% throughput, +20% TPOT mean): fit on real runs instead")


def fitted_on_runs(hardware: str) -> bool:
    """Whether `hardware` came from `testbed calibrate runs` (its version says `runs-<date>`)."""
    return str(get_hardware(hardware).version or "").startswith("runs-")


def runs_fit_note(base: str, table: str | None, overrides: str = "<your settings>") -> str:
    """The note both commands print: the two commands that give a profile that holds."""
    table_arg = f" --table {table}" if table else ""
    return (f"note: {WHY}:\n"
            f"  testbed run executor=torch {overrides} output.trace=full output.run_name=fit1   "
            "(a run of each workload you will simulate)\n"
            f"  testbed calibrate runs runs/fit1 [runs/fit2 ...] --base {base}{table_arg} --name {base}-runs\n"
            f"  testbed validate --runs <other runs> hardware={base}-runs   (docs/calibrate-runs.md)")
