"""The study's files: `trials.csv` (from `study.trials_dataframe()`, objective names as column
names) and figures (optimisation history, parameter importances, the Pareto front for two or
three objectives)."""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pandas as pd
from optuna.trial import TrialState

from testbed.tune.problem import Problem
from testbed.tune.trial import TRIAL_SUMMARY_KEYS

FIGURE_MIN_SIZE = (7, 4.5)  # inches: optuna's defaults cut long parameter names


def trials_frame(study: Any, problem: Problem) -> pd.DataFrame:
    """`study.trials_dataframe()` with the objective names as column names."""
    df = study.trials_dataframe(attrs=("number", "value", "datetime_start", "datetime_complete", "duration",
                                       "params", "user_attrs", "state"))
    if df.empty:
        return pd.DataFrame(columns=["number", "state"])
    names = list(problem.settings.objectives)
    if len(names) == 1 and "value" in df.columns:
        df = df.rename(columns={"value": names[0]})
    else:
        df = df.rename(columns={f"values_{i}": n for i, n in enumerate(names)})
    if "user_attrs_summary" in df.columns:
        for key in TRIAL_SUMMARY_KEYS:
            if key not in df.columns:
                df[key] = [d.get(key) if isinstance(d, dict) else None for d in df["user_attrs_summary"]]
        df = df.drop(columns=["user_attrs_summary"])
    constraints = {t.number: t.constraints for t in study.get_trials(deepcopy=False)}
    for c in problem.settings.constraints:
        df[f"constraint {c.text}"] = [constraints.get(n, {}).get(c.text) for n in df["number"]]
    return df


def write_study_figures(study: Any, problem: Problem, out_dir: Path) -> list[Path]:
    """Optimisation history, parameter importances and (several objectives) the Pareto front.
    matplotlib is imported here: ~0.5 s, and `output.plots=false` studies never need it."""
    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization import matplotlib as ovm

    s = problem.settings
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    paths: list[Path] = []
    if not done:
        return paths
    # optuna's matplotlib plots switch the global style to ggplot: keep that local
    with warnings.catch_warnings(), matplotlib.rc_context():
        warnings.simplefilter("ignore")
        for i, obj in enumerate(s.objectives):
            target = None if not s.multi else (lambda t, i=i: t.values[i])
            suffix = "" if not s.multi else f"_{obj}"
            _save(lambda: ovm.plot_optimization_history(study, target=target, target_name=obj),
                  out_dir / f"optimization_history{suffix}.png", paths)
            if len(done) >= 2:  # importances need a parameter that varied
                _save(lambda: ovm.plot_param_importances(study, target=target, target_name=obj),
                      out_dir / f"param_importances{suffix}.png", paths)
        if s.multi and len(s.objectives) in (2, 3):
            _save(lambda: ovm.plot_pareto_front(study, target_names=list(s.objectives)),
                  out_dir / "pareto_front.png", paths)
    return paths


def _save(draw: Any, path: Path, paths: list[Path]) -> None:
    """Draw one optuna figure and save it; a figure optuna cannot draw yet is skipped."""
    import matplotlib.pyplot as plt

    try:
        drawn = draw()
    except Exception:  # e.g. no parameter varied yet
        plt.close("all")
        return
    fig = drawn if hasattr(drawn, "savefig") else (drawn.flat[0].figure if hasattr(drawn, "flat") else drawn.figure)
    w, h = fig.get_size_inches()
    fig.set_size_inches(max(w, FIGURE_MIN_SIZE[0]), max(h, FIGURE_MIN_SIZE[1]))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
