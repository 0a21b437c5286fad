"""What `testbed tune` shows while it runs: the start lines (study, goal, space), a progress bar
(trials done of the target, best so far) and one line per finished trial, every value to 4
significant digits (`kv_thresh=0.1784`)."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from optuna.trial import TrialState
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from testbed.config.objectives import sig4
from testbed.tune.problem import Problem
from testbed.tune.space import dist_text
from testbed.tune.storage import INTERRUPTED, redact


def pareto_indices(points: Sequence[Sequence[float]], directions: Sequence[str]) -> list[int]:
    signs = [1.0 if d == "minimize" else -1.0 for d in directions]
    pts = [[s * v for s, v in zip(signs, p)] for p in points]
    front = []
    for i, a in enumerate(pts):
        dominated = any(all(x <= y for x, y in zip(b, a)) and any(x < y for x, y in zip(b, a))
                        for j, b in enumerate(pts) if j != i)
        if not dominated:
            front.append(i)
    return front


def params_text(params: dict) -> str:
    return " ".join(f"{k.removeprefix('policy.')}={sig4(v)}" for k, v in params.items())


def values_text(objectives: Sequence[str], values: Sequence[float]) -> str:
    return " ".join(f"{o}={sig4(float(v))}" for o, v in zip(objectives, values))


class Display:
    """Progress (trials done of the target, best so far) and one line per finished trial."""

    def __init__(self, console: Any, enabled: bool, problem: Problem, trials: Sequence[Any]) -> None:
        self.console = console
        self.enabled = enabled and console is not None
        self.p = problem
        self.done = sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                        and not t.user_attrs.get(INTERRUPTED))
        self.best: float | None = None
        self.front = 0
        self.points: list[list[float]] = []
        for t in trials:
            if t.state == TrialState.COMPLETE and all(v <= 0 for v in t.constraints.values()):
                self._consider(list(t.values))
        self.progress = None
        self.task = None
        self._lock = threading.Lock()
        self.events = 0

    def _consider(self, values: list[float]) -> None:
        dirs = self.p.settings.directions
        if len(values) == 1:
            v = values[0]
            if self.best is None or (v > self.best if dirs[0] == "maximize" else v < self.best):
                self.best = v
        else:
            self.points.append(values)
            self.front = len(pareto_indices(self.points, dirs))

    def _best_text(self) -> str:
        obj = self.p.settings.objectives
        if len(obj) > 1:
            return f"Pareto front: {self.front}"
        return f"best {obj[0]}: {sig4(float(self.best))}" if self.best is not None else "best: -"

    def __enter__(self):
        if self.enabled:
            self.progress = Progress(TextColumn("trials"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.description}"), TimeElapsedColumn(), console=self.console,
                                     transient=True)
            self.progress.__enter__()
            self.task = self.progress.add_task(self._best_text(), total=self.p.settings.trials,
                                               completed=min(self.done, self.p.settings.trials))
        return self

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
        return False

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    def event(self, ev: dict) -> None:
        with self._lock:
            self._event(ev)

    def _event(self, ev: dict) -> None:
        self.done += 1
        self.events += 1
        if ev.get("state") == "COMPLETE" and ev.get("feasible", True):
            self._consider(ev["values"])
        if self.console is not None and self.enabled:
            self._print_event(ev)
        if self.progress is not None:
            self.progress.update(self.task, completed=min(self.done, self.p.settings.trials),
                                 description=self._best_text())

    def _print_event(self, ev: dict) -> None:
        params = escape(params_text(ev.get("params") or {}))
        if ev.get("state") == "COMPLETE":
            vals = values_text(self.p.settings.objectives, ev["values"])
            tail = "" if ev.get("feasible", True) else " [yellow](infeasible)[/yellow]"
            self.console.print(f"trial {ev['number']:>4} [green]done[/green]   {vals}{tail}  {params}",
                               highlight=False)
        else:
            self.console.print(f"trial {ev['number']:>4} [red]failed[/red] "
                               f"{escape(ev.get('fail_reason', '')[:120])}  {params}", highlight=False)


def print_start(console: Any, problem: Problem, trials: Sequence[Any], stale: Sequence[str]) -> None:
    s = problem.settings
    desc = ", ".join(f"{name} {dist_text(d)}" for name, d in problem.space().items())
    finished = sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)
                   and not t.user_attrs.get(INTERRUPTED))
    resumed = f"resuming: {finished} of {s.trials} trials done" if finished else f"new: {s.trials} trials"
    console.print(f"study [bold]{escape(problem.study)}[/bold] in {escape(redact(problem.storage_url))} "
                  f"({resumed}; {s.workers} worker{'s' if s.workers > 1 else ''})", highlight=False)
    goal = ", ".join(f"{d} {o}" for o, d in zip(s.objectives, s.directions))
    cons = f" subject to {', '.join(c.text for c in s.constraints)}" if s.constraints else ""
    console.print(f"{goal}{cons} over {desc}", highlight=False, markup=False)
    if problem.pinned:
        console.print("fixed: " + ", ".join(f"policy.{k}={sig4(v)}" for k, v in problem.pinned.items()),
                      highlight=False, markup=False)
    todo = max(0, s.trials - finished)
    if todo:
        from testbed.sweep.estimate import estimate_line

        console.print(estimate_line([problem.base] * todo, s.workers, "trial(s)"), highlight=False, markup=False)
    for note in stale:  # trials left RUNNING by dead workers, by name (tune/reclaim.py)
        console.print(f"reclaimed at the start: {note}", highlight=False, markup=False)
