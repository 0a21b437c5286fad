"""Figures of one run (matplotlib, headless Agg backend)."""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KIND_COLORS = {"prefill": "#d62728", "decode": "#1f77b4", "mixed": "#9467bd", "prepare": "#bbbbbb",
               "sample": "#2ca02c", "send": "#ff7f0e", "recv": "#8c564b", "wait": "#eeeeee"}


def _color(name: str) -> str:
    if name.startswith("forward:"):
        return KIND_COLORS.get(name.split(":", 1)[1], "#7f7f7f")
    return KIND_COLORS.get(name, "#7f7f7f")


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def plot_timeline(result, path: Path, max_microbatches: int = 40) -> None:
    """Gantt chart of `max_microbatches` consecutive micro-batches on every stage, link and
    sampler, taken from the middle of the traced part of the run (steady state, not warm-up):
    bubbles show as white gaps between bars."""
    traced = max((s[4] for s in result.tracer.spans), default=0)
    first = max(0, traced // 2 - max_microbatches // 2)
    spans = [s for s in result.tracer.spans if first <= s[4] < first + max_microbatches]
    tracks = result.stage_tracks + sorted({s[0] for s in spans} - set(result.stage_tracks), key=_natural)
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(tracks) + 1.5))
    for i, track in enumerate(tracks):
        rows = [s for s in spans if s[0] == track and s[1] != "wait"]
        if rows:
            ax.broken_barh([(s[2], s[3] - s[2]) for s in rows], (i - 0.4, 0.8),
                           facecolors=[_color(s[1]) for s in rows], edgecolor="none")
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    pol = result.info.get("policy", "")
    ax.set_title(f"pipeline timeline, micro-batches {first}-{first + max_microbatches - 1} "
                 f"({pol}, {result.info.get('executor', '')})")
    handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in KIND_COLORS.items() if k != "wait"]
    ax.legend(handles=handles, loc="upper right", fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_kv_usage(result, path: Path) -> None:
    mbs = result.microbatches
    fig, ax = plt.subplots(figsize=(10, 3.5))
    if mbs:
        t = [m["scheduled_s"] for m in mbs]
        ax.plot(t, [m["kv_usage"] for m in mbs], lw=0.8, label="KV usage")
        ax.set_ylim(0, 1.05)
        ax2 = ax.twinx()
        ax2.plot(t, [m["num_tokens"] for m in mbs], lw=0.5, color="#ff7f0e", alpha=0.5, label="tokens / micro-batch")
        ax2.set_ylabel("tokens per micro-batch")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV usage (fraction of blocks)")
    ax.set_title("KV cache usage at each micro-batch launch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
