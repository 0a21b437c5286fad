"""Figures of one run (matplotlib, headless Agg backend), drawn from `outputs.plot_data(result)`:
a small JSON-safe dict, so `testbed run` can render them in its background process while the
main process prints the summary (testbed/tracking/background.py)."""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

KIND_COLORS = {"prefill": "#d62728", "decode": "#1f77b4", "mixed": "#9467bd", "prepare": "#bbbbbb",
               "sample": "#2ca02c", "send": "#ff7f0e", "recv": "#8c564b", "wait": "#eeeeee"}


def _kind(name: str) -> str:
    return name.split(":", 1)[1] if name.startswith("forward:") else name


def _color(name: str) -> str:
    return KIND_COLORS.get(_kind(name), "#7f7f7f")


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def render_plots(data: dict, out_dir: Path) -> list[Path]:
    """Write timeline.png, kv_usage.png (and breakdown.png) into `out_dir`; return their paths."""
    paths = [out_dir / "timeline.png", out_dir / "kv_usage.png"]
    plot_timeline(data, paths[0])
    plot_kv_usage(data, paths[1])
    if data.get("breakdown"):
        from testbed.run.breakdown_plot import plot_breakdown

        paths.append(out_dir / "breakdown.png")
        plot_breakdown(data["breakdown"], data["title"], paths[-1])
    return paths


def plot_timeline(data: dict, path: Path) -> None:
    """Gantt chart of consecutive micro-batches on every stage, link and sampler: bubbles show as
    white gaps between bars. The key lists only the span kinds present, below the axes."""
    tl = data["timeline"]
    spans = tl["spans"]
    stages = list(data["stage_tracks"])
    tracks = stages + sorted({s[0] for s in spans} - set(stages), key=_natural)
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(tracks) + 2.0))
    for i, track in enumerate(tracks):
        rows = [s for s in spans if s[0] == track]
        if rows:
            ax.broken_barh([(s[2], s[3] - s[2]) for s in rows], (i - 0.4, 0.8),
                           facecolors=[_color(s[1]) for s in rows], edgecolor="none")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(f"pipeline timeline, micro-batches {tl['first']}-{tl['last']} ({data['title']})")
    present = {_kind(s[1]) for s in spans}
    handles = [Patch(color=c, label=k) for k, c in KIND_COLORS.items() if k in present]
    unknown = sorted(k for k in present if k not in KIND_COLORS)
    handles += [Patch(color="#7f7f7f", label=", ".join(unknown))] if unknown else []
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / (len(tracks) + 4)),
                  fontsize=8, ncol=len(handles), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_kv_usage(data: dict, path: Path) -> None:
    kv = data["kv"]
    fig, ax = plt.subplots(figsize=(10, 3.5))
    if kv["t"]:
        l1 = ax.plot(kv["t"], kv["kv_usage"], lw=0.8, label="KV usage (left axis)")
        ax.set_ylim(0, 1.05)
        ax2 = ax.twinx()
        l2 = ax2.plot(kv["t"], kv["num_tokens"], lw=0.5, color="#ff7f0e", alpha=0.6,
                      label="tokens per micro-batch (right axis)")
        ax2.set_ylabel("tokens per micro-batch")
        ax.legend(handles=l1 + l2, loc="upper right", fontsize=8)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV usage (fraction of blocks)")
    ax.set_title(f"KV cache usage at each micro-batch launch ({data['title']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
