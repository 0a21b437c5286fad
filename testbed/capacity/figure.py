"""capacity.png: the criterion's metric against the probed rate, one line per point, passes as
dots and failures as crosses, the target as a dashed line and each point's capacity as a star, so
a non-monotone point shows as a dot right of a cross."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from testbed.sweep.report import LABELS

MARKER_SIZE = 6
WINDOW_STYLES = ("-", "--", ":", "-.")


def plot_search(p: Any, feed: Any, path: Path) -> Path | None:
    import matplotlib  # lazy: ~0.5 s

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    searched = [(pt, feed.searches[pt.index]) for pt in p.points if feed.searches[pt.index].probes]
    if not searched:
        return None
    s = p.settings
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    groups = sorted({pt.group for pt, _ in searched})
    for pt, search in searched:  # one colour per grid point, one line style per window
        color = f"C{groups.index(pt.group) % 10}"
        probes = sorted(search.probes, key=lambda pr: pr.rate)
        cap = search.outcome().capacity
        label = pt.label if pt.label != "base" else "capacity"
        label += f": {cap:g} req/s" if cap is not None else ": none"
        label += f" ({pt.window_label})"
        ax.plot([pr.rate for pr in probes], [pr.value for pr in probes], color=color, lw=1, alpha=0.7, label=label,
                ls=":" if pt.holdout else WINDOW_STYLES[pt.window % len(WINDOW_STYLES)])
        passed = [pr for pr in probes if pr.passed]
        failed = [pr for pr in probes if not pr.passed]
        ax.plot([pr.rate for pr in passed], [pr.value for pr in passed], "o", color=color, ms=MARKER_SIZE)
        ax.plot([pr.rate for pr in failed], [pr.value for pr in failed], "x", color=color, ms=MARKER_SIZE + 1)
        if cap is not None:
            at = next(pr for pr in probes if pr.rate == cap)
            point = feed.points[pt.group]
            answer = point.binding == pt.index and point.status == "confirmed"  # the printed capacity: large
            ax.plot([cap], [at.value], "*", color=color, ms=16 if answer else 8, markeredgecolor="black", zorder=5)
    for target in sorted({pt.target for pt, _ in searched}):
        ax.axhline(target, color="grey", ls="--", lw=1)
        ax.annotate(f"target {target:g}", (1.0, target), xycoords=("axes fraction", "data"), ha="right",
                    va="bottom", fontsize=8, color="grey")
    rates = [pr.rate for _, search in searched for pr in search.probes]
    if max(rates) / min(rates) > 8:
        ax.set_xscale("log")
    ax.set_xlabel(LABELS["workload.rate"])
    ax.set_ylabel(LABELS.get(s.metric, s.metric))
    ax.set_title(_title(p), fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, title="window: its capacity (star; large: the point's, confirmed); o pass, x fail",
              title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _title(p: Any) -> str:
    """What every point shares, what the criterion is and how large a probe is."""
    from testbed.sweep.compare import setup_title

    hidden = [*p.axes, "workload.rate", "workload.num_requests", "workload.start_s", "workload.seed",
              *(["policy"] if "system" in p.axes else [])]
    shared = setup_title(p.run0, hidden).split(" — varying")[0]
    where = f"{p.live.base_url} · " if p.live is not None else ""
    targets = ", ".join(p.settings.describe(t) for t in sorted({pt.target for pt in p.points}))
    return f"{where}{shared}\ncapacity: highest rate with {targets}; each probe {p.probe_text()}"
