"""Figures of `testbed calibrate tables`: predicted vs measured kernel times.

- `linear.png`: one decoder layer's linear part (GEMMs + elementwise) against tokens, measured,
  fitted and roofline, for held-out models at TP=1, one panel per device: the tile steps show.
- `attention.png`: decode attention against batch x context and prefill attention against chunk
  tokens (each shape as held out), measured vs fitted vs roofline.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd


def error_figures(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    devices = list(dict.fromkeys(df.device))
    fig, axes = plt.subplots(1, len(devices), figsize=(5.2 * len(devices), 4.2), squeeze=False)
    for ax, device in zip(axes[0], devices):
        lin = df[(df.device == device) & (df.family == "linear") & df.held & (df.tp == 1)]
        for i, (model, g) in enumerate(lin.groupby("model")):
            g = g.sort_values("x")
            color = f"C{i}"
            ax.plot(g.x, g.measured * 1e3, "-", color=color, lw=1.2, label=f"{model} measured")
            ax.plot(g.x, g.fitted * 1e3, "--", color=color, lw=1.0)
            ax.plot(g.x, g.default * 1e3, ":", color=color, lw=1.0)
        ax.set(title=f"{device}: linear part of one layer (TP=1, held out)", xlabel="tokens", ylabel="ms",
               xscale="log", yscale="log")
        ax.plot([], [], "k--", label="fitted"), ax.plot([], [], "k:", label="roofline")
        ax.legend(fontsize=6, loc="upper left")
    fig.tight_layout()
    paths.append(out_dir / "linear.png")
    fig.savefig(paths[-1], dpi=130)
    plt.close(fig)

    att = df[df.family.isin(["decode", "prefill"]) & df.held]
    if len(att):
        pairs = [(d, f) for d in devices for f in ("decode", "prefill") if len(att[(att.device == d) & (att.family == f)])]
        fig, axes = plt.subplots(1, len(pairs), figsize=(4.6 * len(pairs), 4.2), squeeze=False)
        for ax, (device, fam) in zip(axes[0], pairs):
            g = att[(att.device == device) & (att.family == fam)]
            ax.scatter(g.x, g.measured * 1e3, s=3, c="k", label="measured", alpha=0.5)
            ax.scatter(g.x, g.fitted * 1e3, s=3, c="C0", label="fitted", alpha=0.5)
            ax.scatter(g.x, g.default * 1e3, s=3, c="C3", label="roofline", alpha=0.3)
            ax.set(title=f"{device}: {fam} attention (held-out rows)", xscale="log", yscale="log", ylabel="ms",
                   xlabel="batch x context (KV tokens)" if fam == "decode" else "chunk tokens")
            ax.legend(fontsize=7, markerscale=3)
        fig.tight_layout()
        paths.append(out_dir / "attention.png")
        fig.savefig(paths[-1], dpi=130)
        plt.close(fig)
    return paths
