"""The study's outputs besides the table: figures, `report.md` and the claim table printed at
the end."""
from __future__ import annotations

import math
import re
import subprocess
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
from rich.table import Table

from testbed.sweep.report import plot_comparison, print_wide, to_markdown
from testbed.reproduce.claims import ClaimResult, format_value, select
from testbed.reproduce.studies import Claim, FigureSpec, Study
from testbed.reproduce.verdicts import pct

def write_figures(study: Study, df: Any, out_dir: Path) -> list[tuple[FigureSpec, list[Path]]]:
    """The study's figures (`figures:` in the study file), one folder each under figures/."""
    done = []
    for f in study.figures:
        rows = select(df.to_dict("records"), f.where)
        if not rows:
            continue
        sub = pd.DataFrame(rows)
        series = [s for s in f.series if any(_text(r.get(s)) for r in rows)] or ["system"]
        name = " / ".join(series)
        if name in sub.columns and len(series) > 1:
            name += " "
        sub[name] = [" / ".join(_text(r.get(s)) for s in series if _text(r.get(s))) or "-" for r in rows]
        axes = [name] + ([f.x] if f.x else [])
        if f.x and (f.x not in sub.columns or sub[f.x].dropna().nunique() < 2):
            axes, x = [name], None
        else:
            x = f.x
        if x is None and f.x:
            sub[name] = [f"{r[name]} / {f.x}={r.get(f.x)}" for r in sub.to_dict("records")]
        fig_dir = out_dir / "figures" / re.sub(r"[^A-Za-z0-9_.=+-]+", "_", f.name)
        fig_dir.mkdir(parents=True, exist_ok=True)
        paths = plot_comparison(sub, axes, fig_dir, x=x, metrics=list(f.metrics))
        if paths:
            done.append((f, paths))
    return done


