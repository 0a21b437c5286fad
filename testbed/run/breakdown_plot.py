"""breakdown.png: each stage's wall time split into compute, host work, transfer and idle by
cause (engine/core/breakdown.py), one stacked bar per stage, percentages of the run's window."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"compute": "#d62728", "host": "#bbbbbb", "transfer": "#ff7f0e", "idle_wait_prev": "#9ecae1",
          "idle_wait_next": "#3182bd", "idle_no_work": "#eeeeee", "idle_drain": "#756bb1"}
LABELS = {"compute": "compute", "host": "host (prepare, sample)", "transfer": "transfer (send)",
          "idle_wait_prev": "idle: waiting on previous stage", "idle_wait_next": "idle: waiting on next stage / slot",
          "idle_no_work": "idle: no work admitted", "idle_drain": "idle: drain"}


def plot_breakdown(breakdown: dict, title: str, path: Path, ax=None) -> None:
    """One bar per stage (stage 0 on top); `ax` draws into an existing figure (a comparison)."""
    fractions = breakdown["fractions"]
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(10, 0.5 * len(fractions) + 2.2))
    left = [0.0] * len(fractions)
    for part in breakdown["parts"]:
        widths = [100 * f[part] for f in fractions]
        ax.barh(range(len(fractions)), widths, left=left, color=COLORS.get(part, "#7f7f7f"),
                label=LABELS.get(part, part), edgecolor="white", linewidth=0.5)
        left = [a + w for a, w in zip(left, widths)]
    ax.set_yticks(range(len(fractions)), [f"stage{s}" for s in range(len(fractions))])
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of the stage's wall time")
    ax.set_title(f"where each stage's time went ({title})", fontsize=10)
    if own:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25 - 0.3 / (len(fractions) + 1)), ncol=4,
                  fontsize=7, frameon=False)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
