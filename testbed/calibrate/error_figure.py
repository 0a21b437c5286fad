"""The simulator against the engine at a glance: `validate --runs` writes `errors.png` beside `errors.md`.

One panel per metric (throughput, mean TTFT, mean TPOT): each (set, setting, policy) group is a point at
(the engine's mean over its repeats, the simulator's mean), with a bar over the engine's repeats (min to
max: where the engine itself lands), against the line of agreement and its +-10% band (issue 47's CPU
target). Marker colour is the set (fit, validation, test), marker shape the setting. The same figure is
drawn from a committed errors CSV (`write_errors_csv`'s columns) by `python -m testbed.calibrate.error_figure
errors.csv out.png [title]`, for the sets reported before the figure existed.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import pandas as pd

METRICS = (("throughput_tok_s", "throughput (tok/s)", 1.0), ("ttft_mean_s", "mean TTFT (ms)", 1e3),
           ("tpot_mean_s", "mean TPOT (ms)", 1e3))
SET_COLOURS = {"fit": "#7f7f7f", "validation": "#1f77b4", "test": "#ff7f0e", "": "#2ca02c"}
MARKERS = "osD^v<>px*h"
BAND = 0.10


def frame_of(rows: Sequence) -> pd.DataFrame:
    """`Replayed` rows as the errors CSV's long table (run, set, policy, setting, metric, predicted, actual)."""
    return pd.DataFrame([{"run": r.run, "set": r.set, "policy": r.policy, "setting": r.setting, "metric": m,
                          "predicted": r.sim.get(m), "actual": r.real.get(m)} for r in rows for m, _, _ in METRICS])


def group_means(long: pd.DataFrame) -> pd.DataFrame:
    """(set, setting, policy, metric) -> the simulator's and the engine's means, the engine's min and max."""
    df = long.copy()
    df["set"] = df["set"].fillna("")
    df[["predicted", "actual"]] = df[["predicted", "actual"]].apply(pd.to_numeric, errors="coerce")
    return (df.dropna(subset=["predicted", "actual"])
            .groupby(["set", "setting", "policy", "metric"])
            .agg(sim=("predicted", "mean"), real=("actual", "mean"), lo=("actual", "min"), hi=("actual", "max"),
                 n=("actual", "size")).reset_index())


def within_band(groups: pd.DataFrame) -> dict[str, tuple[int, int]]:
    """metric -> (groups within +-BAND of the engine's mean, groups)."""
    out = {}
    for metric, g in groups.groupby("metric"):
        out[metric] = (int((abs(g["sim"] / g["real"] - 1.0) <= BAND).sum()), len(g))
    return out


def error_figure(long: pd.DataFrame, path: Path, title: str) -> Path:
    """Draw the figure (module docstring) from the long table; returns `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    groups = group_means(long)
    counts = within_band(groups)
    settings = sorted(groups["setting"].unique())
    fig, axes = plt.subplots(1, len(METRICS), figsize=(5.2 * len(METRICS), 5.0))
    for ax, (metric, label, scale) in zip(axes, METRICS):
        g = groups[groups["metric"] == metric]
        if g.empty:
            ax.set_axis_off()
            continue
        lo_all = min(g["lo"].min(), g["sim"].min()) * scale * 0.85
        hi_all = max(g["hi"].max(), g["sim"].max()) * scale * 1.15
        line = [lo_all, hi_all]
        ax.plot(line, line, color="black", lw=0.8)
        ax.fill_between(line, [v * (1 - BAND) for v in line], [v * (1 + BAND) for v in line], color="0.9", zorder=0)
        for _, row in g.iterrows():
            within = abs(row["sim"] / row["real"] - 1.0) <= BAND
            ax.errorbar(row["real"] * scale, row["sim"] * scale,
                        xerr=[[(row["real"] - row["lo"]) * scale], [(row["hi"] - row["real"]) * scale]],
                        fmt=MARKERS[settings.index(row["setting"]) % len(MARKERS)], ms=6, capsize=2, lw=0.8,
                        color=SET_COLOURS.get(row["set"], "#2ca02c"), mfc="white" if not within else None)
        ax.set_xscale("log")
        ax.set_yscale("log")
        for axis in (ax.xaxis, ax.yaxis):  # plain numbers, not powers of ten
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if str(round(v))[0] in "1235" else ""))
        ax.set_xlim(line)
        ax.set_ylim(line)
        ax.set_xlabel(f"engine, {label}")
        ax.set_ylabel(f"simulator, {label}")
        ax.set_title(f"{label}: {counts[metric][0]} of {counts[metric][1]} groups within {BAND:.0%}", fontsize=10)
    handles = [plt.Line2D([], [], ls="", marker="o", color=c, label=s or "runs")
               for s, c in SET_COLOURS.items() if s in set(groups["set"])]
    handles += [plt.Line2D([], [], ls="", marker=MARKERS[i % len(MARKERS)], color="black", mfc="white", label=s)
                for i, s in enumerate(settings)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 7), fontsize=9, frameon=False)
    fig.suptitle(f"{title}\n(bars: the engine's repeats, min to max; grey band: +-{BAND:.0%}; hollow: outside it)",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python -m testbed.calibrate.error_figure <errors.csv> <out.png> [title]")
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    print(error_figure(pd.read_csv(src), dst, sys.argv[3] if len(sys.argv) == 4 else src.stem))
