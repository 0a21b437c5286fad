"""Running a study: every grid point composed and validated first, identical runs run once, the
points run through the shared sweep runner (`testbed/sweep/jobs.py`: workers, one parent MLflow run
with a nested run per distinct point, KILLED on Ctrl-C or SIGTERM), then claims, figures,
tables and report.md."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from engine.base.errors import ConfigError
from testbed import signals
from testbed.sweep import jobs as sweep
from testbed.cluster.ray_backend import split_backend
from testbed.sweep.ray_points import ray_pool
from testbed.sweep.compare import axis_value, grid
from testbed.config.spec import compose_spec
from testbed.config.overrides import split_prefixed
from testbed.sweep.report import write_comparison
from testbed.config.spec import RunSpec
from testbed.reproduce.claims import ClaimResult, evaluate_safely
from testbed.reproduce.planning import (Planned, config_value, derived_columns, identity, key_of, plan, study_axes,
                                        system_label)
from testbed.reproduce.render import git_commit, print_claims, render_report, write_figures
from testbed.reproduce.studies import (MARKER, FigureSpec, Study, check_requirements, describe_studies, list_studies,
                                       load_study)



@dataclass
class StudyOutcome:
    study: Study
    out_dir: Path
    report: Path
    experiment: str
    claims: list[ClaimResult]
    table: Any  # pandas DataFrame
    wall_s: float
    notes: list[str]


@dataclass
class StudyRun:
    """A planned study: its points, the distinct jobs that run them, where results go."""

    study: Study
    quick: bool
    tag: str
    experiment: str
    out_dir: Path
    notes: list[str]
    points: list[tuple[Planned, Any, RunSpec]]  # (plan, compare.Point, its run)
    jobs: list[sweep.Job] = field(default_factory=list)
    dup_of: list[int] = field(default_factory=list)  # for each point: index of the job that runs it
    point_meta: list[dict] = field(default_factory=list)
    axes: list[str] = field(default_factory=list)
    capacity: Any = None  # CapacitySettings: a capacity study (each point a `testbed capacity` search)

    @property
    def run0(self) -> RunSpec:
        return self.points[0][2]


def prepare_study(name: str, quick: bool, overrides: Sequence[str], workers: int,
                  experiment: str | None) -> StudyRun:
    """Load, plan and compose every point (a typo exits 2 before anything runs)."""
    study = load_study(name)
    check_requirements(study)
    if workers < 1:
        raise ConfigError(f"invalid --workers={workers}: must be an integer >= 1")
    user = list(overrides)
    if quick and not any(key_of(u) == "output.plots" for u in user):
        user.append("output.plots=false")  # per-run timeline plots: ~1 s each, not needed for a smoke test
    planned, notes = plan(study, quick, user)
    capacity = _capacity_settings(study, planned, workers)
    points = [(p, pt, compose_spec(list(pt.overrides))) for p in planned for pt in grid(p.overrides)[1]]
    tag = f"{study.name}-quick" if quick else study.name
    out_dir = Path(points[0][2].output.dir) / "reproduce" / tag
    run = StudyRun(study, quick, tag, experiment or f"reproduce-{tag}", out_dir, notes, points, capacity=capacity)
    _make_jobs(run, study_axes(planned))
    return run


def _capacity_settings(study: Study, planned: list[Planned], workers: int) -> Any:
    """A capacity study sets `capacity.*` keys in its `base` (the user may change them): they are
    split off every point's overrides and searched per point, as `testbed capacity` does."""
    from testbed.capacity.settings import parse

    raws = []
    for p in planned:
        raw, p.overrides = split_prefixed(p.overrides, "capacity")
        raws.append(raw)
    if not any(raws):
        return None
    if not any(key_of(ov).startswith("capacity.") for ov in study.base):
        raise ConfigError(f"capacity.* keys apply to capacity studies (a study whose base sets them); "
                          f"study {study.name} is not one")
    if any(r != raws[0] for r in raws):
        raise ConfigError(f"study {study.name}: its parts or grids set different capacity.* keys; one search "
                          f"setting per study")
    return replace(parse(raws[0]), workers=workers)


