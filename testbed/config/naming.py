"""One naming style for everything a user reads: console progress lines, MLflow run names, tables.

`gllm · azure · rate=0.8` for a run (testbed/run/outputs.display_name), `sarathi · rate=0.5` for a
sweep point (what varies), `gllm · rate=0.8 · w2` for a capacity probe on the trace's second window,
`gllm · trial=7` for a tuning trial. Parts are joined by ` · `; a dotted key keeps its last part
(`workload.rate=0.5` -> `rate=0.5`) and a group choice is the bare choice (`policy=gllm` -> `gllm`).
The CLI once printed `policy=gllm,workload.rate=0.25` where MLflow said `gllm · rate=0.25`, and a
capacity search's three windows were three runs all named `gllm · rate=0.8` (issue 49 item 7).
"""
from __future__ import annotations

from typing import Any, Mapping

SEP = " · "


def short(value: Any) -> str:
    """A value as names show it: floats to 4 significant digits (0.25, 1.333), the rest as given."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def part(key: str, value: Any) -> str:
    """One name part: a group choice bare (`gllm`), any other key as `<last key part>=<value>`."""
    return short(value) if "." not in key else f"{key.rsplit('.', 1)[1]}={short(value)}"


def point_name(values: Mapping[str, Any], *, window: int | None = None, trial: int | None = None) -> str:
    """The name of a sweep point, capacity probe or trial: what varies, then the trace window
    (`w<k>`, capacity searches over several windows) or the trial number. `base` when nothing varies."""
    parts = [part(k, v) for k, v in values.items()]
    if window is not None:
        parts.append(f"w{window}")
    if trial is not None:
        parts.append(f"trial={trial}")
    return SEP.join(parts) or "base"


__all__ = ["SEP", "part", "point_name", "short"]