def _text(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return str(v)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def claimed_text(c: Claim) -> str:
    if c.at_most is not None:
        return f"<= {pct(c.at_most)}"
    if c.claimed is None:
        return f"{c.direction or '-'} (no number)" if c.direction else "-"
    fake = Claim(id="", text="", published="", metric="", kind=c.kind, show=c.show)
    if isinstance(c.claimed, tuple):
        return f"{format_value(fake, c.claimed[0])} to {format_value(fake, c.claimed[1])}"
    return format_value(fake, c.claimed)


def render_report(study: Study, *, quick: bool, claims: Sequence[ClaimResult], df: Any, axes: Sequence[str],
                  figures: Sequence[tuple[FigureSpec, list[Path]]], notes: Sequence[str], user: Sequence[str],
                  experiment: str, wall_s: float, runs: int, out_dir: Path, argv: Sequence[str] | None) -> str:
    """report.md: setup, claim table (published beside the testbed), verdicts, figures, results."""
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    mode = "quick smoke-test mode: reduced size, numbers not comparable to the paper" if quick else "full mode"
    cmd = "testbed reproduce " + " ".join(argv) if argv else f"testbed reproduce {study.name}" + (
        " --quick" if quick else "") + "".join(f" {u}" for u in user)
    lines = [f"# {study.title}", "",
             f"Study `{study.name}` ({mode}); "
             f"paper: {study.paper}; claims from {study.reference}.", "",
             f"- command: `{cmd}`",
             f"- {now}; testbed commit {git_commit()}; {runs} simulated run(s), {len(df)} point(s), "
             f"{wall_s:.1f} s wall time",
             f"- MLflow experiment `{experiment}` (one parent run, one nested run per distinct point)", ""]
    lines += _setup_lines(study, quick, user, notes)
    lines += _claim_lines(claims)
    lines += _figure_lines(figures, out_dir)
    lines += _result_lines(df, axes)
    return "\n".join(lines)


def _setup_lines(study: Study, quick: bool, user: Sequence[str], notes: Sequence[str]) -> list[str]:
    lines = ["## Setup", "", study.setup, ""]
    if study.notes:
        lines += [study.notes, ""]
    lines.append("- parts (setups): " + "; ".join(f"**{p.name}**: {p.label}" for p in study.parts))
    lines.append("- grids (systems): " + "; ".join(f"**{g.system}**: `{' '.join(g.overrides) or '-'}`"
                                                  + (f" (parts {', '.join(g.parts)})" if g.parts else "")
                                                  for g in study.grids))
    lines.append(f"- overrides of every run: `{' '.join(study.base) or '-'}`"
                 + (f"; quick mode: `{' '.join(study.quick)}`" if quick and study.quick else ""))
    if user:
        lines.append(f"- user overrides: `{' '.join(user)}`")
    for n in notes:
        lines.append(f"- note: {n}")
    return lines


def _claim_lines(claims: Sequence[ClaimResult]) -> list[str]:
    lines = ["", "## Claims: published vs testbed", "",
             "| claim | published (paper) | claimed | testbed | verdict |", "|---|---|---:|---:|---|"]
    for r in claims:
        c = r.claim
        lines.append(f"| {c.text} | {c.published} | {claimed_text(c)} | {format_value(c, r.measured)} | "
                     f"{r.verdict.label} |")
    lines += ["", "### Verdicts", ""]
    for r in claims:
        c = r.claim
        per = "; ".join(f"{g}: {format_value(c, v) if v is not None else why}" for g, v, why in r.groups)
        detail = f" ({r.verdict.text})" if r.verdict.text else ""
        lines.append(f"- **{c.id}**: {r.verdict.label}: testbed {format_value(c, r.measured)} vs published "
                     f"{c.published}{detail}. Per {', '.join(c.pair_by) or 'group'}: {per or '-'}"
                     f"{'' if c.aggregate == 'only' else f'; aggregated by {c.aggregate}'}.")
    return lines + ["", RULES, ""]


RULES = ("Rules (computed by `testbed.reproduce.verdict`): a claim's effect is value - baseline (1 for a "
         "ratio). *Direction*: the testbed's effect has the published sign and is at least 1% of the "
         "baseline. *Size*: the value lies in the published value or range widened on each side by 25% of "
         "the published effect (at least 0.02). Both: \"reproduced in direction and size\"; direction "
         "alone: \"reproduced in direction only\"; else \"not reproduced\". A bound (\"within 2%\") is "
         "reproduced when the value is within the bound + 25%. \"up to\" claims take the best group "
         "(max or min), ranges the geometric mean over groups.")
RESULT_METRICS = ("capacity_req_s", "search", "rates", "throughput_tok_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "e2el_mean_s",
                  "slo_attainment", "utilization_mean", "num_preemptions")


def _figure_lines(figures: Sequence[tuple[FigureSpec, list[Path]]], out_dir: Path) -> list[str]:
    if not figures:
        return []
    lines = ["## Figures", ""]
    for f, paths in figures:
        main = next((p for p in paths if p.name == "overview.png"), paths[0])
        lines += [f"**{f.title}**", "", f"![{f.title}]({main.relative_to(out_dir).as_posix()})", ""]
    return lines


def _result_lines(df: Any, axes: Sequence[str]) -> list[str]:
    metrics = [m for m in RESULT_METRICS if m in df.columns]
    cols = [c for c in ["part", "system", *axes] if c in df.columns]
    cols = list(dict.fromkeys(cols)) + ["status"] + metrics
    return ["## Results", "", to_markdown(df[cols].copy()), "Every column: `table.csv`; each run's directory: `runs/`.",
            ""]


def print_claims(console: Any, study: Study, claims: Sequence[ClaimResult], title: str) -> None:
    t = Table(title=title)
    for col in ("claim", "published", "testbed", "verdict"):
        t.add_column(col, justify="left" if col in ("claim", "verdict") else "right")
    colour = {"size": "green", "direction": "yellow", "none": "red", "info": "dim", "n/a": "dim"}
    for r in claims:
        t.add_row(r.claim.id, claimed_text(r.claim), format_value(r.claim, r.measured),
                  f"[{colour[r.verdict.category]}]{r.verdict.label}[/{colour[r.verdict.category]}]")
    print_wide(console, t)