def _capacity_rows(run: StudyRun, parent: sweep.ParentRun, workers: int, console: Any) -> list[dict]:
    """One row per distinct point: its capacity (testbed/capacity/), the search's files under capacity/."""
    from testbed.capacity.command import run_searches
    from testbed.capacity.planning import plan_for_jobs

    p = plan_for_jobs(run.jobs, run.axes, run.capacity, run.experiment, run.out_dir / "capacity")
    df, _, _ = run_searches(p, parent, console)
    return df.to_dict("records")


def _make_jobs(run: StudyRun, axes_keys: list[str]) -> None:
    """One job per distinct config; every point keeps its own columns (part, system, axes)."""
    extra_cols: list[str] = []
    unique: dict[str, int] = {}
    for p, pt, spec in run.points:
        values = {k: config_value(spec, k) for k in axes_keys}  # every axis of the study, from the config
        values.update({k: axis_value(spec, k, v) for k, v in pt.axes})
        derived = derived_columns(spec)
        extra_cols += [k for k in derived if k not in extra_cols]
        meta = {"part": p.part.name, "system": system_label(p.grid.system, {**values, **derived}), **values, **derived}
        run.point_meta.append(meta)
        ident = identity(spec)
        if ident not in unique:
            unique[ident] = len(run.jobs)
            label = f"{meta['part']}/{meta['system']}" + "".join(f",{k}={v}" for k, v in pt.axes)
            dirname = f"{len(run.jobs):03d}_" + re.sub(r"[^A-Za-z0-9_.=+-]+", "_", label)[:120]
            run.jobs.append(sweep.Job(index=len(run.jobs), spec=spec, label=label, axes=(), axis_values=meta,
                                      experiment=run.experiment, parent_run_id=None,
                                      run_dir=str(run.out_dir / "runs" / dirname)))
        run.dup_of.append(unique[ident])
    run.axes = ["part", "system"]
    run.axes += [k for k in axes_keys if k not in run.axes] + [k for k in extra_cols if k not in axes_keys]


def _claim_dir(run: StudyRun) -> None:
    """Replace an earlier directory of this study (only one `testbed reproduce` wrote)."""
    if run.out_dir.exists():
        if not (run.out_dir / MARKER).exists():
            raise ConfigError(f"{run.out_dir} exists and was not written by `testbed reproduce`; move it away")
        shutil.rmtree(run.out_dir)
    run.out_dir.mkdir(parents=True)
    _mark(run, state="running")


def _mark(run: StudyRun, **info: Any) -> None:
    (run.out_dir / MARKER).write_text(json.dumps({"study": run.study.name, "quick": run.quick, **info},
                                                 indent=2 if len(info) > 1 else None) + "\n")


def point_rows(run: StudyRun, job_rows: Sequence[dict]) -> list[dict]:
    """One row per point (duplicates share their job's results), done points only."""
    by_index = {r["point"]: r for r in job_rows}
    rows = []
    for i, meta in enumerate(run.point_meta):
        if run.dup_of[i] not in by_index:
            continue  # interrupted before it ran
        ran = run.jobs[run.dup_of[i]].axis_values  # the axis values of the point that ran, replaced by this one's
        r = {k: v for k, v in by_index[run.dup_of[i]].items() if k not in ran}
        r.update(meta)
        r["point"] = i
        r["run"] = run.dup_of[i]
        if r.get("status") != "finished" and "does not fit" in str(r.get("error")):
            r["status"] = "does not fit"
        util = [v for k, v in r.items() if k.startswith("stage_utilization.stage")]
        if util:
            r["utilization_mean"] = sum(util) / len(util)
        rows.append(r)
    return rows


