"""What a study optimises and a comparison reports (`tune.objectives`, `compare.metrics`; here, below
both commands): summary metrics by name or alias, their natural direction, and
constraints (`slo_attainment>=0.9`) in Optuna's convention (a value <= 0 is feasible)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.base.errors import ConfigError
from engine.core.metrics import SUMMARY_KEYS

OBJECTIVE_ALIASES = {
    "throughput": "throughput_tok_s", "output_throughput": "output_throughput_tok_s",
    "ttft": "ttft_p99_s", "tpot": "tpot_p99_s", "e2el": "e2el_p99_s", "latency": "e2el_mean_s",
    "slo": "slo_attainment", "goodput": "slo_attainment", "bubble": "bubble_ratio",
    "preemptions": "num_preemptions",
}
MAXIMIZE = {"throughput_tok_s", "output_throughput_tok_s", "request_throughput", "slo_attainment", "num_finished"}
MINIMIZE = {"duration_s", "ttft_mean_s", "ttft_p50_s", "ttft_p99_s", "tpot_mean_s", "tpot_p50_s", "tpot_p99_s",
            "e2el_mean_s", "e2el_p50_s", "e2el_p99_s", "bubble_ratio", "num_preemptions", "num_failed"}
LIST_KEYS = {"stage_bubble_ratio", "stage_utilization"}  # per-stage lists: not an objective
SCALAR_KEYS = [k for k in SUMMARY_KEYS if k not in LIST_KEYS]
VIOLATION_IF_NAN = 1e12  # constraint value of a metric that is NaN (e.g. no request finished)


def resolve_metric(name: str, what: str) -> str:
    key = OBJECTIVE_ALIASES.get(name, name)
    if key in LIST_KEYS:
        raise ConfigError(f"{what} {name!r} is a per-stage list; use a scalar summary key, e.g. bubble_ratio")
    if key not in SCALAR_KEYS:
        raise ConfigError(f"unknown {what} {name!r}; valid choices: {', '.join(sorted(OBJECTIVE_ALIASES))}, "
                          f"{', '.join(SCALAR_KEYS)}")
    return key


def default_direction(key: str) -> str | None:
    return "maximize" if key in MAXIMIZE else "minimize" if key in MINIMIZE else None


@dataclass(frozen=True)
class Constraint:
    """`metric>=threshold` or `metric<=threshold`; Optuna's convention: value <= 0 is feasible."""

    metric: str
    op: str  # ">=" or "<="
    threshold: float

    @classmethod
    def parse(cls, text: str) -> Constraint:
        for op in (">=", "<="):
            if op in text:
                name, _, value = text.partition(op)
                metric = resolve_metric(name.strip(), "constraint metric")
                try:
                    threshold = float(value)
                except ValueError:
                    raise ConfigError(f"invalid constraint {text!r}: {value!r} is not a number") from None
                return cls(metric, op, threshold)
        raise ConfigError(f"invalid constraint {text!r}: write metric>=value or metric<=value "
                          f"(quote it in the shell: 'tune.constraints=[slo_attainment>=0.9]')")

    @property
    def text(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}"

    def violation(self, summary: Mapping[str, Any]) -> float:
        value = summary.get(self.metric)
        if value is None or not isinstance(value, (int, float)) or math.isnan(value):
            return VIOLATION_IF_NAN
        return self.threshold - value if self.op == ">=" else value - self.threshold


def sig4(value: Any) -> str:
    """A value as printed by tune and compare: 4 significant digits (`kv_thresh=0.1784`), large
    numbers without an exponent (`12346` rather than `1.235e+04`), ints and text unchanged."""
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if not math.isfinite(value):
        return str(value)
    if 1e4 <= abs(value) < 1e15:
        return f"{value:.0f}"
    return f"{value:.4g}"
