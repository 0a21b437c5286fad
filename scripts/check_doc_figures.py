#!/usr/bin/env python3
"""Rerun the cheap form of each command the README and docs quote figures of, and compare.

Each check names a page, a regular expression that must still match there (the quoted figures are
its groups), and what to run: the same config through `run_experiment` in this process (MLflow,
figures and traces off: the simulated numbers are the same, byte for byte; issue 49 item 9).
A quoted percentage must equal the measured one rounded; a size in MB must be within 15%.
Exit 1 when a page no longer quotes what it checks or a figure is off; `--only step2` runs one.

    python scripts/check_doc_figures.py            # all: 27 s of CPU, 97 s at load ~25 (2026-11-27, 3 checks); 32 s of CPU, 8.1 min at load 26-30 with 5
    python scripts/check_doc_figures.py --only step1,sizes
"""
from __future__ import annotations

import argparse
import functools
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["output.mlflow=false", "output.plots=false", "output.progress=false", "output.trace=off"]


@functools.lru_cache(maxsize=None)  # a run several checks quote is simulated once
def summary(*overrides: str) -> dict:
    from testbed.config.spec import compose_spec
    from testbed.run.runner import run_experiment

    return run_experiment(compose_spec([*overrides, *QUIET])).summary


def percent(x: float) -> str:
    """Rounded half up, as a reader rounds: 0.085 (170 of 2,000 requests) is 9%, where Python's
    round() gives 8 (half to even)."""
    from decimal import ROUND_HALF_UP, Decimal

    return str((Decimal(repr(x)) * 100).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def step1() -> list[str]:
    return [percent(summary("policy=gllm", "workload=azure")["slo_attainment"])]


def step2() -> list[str]:
    return [percent(summary(f"policy={p}", "workload=azure", f"workload.rate={r}")["slo_attainment"])
            for p in ("gllm", "sarathi") for r in ("0.25", "0.5", "1", "1.5")]


def main_job() -> list[str]:
    """The main job's attainment (one decimal), mean TTFT and mean TPOT as docs/configuration.md quotes them."""
    got = summary("policy=gllm", "workload=azure")
    return [f"{100 * got['slo_attainment']:.1f}", f"{got['ttft_mean_s']:.1f}", f"{got['tpot_mean_s']:.2f}"]


def step2_ttft() -> list[str]:
    """gLLM's TTFT p99 range over step 2's four rates; Sarathi's at 1 and 1.5 req/s (past its knee)."""
    gllm = [summary("policy=gllm", "workload=azure", f"workload.rate={r}")["ttft_p99_s"] for r in ("0.25", "0.5", "1", "1.5")]
    sarathi = [summary("policy=sarathi", "workload=azure", f"workload.rate={r}")["ttft_p99_s"] for r in ("1", "1.5")]
    return [f"{min(gllm):.1f}", f"{max(gllm):.1f}", *(f"{x:.0f}" for x in sarathi)]


def folder_mb() -> list[str]:
    """The main job's run folder as `testbed run` writes it (figures included), in MB."""
    from testbed.config.spec import compose_spec
    from testbed.run.outputs import write_run_dir
    from testbed.run.runner import run_experiment

    result = run_experiment(compose_spec(["policy=gllm", "workload=azure", "output.mlflow=false",
                                          "output.progress=false"]))
    with tempfile.TemporaryDirectory() as tmp:
        out = write_run_dir(result, Path(tmp) / "run")
        sizes = {p.name: p.stat().st_size / 1e6 for p in out.iterdir()}
    figures = sizes.get("timeline.png", 0) + sizes.get("kv_usage.png", 0)
    return [f"{sum(sizes.values()):.1f}", f"{sizes['trace.json']:.1f}", f"{sizes['requests.csv']:.1f}", f"{figures:.2f}"]


@dataclass(frozen=True)
class Check:
    name: str
    page: str
    pattern: str  # its groups are the quoted figures, in the order `measure` returns them
    measure: Callable[[], list[str]]
    tolerance: float = 0.0  # relative; 0: equal as printed


CHECKS = (
    Check("step1", "README.md", r"\((\d+)% of requests within TTFT 4 s and TPOT 0\.2 s", step1),
    Check("step2", "README.md", r"SLO attainment (\d+)% / (\d+)% / (\d+)% / (\d+)% for gLLM and (\d+)% / (\d+)% / "
          r"(\d+)% / (\d+)% for\s+Sarathi", step2),
    Check("step2_ttft", "README.md", r"\(TTFT p99 ([\d.]+)-([\d.]+) s for gLLM; (\d+) s and (\d+) s for Sarathi", step2_ttft),
    Check("main_job", "docs/configuration.md", r"\(([\d.]+)% SLO attainment\s+on the run's 2,000 requests, mean TTFT ([\d.]+) s, "
          r"mean TPOT ([\d.]+) s", main_job),
    Check("sizes", "docs/run-outputs.md", r"A `testbed run` folder of the main job holds ([\d.]+) MB: `trace.json`\s+"
          r"([\d.]+) MB \(sampled\), `requests.csv` ([\d.]+) MB, the two figures ([\d.]+) MB", folder_mb, 0.15),
)


def agree(quoted: str, measured: str, tolerance: float) -> bool:
    if tolerance == 0.0:
        return quoted == measured
    q, m = float(quoted), float(measured)
    return abs(q - m) <= tolerance * max(abs(q), 1e-9)


def run(check: Check) -> list[str]:
    text = (ROOT / check.page).read_text()
    found = re.search(check.pattern, text)
    if not found:
        return [f"{check.name}: {check.page} no longer quotes /{check.pattern}/ (update the check with the page)"]
    quoted, measured = list(found.groups()), check.measure()
    return [f"{check.name}: {check.page} says {q}, the run gives {m}"
            for q, m in zip(quoted, measured) if not agree(q, m, check.tolerance)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma list of checks: " + ",".join(c.name for c in CHECKS))
    args = ap.parse_args(argv)
    names = set(filter(None, args.only.split(",")))
    unknown = names - {c.name for c in CHECKS}
    if unknown:
        print(f"error: unknown check {sorted(unknown)[0]!r}; valid choices: {', '.join(c.name for c in CHECKS)}",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    bad = []
    for check in CHECKS:
        if names and check.name not in names:
            continue
        problems = run(check)
        print(f"{check.name}: {'ok' if not problems else 'DIFFERS'}", flush=True)
        bad += problems
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