def run_study(name: str, *, quick: bool = False, overrides: Sequence[str] = (), workers: int = 1,
              experiment: str | None = None, console: Any = None, argv: Sequence[str] | None = None) -> StudyOutcome:
    backend, overrides = split_backend(overrides)  # sweep.backend=ray: testbed/cluster/ray_backend.py
    run = prepare_study(name, quick, overrides, workers, experiment)
    if backend.remote and run.capacity is not None:
        raise ConfigError(f"study {name!r} is a capacity study, whose searches run here; valid choices: "
                          f"sweep.backend=local")
    _claim_dir(run)
    parent = sweep.ParentRun(run.run0.output, run.experiment, run.tag, {
        "testbed.kind": "compare", "testbed.reproduce": run.study.name, "testbed.quick": str(quick).lower(),
        "testbed.axes": json.dumps(run.axes), "reproduce.overrides": " ".join(overrides)[:5000],
        "compare.points": str(len(run.jobs))})
    run.jobs = [_bind(job, run.axes, parent.run_id) for job in run.jobs]
    if console is not None:
        _print_start(console, run, workers)
        parent.print_link(console)
    job_rows: list[dict] = []
    t0 = time.perf_counter()
    try:
        if run.capacity is not None:
            job_rows.extend(_capacity_rows(run, parent, workers, console))
        else:
            sweep.run_jobs(run.jobs, workers, console, run.run0.output.progress, job_rows, pool=ray_pool(backend))
    except KeyboardInterrupt as exc:
        _flush_partial(run, job_rows, time.perf_counter() - t0, signals.interrupted_message(exc))
        parent.end_interrupted(exc, console, f"the table of the {len(job_rows)} run(s) done", run.out_dir)
        raise
    except sweep.ServiceLost as exc:  # e.g. the Ray head gone: the runs done are kept, the runs ended
        _flush_partial(run, job_rows, time.perf_counter() - t0, f"stopped: {str(exc)[:300]}")
        parent.end_failed(exc)
        raise
    except Exception as exc:  # e.g. sweep.backend=ray whose cluster cannot be reached
        parent.end_failed(exc)
        raise
    wall = time.perf_counter() - t0
    outcome = _write_results(run, job_rows, wall, list(overrides), argv)
    _log(parent, outcome, job_rows)
    if console is not None:
        print_claims(console, run.study, outcome.claims,
                     f"{run.study.name}{' (quick)' if quick else ''}: {len(run.jobs)} runs, {wall:.1f} s")
    return outcome


def _bind(job: sweep.Job, axes: list[str], parent_run_id: str | None) -> sweep.Job:
    return sweep.Job(index=job.index, spec=job.spec, label=job.label, axes=tuple(axes), axis_values=job.axis_values,
                     experiment=job.experiment, parent_run_id=parent_run_id, run_dir=job.run_dir)


def _print_start(console: Any, run: StudyRun, workers: int = 1) -> None:
    console.print(f"study [bold]{run.study.name}[/bold]{' (quick)' if run.quick else ''}: {len(run.points)} "
                  f"point(s), {len(run.jobs)} distinct run(s), {len(run.study.claims)} claim(s); MLflow experiment "
                  f"{run.experiment}", highlight=False)
    for n in run.notes:
        console.print(f"note: {n}", highlight=False, markup=False)
    from testbed.sweep.estimate import estimate_line

    console.print(estimate_line([job.spec for job in run.jobs], workers), highlight=False, markup=False)


def _flush_partial(run: StudyRun, job_rows: list[dict], wall: float, why: str) -> None:
    """Interrupted: the table of the points done so far, and the marker says so."""
    rows = point_rows(run, job_rows)
    df = pd.DataFrame(rows) if rows else pd.DataFrame(columns=[*run.axes, "status"])
    write_comparison(df, run.axes, run.out_dir, plots=False)
    _mark(run, state="interrupted", why=why, wall_s=wall, runs_done=len(job_rows), runs=len(run.jobs))


