"""MLflow logging of runs (imported only where tracking happens: `import mlflow` costs ~1 s).

One experiment run = one MLflow run: params are the whole resolved config flattened, metrics
the summary (lists per stage become `<key>.stage<i>`), step metrics the KV usage and tokens per
micro-batch (downsampled to at most 1,000 points and sent with `log_batch`, since one
`log_metric` call costs ~19 ms on SQLite), artifacts the run directory. The run is opened
before the experiment starts, so a crash is recorded as FAILED, not lost.

The default store is `sqlite:///<output.dir>/mlflow.db`, with artifacts in
`<output.dir>/mlartifacts`. Optuna never shares this database (both use alembic tables).
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from testbed.config import flatten

MAX_STEP_POINTS = 1000


def tracking_uri(cfg: Mapping[str, Any]) -> str:
    out = cfg.get("output") or {}
    uri = out.get("tracking_uri")
    if uri:
        return str(uri)
    db = Path(out.get("dir") or "runs").resolve() / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def artifact_root(cfg: Mapping[str, Any]) -> str:
    out = cfg.get("output") or {}
    return (Path(out.get("dir") or "runs").resolve() / "mlartifacts").as_uri()


class Tracker:
    """Thin wrapper over MlflowClient: explicit run ids, no thread-local active-run stack
    (MLflow's active run is thread-local since mlflow PR 13456), so nested runs work from any worker."""

    def __init__(self, cfg: Mapping[str, Any], experiment: str | None = None) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(cfg)
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        name = experiment or (cfg.get("output") or {}).get("experiment") or "testbed"
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                self.experiment_id = self.client.create_experiment(name, artifact_location=artifact_root(cfg))
            except Exception:  # created concurrently by another worker
                self.experiment_id = self.client.get_experiment_by_name(name).experiment_id
        else:
            self.experiment_id = exp.experiment_id

    def start(self, cfg: Mapping[str, Any], run_name: str, parent_run_id: str | None = None,
              tags: Mapping[str, str] | None = None) -> str:
        from mlflow.entities import Param

        all_tags = {"policy": str(cfg["policy"]["name"]), "workload": str(cfg["workload"]["name"]),
                    "executor": str((cfg.get("executor") or {}).get("name", "sim")), **(tags or {})}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self.client.create_run(self.experiment_id, run_name=run_name, tags=all_tags)
        run_id = run.info.run_id
        params = [Param(k, _param_value(v)) for k, v in sorted(flatten(cfg).items())]
        for i in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[i:i + 100])
        return run_id

    def finish(self, run_id: str, result, run_dir: Path | None, steps: bool = True) -> None:
        """Log the summary (and, with `steps`, the step series; with `run_dir`, the artifacts)
        and close the run. Tuning trials skip steps and artifacts: they cost ~0.6 s a trial."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for k, v in result.summary.items():
            if isinstance(v, list):
                metrics += [Metric(f"{k}.stage{i}", float(x), now, 0) for i, x in enumerate(v)]
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                metrics.append(Metric(k, float(v), now, 0))
        for k in ("wall_s", "simulate_s", "microbatches_per_wall_s"):
            if k in result.info:
                metrics.append(Metric(f"run.{k}", float(result.info[k]), now, 0))
        mbs = result.microbatches if steps else []
        stride = max(1, math.ceil(len(mbs) / MAX_STEP_POINTS))
        for m in mbs[::stride]:
            metrics.append(Metric("step.kv_usage", float(m["kv_usage"]), now, int(m["mb_id"])))
            metrics.append(Metric("step.tokens_per_microbatch", float(m["num_tokens"]), now, int(m["mb_id"])))
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(run_id, metrics=metrics[i:i + 1000])
        if run_dir is not None:
            self.client.log_artifacts(run_id, str(run_dir))
        if result.error:
            self.client.set_tag(run_id, "error", result.error[:5000])
        self.client.set_terminated(run_id, "FAILED" if result.error else "FINISHED")

    def fail(self, run_id: str, error: BaseException | str) -> None:
        self.client.set_tag(run_id, "error", str(error)[:5000])
        self.client.set_terminated(run_id, "FAILED")


def _param_value(v: Any) -> str:
    s = "null" if v is None else str(v)
    return s if len(s) <= 6000 else s[:5997] + "..."
