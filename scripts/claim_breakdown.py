"""Where each stage's time goes in one simulated run, split finer than `breakdown.json`: compute
(forward spans), input preparation, GPU sampling, the driver's round trip ("schedule" spans),
the hand-off to CPU samplers, sends, and the idle time by cause (engine/core/breakdown.py), as
shares of the run's window; plus the CPU samplers' busy share where the run has them.

    python scripts/claim_breakdown.py policy=vllm hardware=a100-80g model=llama2-70b parallel.pp=4 ...

The same overrides as `testbed run`. Prints one row per stage, the mean and the throughput. Used for
the per-claim tables of docs/measurements/reproduction-2026-11-28.md (issue 46 item 5): the busy time
by span name comes from the tracer's ledger, which counts every span whatever `output.trace` keeps.
"""
from __future__ import annotations

import sys

from engine.core.breakdown import PARTS


def main(argv: list[str]) -> None:
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    spec = compose_spec(list(argv) + ["output.mlflow=false", "output.trace=off"])
    result = run_experiment(spec)
    bd = result.breakdown
    ledger = result.tracer.ledger.tracks
    names = ("prepare", "sample", "schedule", "to_samplers")
    print(f"throughput {result.summary['throughput_tok_s']:.1f} tok/s, duration {result.summary['duration_s']:.1f} s, "
          f"micro-batches {result.summary['num_microbatches']}, preemptions {result.summary['num_preemptions']}")
    head = ["stage", "compute"] + list(names) + [p for p in PARTS if p not in ("compute", "host")]
    print(" | ".join(head))
    rows = []
    for s, (stage, frac) in enumerate(zip(bd["stages"], bd["fractions"])):
        wall = stage["wall_s"] or 1.0
        busy = ledger.get(f"stage{s}").parts if ledger.get(f"stage{s}") else {}
        row = [frac["compute"]] + [busy.get(n, 0.0) / wall for n in names] + [
            frac[p] for p in PARTS if p not in ("compute", "host")]
        rows.append(row)
        print(" | ".join([f"stage{s}"] + [f"{100 * v:.1f}%" for v in row]))
    mean = [sum(col) / len(rows) for col in zip(*rows)]
    print(" | ".join(["mean"] + [f"{100 * v:.1f}%" for v in mean]))
    samplers = [t for t in ledger if t.startswith("sampler")]
    if samplers:
        wall = bd["stages"][0]["wall_s"] or 1.0
        print("CPU samplers busy: " + ", ".join(f"{t} {100 * sum(ledger[t].parts.values()) / wall:.1f}%" for t in samplers))


if __name__ == "__main__":
    main(sys.argv[1:])