def _write_results(run: StudyRun, job_rows: list[dict], wall: float, user: list[str],
                   argv: Sequence[str] | None) -> StudyOutcome:
    rows = point_rows(run, job_rows)
    claims = [evaluate_safely(c, rows) for c in run.study.claims]
    df = pd.DataFrame(rows)
    figures = write_figures(run.study, df, run.out_dir)
    search_png = run.out_dir / "capacity" / "capacity.png"
    if run.capacity is not None and search_png.exists():
        figures.append((FigureSpec("search", f"{run.capacity.metric} against the request rate per point "
                                             f"(stars: capacity; o passed, x failed)", None, (), ()), [search_png]))
    write_comparison(df, run.axes, run.out_dir, plots=False)
    (run.out_dir / "claims.json").write_text(json.dumps([c.as_dict() for c in claims], indent=2, default=str) + "\n")
    report = run.out_dir / "report.md"
    report.write_text(render_report(run.study, quick=run.quick, claims=claims, df=df, axes=run.axes, figures=figures,
                                    notes=run.notes, user=user, experiment=run.experiment, wall_s=wall,
                                    runs=len(run.jobs), out_dir=run.out_dir, argv=argv))
    _mark(run, state="done", wall_s=wall, experiment=run.experiment, points=len(run.points), runs=len(run.jobs),
          commit=git_commit(), overrides=[u for u in user if not u.startswith("output.")])
    return StudyOutcome(run.study, run.out_dir, report, run.experiment, claims, df, wall, run.notes)


def _log(parent: sweep.ParentRun, outcome: StudyOutcome, job_rows: list[dict]) -> None:
    counts = {"compare.runs": len(job_rows), "compare.wall_s": f"{outcome.wall_s:.1f}",
              "compare.failed": sum(r.get("status") != "finished" for r in job_rows)}
    metrics = {f"claim.{c.claim.id}": c.measured for c in outcome.claims if c.measured is not None}
    parent.log(metrics, tags={**counts, **{f"claim.{c.claim.id}": c.verdict.label for c in outcome.claims}})
    parent.log_files(outcome.out_dir, subdirs=("figures",))
    parent.end("FINISHED")


# --- the command line ------------------------------------------------------------------------------

def _option_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testbed reproduce", add_help=False)
    p.add_argument("--list", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--verdicts", action="store_true")
    p.add_argument("--workers", type=int)
    p.add_argument("--experiment")
    p.add_argument("items", nargs="*")
    return p


def cli_reproduce(args: Any, console: Any) -> int:
    """`testbed reproduce`: options may come before or after the study and its overrides.
    0, or 130 (Ctrl-C) / 143 (SIGTERM) with the table of the points done so far."""
    rest = _option_parser().parse_intermixed_args(list(args.args or []))
    if args.list or rest.list:
        for line in describe_studies():
            print(line)
        return 0
    if getattr(args, "verdicts", False) or rest.verdicts:
        from testbed.reproduce.summary import cli_verdicts

        return cli_verdicts(rest.items[0] if rest.items else None)
    if not rest.items:
        raise ConfigError(f"name a study (testbed reproduce <study> [--quick] [key=value ...]); valid choices: "
                          f"{', '.join(list_studies())}")
    study, overrides = rest.items[0], rest.items[1:]
    if "=" in study:
        raise ConfigError(f"the first argument names the study, got {study!r}; valid choices: "
                          f"{', '.join(list_studies())}")
    quick = bool(args.quick or rest.quick)
    argv = [study, *(["--quick"] if quick else []), *overrides]
    with signals.sigterm_as_interrupt():
        try:
            outcome = run_study(study, quick=quick, overrides=overrides,
                                workers=rest.workers if rest.workers is not None else (args.workers or 1),
                                experiment=rest.experiment or args.experiment, console=console, argv=argv)
        except KeyboardInterrupt as exc:
            print(signals.interrupted_message(exc), file=sys.stderr)
            return signals.exit_code(exc)
    print(outcome.report.resolve())
    return 0
