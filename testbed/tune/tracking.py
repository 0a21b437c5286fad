"""The study in MLflow: one run (tag `testbed.kind=study`) in experiment `tune-<study>`
(`tune.experiment=`), reused when a study resumes; each trial is a run nested under it through an
explicit `parent_run_id` (MLflow's active run is thread-local). At the end the study run gets the
best value and parameters (metrics `best.*`, tags `best.params`), `trials.csv`, `best.json` and
the figures."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from testbed.cluster.artifacts import log_files
from testbed.tune.problem import Problem
from testbed.tune.storage import redact


def study_run(problem: Problem, study: Any, tracker: Any) -> str | None:
    """The study's MLflow run: reused when this tracking store already has it (resume)."""
    if tracker is None:
        return None
    runs = dict(study.user_attrs.get("testbed.mlflow_runs") or {})
    uri = redact(tracker.uri)
    run_id = runs.get(uri)
    if run_id:
        try:
            tracker.client.get_run(run_id)
            tracker.client.update_run(run_id, status="RUNNING")
            tracker.client.set_tag(run_id, "testbed.resumed_at", f"{time.time():.3f}")  # cluster/unwritten.py
            return run_id
        except Exception:
            pass
    s = problem.settings
    space = {sp.key: sp.text for sp in s.space}
    if problem.search_microbatches:
        space["parallel.num_microbatches"] = "P:2P"
    tags = {"testbed.kind": "study", "optuna.study": problem.study, "optuna.storage": redact(problem.storage_url),
            "tune.objectives": ",".join(s.objectives), "tune.directions": ",".join(s.directions),
            "tune.constraints": ",".join(c.text for c in s.constraints), "tune.space": json.dumps(space),
            "tune.pinned": json.dumps(problem.pinned, default=str), "tune.sampler": s.sampler,
            "tune.seed": str(problem.seed)}
    run_id = tracker.start(problem.base, problem.study, tags=tags)
    runs[uri] = run_id
    study.set_user_attr("testbed.mlflow_runs", runs)
    return run_id


def _best_entries(problem: Problem, summary: dict, best: list) -> tuple[dict[str, float], dict[str, str]]:
    s = problem.settings
    metrics: dict[str, float] = {}
    tags: dict[str, str] = {}
    if not best:
        return metrics, tags
    if s.multi:
        metrics["pareto.size"] = float(len(best))
        tags["pareto.trials"] = ",".join(str(t.number) for t in best)
        tags["pareto.params"] = json.dumps([{"trial": t.number, **t.params} for t in best], default=str)[:5000]
        return metrics, tags
    b = best[0]
    metrics[f"best.{s.objectives[0]}"] = float(b.values[0])
    metrics["best.trial"] = float(b.number)
    for name, value in b.params.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            metrics[f"best.{name}"] = float(value)
        tags[f"best.{name}"] = str(value)
    tags["best.params"] = json.dumps(b.params, default=str)
    tags["best.trial"] = str(b.number)
    if "gain_over_baseline" in summary:
        metrics["best.gain_over_baseline"] = float(summary["gain_over_baseline"])
    return metrics, tags


def log_study(tracker: Any, problem: Problem, summary: dict, best: list, counts: dict,
              out_dir: Path) -> str | None:
    from mlflow.entities import Metric, RunTag  # loaded already by the tracker

    total = sum(counts.values())
    now = int(time.time() * 1000)
    values = {f"trials.{k}": float(v) for k, v in counts.items()}
    if summary["session"]["trials_run"]:
        values["tune.trials_per_min"] = float(summary["session"]["trials_per_min"])
    best_metrics, tags = _best_entries(problem, summary, best)
    values.update(best_metrics)
    tracker.client.log_batch(problem.parent_run_id, metrics=[Metric(k, v, now, total) for k, v in values.items()],
                             tags=[RunTag(k, v[:5000]) for k, v in tags.items()])
    # the study's files (trial run dirs go to the trial runs); an error is returned, not raised,
    # so the study run still ends (cluster/artifacts.py)
    return log_files(tracker.client, problem.parent_run_id, [p for p in sorted(out_dir.iterdir()) if p.is_file()])
