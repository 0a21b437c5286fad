"""Comparison tables and figures, from results in hand (`testbed compare`) or rebuilt from MLflow
(`testbed report <experiment>`).

    testbed report compare-20260101-120000
    testbed report my-grid other-machine-grid --tracking-uri http://mlflow.lab:5000 --out figs/

`report` reads runs with `mlflow.search_runs` (pandas), so runs logged by several machines into
one tracking store (a shared SQL database or an MLflow server) come out as one table. Each run is
a row: its axes (the keys a comparison swept, from the run's `axis.*` tags; for runs without them,
the params that differ between runs), status, error and summary metrics. Container runs (a
study's or a comparison's parent run) are skipped.

Figures follow the papers' style: x = a numeric axis (the request rate when it is one), one line
per value of the other axes (e.g. per policy), one panel per metric; without a numeric axis, bars.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from engine.base.errors import ConfigError
from testbed.config.redact import redact

TABLE_METRICS = ("throughput_tok_s", "output_throughput_tok_s", "ttft_mean_s", "ttft_p99_s", "tpot_mean_s",
                 "tpot_p99_s", "e2el_mean_s", "e2el_p99_s", "slo_attainment", "bubble_ratio", "num_preemptions",
                 "num_finished", "num_failed")
FIGURE_METRICS = ("slo_attainment", "throughput_tok_s", "ttft_p99_s", "tpot_p99_s", "e2el_mean_s")  # attainment leads
PRINT_METRICS = ("throughput_tok_s", "ttft_p99_s", "tpot_p99_s", "e2el_mean_s", "slo_attainment")  # terminal width
LABELS = {"throughput_tok_s": "throughput (tok/s)", "output_throughput_tok_s": "output throughput (tok/s)",
          "ttft_mean_s": "TTFT mean (s)", "ttft_p99_s": "TTFT p99 (s)", "tpot_mean_s": "TPOT mean (s)",
          "tpot_p99_s": "TPOT p99 (s)", "e2el_mean_s": "E2E latency mean (s)", "e2el_p99_s": "E2E latency p99 (s)",
          "slo_attainment": "SLO attainment", "bubble_ratio": "bubble ratio", "num_preemptions": "preemptions",
          "workload.rate": "request rate (req/s)"}
CONTAINER_KINDS = ("study", "compare", "capacity")  # parent runs, not results
IGNORED_PARAMS = ("output.", "data_dir", "check_integrity")


# --- values ---------------------------------------------------------------------------------------

def typed(value: Any) -> Any:
    """MLflow params are strings: '4' -> 4, '2.5' -> 2.5, 'null' -> None, others unchanged."""
    if not isinstance(value, str):
        return value
    if value in ("null", "None"):
        return None
    if value in ("true", "True", "false", "False"):
        return value.lower() == "true"
    try:
        return int(value)
    except ValueError:
        pass
    try:
        return float(value)
    except ValueError:
        return value


def is_numeric_axis(values: Sequence[Any]) -> bool:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return len(set(vals)) >= 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals)


def _sort_key(v: Any) -> tuple:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return (2, 0, "")
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (0, float(v), "")
    return (1, 0, str(v))


def sort_rows(df: pd.DataFrame, axes: Sequence[str]) -> pd.DataFrame:
    if df.empty or not axes:
        return df.reset_index(drop=True)
    keys = [tuple(_sort_key(r[a]) for a in axes) for _, r in df.iterrows()]
    order = sorted(range(len(df)), key=lambda i: keys[i])
    return df.iloc[order].reset_index(drop=True)


# --- tables ----------------------------------------------------------------------------------------

def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def to_markdown(df: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table (no `tabulate` dependency)."""
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |",
             "|" + "|".join("---:" if pd.api.types.is_numeric_dtype(df[c]) and df[c].dtype != bool else "---"
                            for c in cols) + "|"]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(_fmt(row[c]).replace("|", "\\|").replace("\n", " ") for c in cols) + " |")
    return "\n".join(lines) + "\n"


def table_columns(df: pd.DataFrame, axes: Sequence[str], metrics: Sequence[str]) -> list[str]:
    front = [c for c in ("point", "trial") if c in df.columns]
    tail = [c for c in ("host", "run_id", "error") if c in df.columns]
    return front + list(axes) + ["status"] + [m for m in metrics if m in df.columns] + tail


# --- figures ---------------------------------------------------------------------------------------

def choose_x(df: pd.DataFrame, axes: Sequence[str], x: str | None = None) -> str | None:
    if x is not None:
        if x not in axes:
            raise ConfigError(f"x axis {x!r} is not one of the axes: {', '.join(axes) or '(none)'}")
        return x
    numeric = [a for a in axes if is_numeric_axis(list(df[a]))]
    if "workload.rate" in numeric:
        return "workload.rate"
    return numeric[0] if numeric else None


def plot_comparison(df: pd.DataFrame, axes: Sequence[str], out_dir: Path, x: str | None = None,
                    metrics: Sequence[str] = FIGURE_METRICS, max_series: int = 12,
                    title: str | None = None) -> list[Path]:
    """One PNG per metric plus `overview.png` (every metric side by side, under `title`)."""
    import matplotlib  # lazy: ~0.5 s to import, and tables without figures never need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = df[df["status"] == "finished"] if "status" in df.columns else df
    metrics = [m for m in metrics if m in ok.columns and ok[m].notna().any()]
    if ok.empty or not metrics:
        return []
    x = choose_x(df, axes, x)
    others = [a for a in axes if a != x]
    draw = _line_drawer(ok, others, x, max_series) if x is not None else _bar_drawer(ok, axes)
    if draw is None:
        return []
    paths: list[Path] = []
    stem = f"_vs_{_safe(x)}" if x else ""
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, metric)
        if x is not None and others:
            ax.legend(title=", ".join(others) if len(others) == 1 else None, fontsize=8)
        fig.tight_layout()
        paths.append(_save(plt, fig, out_dir / f"{metric}{stem}.png"))
    legend = others if x is not None else []
    paths.append(_save(plt, _overview(plt, draw, metrics, legend, title), out_dir / "overview.png"))
    return paths


def _line_drawer(ok: pd.DataFrame, others: list[str], x: str, max_series: int) -> Any:
    """x = a numeric axis, one line per value of the other axes (None: too many lines)."""
    groups: dict[tuple, list] = {}
    for _, row in ok.iterrows():
        groups.setdefault(tuple(row[a] for a in others), []).append(row)
    if len(groups) > max_series:
        return None

    def series_label(key: tuple) -> str:
        if not others:
            return "run"
        if len(others) == 1:
            return str(key[0])
        return ", ".join(f"{a}={v}" for a, v in zip(others, key))

    def draw(ax, metric: str) -> None:
        for key in sorted(groups, key=lambda k: tuple(_sort_key(v) for v in k)):
            rows = sorted(groups[key], key=lambda r: _sort_key(r[x]))
            ax.plot([r[x] for r in rows], [r[metric] for r in rows], marker="o", label=series_label(key))
        ax.set_xlabel(LABELS.get(x, x))
        ax.set_ylabel(LABELS.get(metric, metric))
        ax.grid(True, alpha=0.3)
        if all(float(v).is_integer() for v in ok[x]):  # counts (micro-batches, P): no 4.5 ticks
            from matplotlib.ticker import MaxNLocator  # lazy, as in plot_comparison

            ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    return draw


def _bar_drawer(ok: pd.DataFrame, axes: Sequence[str]) -> Any:
    """No numeric axis: one bar per run."""
    labels = [", ".join(f"{r[a]}" for a in axes) if axes else str(r.get("run_name", i))
              for i, (_, r) in enumerate(ok.iterrows())]

    def draw(ax, metric: str) -> None:
        ax.bar(range(len(ok)), list(ok[metric]), color="C0")
        ax.set_xticks(range(len(ok)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(LABELS.get(metric, metric))
        ax.grid(True, axis="y", alpha=0.3)

    return draw


def _overview(plt: Any, draw: Any, metrics: list[str], legend: list[str], title: str | None) -> Any:
    """Every metric in one figure: the title, one shared legend (over `legend` axes), the panels."""
    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axs = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows + 0.6), squeeze=False)
    for ax, metric in zip(axs.flat, metrics):
        draw(ax, metric)
    for ax in list(axs.flat)[len(metrics):]:
        ax.set_visible(False)
    top = 1.0  # the panels go below the title and the shared legend, stacked from the top
    if title:
        top = _bottom(fig, fig.text(0.5, 0.995, title, ha="center", va="top", fontsize=10))
    if legend:
        handles, labs = axs[0][0].get_legend_handles_labels()
        top = _bottom(fig, fig.legend(handles, labs, loc="upper center", ncol=min(len(labs), 4), fontsize=8,
                                      title=", ".join(legend) if len(legend) == 1 else None,
                                      bbox_to_anchor=(0.5, top)))
    fig.tight_layout(rect=(0, 0, 1, top))
    return fig


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bottom(fig: Any, artist: Any) -> float:
    """The lower edge of a figure-level artist (title, legend) in figure coordinates, less a gap."""
    box = artist.get_window_extent(fig.canvas.get_renderer()).transformed(fig.transFigure.inverted())
    return box.y0 - 0.01


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=+-]+", "_", text)


def write_comparison(df: pd.DataFrame, axes: Sequence[str], out_dir: Path, x: str | None = None,
                     metrics: Sequence[str] = TABLE_METRICS, figure_metrics: Sequence[str] = FIGURE_METRICS,
                     plots: bool = True, title: str | None = None) -> dict[str, Any]:
    """table.csv (every column), table.md (the readable columns) and figures."""
    out_dir.mkdir(parents=True, exist_ok=True)
    df = df.copy()
    csv = out_dir / "table.csv"
    df.to_csv(csv, index=False)
    cols = table_columns(df, axes, metrics)
    md = out_dir / "table.md"
    md.write_text(to_markdown(df[[c for c in cols if c != "run_id"]]))
    figures = plot_comparison(df, axes, out_dir, x, figure_metrics, title=title) if plots else []
    return {"csv": csv, "markdown": md, "figures": figures, "columns": cols}


def print_table(console: Any, df: pd.DataFrame, axes: Sequence[str], title: str,
                metrics: Sequence[str] = PRINT_METRICS) -> None:
    """A compact table for the terminal (table.md and table.csv hold every column), never cut
    to the console's width."""
    t = Table(title=title)
    several_hosts = "host" in df.columns and df["host"].nunique() > 1  # the same grid from two hosts
    shown = [c for c in ("point", "trial") if c in df.columns] + list(axes) + ["host"] * several_hosts + \
        ["status"] + [m for m in metrics if m in df.columns]
    for c in shown:
        t.add_column(c, justify="right" if pd.api.types.is_numeric_dtype(df[c]) else "left", no_wrap=True)
    for _, row in df.iterrows():
        cells = [escape(_fmt(row[c])) for c in shown]
        if row.get("status") != "finished":
            cells[shown.index("status")] = f"[red]{escape(_fmt(row.get('status')))}[/red]"
        t.add_row(*cells)
    print_wide(console, t)
    failed = df[df["status"] != "finished"] if "status" in df.columns else df.iloc[0:0]
    for i, (_, row) in enumerate(failed.iterrows()):
        if i == 10:
            console.print(f"... and {len(failed) - 10} more not finished (see table.md)")
            break
        label = ", ".join(f"{a}={_fmt(row[a])}" for a in axes) or str(row.get("run_name"))
        console.print(f"[red]{escape(_fmt(row.get('status')))}[/red] {escape(label)}: "
                      f"{escape(_fmt(row.get('error'))[:120])}", highlight=False)


def print_wide(console: Any, table: Any) -> None:
    """Print a rich table at the width that shows every column whole: on a narrow (or non-tty,
    80-column) console rich would cut headers and cells to `throu…` (a terminal wraps the long
    lines instead). `Console.print(width=)` cannot exceed the console's width, so it is widened
    for this one table."""
    needed = Measurement.get(console, console.options.update(width=100_000), table).maximum
    saved = console.width
    console.width = max(saved, needed)
    try:
        console.print(table)
    finally:
        console.width = saved


# --- from MLflow -----------------------------------------------------------------------------------

def runs_frame(experiments: Sequence[str], tracking_uri: str) -> tuple[pd.DataFrame, list[str]]:
    """One row per result run of the experiments: axes, status, error, metrics, run id."""
    import mlflow  # lazy: ~2 s to import; comparisons from results in hand never need it
    from mlflow.tracking import MlflowClient

    _check_store(tracking_uri)
    client = MlflowClient(tracking_uri)
    ids = {}
    for name in experiments:
        exp = client.get_experiment_by_name(name)
        if exp is None:
            names = sorted(e.name for e in client.search_experiments())
            raise ConfigError(f"unknown experiment {name!r} in {redact(tracking_uri)}; "
                              f"valid choices: {', '.join(names)}")
        ids[exp.experiment_id] = name
    mlflow.set_tracking_uri(tracking_uri)
    raw = mlflow.search_runs(experiment_ids=list(ids), output_format="pandas", max_results=100_000)
    if raw.empty:
        return pd.DataFrame(columns=["status"]), []
    kind = raw.get("tags.testbed.kind", pd.Series([None] * len(raw)))
    raw = raw[~kind.isin(CONTAINER_KINDS)].reset_index(drop=True)
    axes = _axes_of(raw)
    if len(ids) > 1:  # several experiments (e.g. defaults vs tuned): the experiment is an axis
        axes = ["experiment"] + axes
    rows = []
    for _, r in raw.iterrows():
        row: dict[str, Any] = {"experiment": ids.get(r.get("experiment_id"))} if len(ids) > 1 else {}
        trial = r.get("tags.optuna.trial")
        if isinstance(trial, str) and trial:
            row["trial"] = int(trial)
        for a in axes:
            if a == "experiment":
                continue
            v = r.get(f"tags.axis.{a}")
            if not isinstance(v, str):
                v = r.get(f"params.{a}")
                if not isinstance(v, str):
                    v = r.get(f"params.{a}.name")  # a group axis ('policy') from params
            row[a] = typed(v) if isinstance(v, str) else None
        status = str(r.get("status", "")).lower()
        row["status"] = {"finished": "finished", "failed": "failed", "killed": "killed"}.get(status, status)
        if row["status"] == "finished" and r.get("tags.optuna.state") == "FAIL":
            row["status"] = "failed"
        for col in raw.columns:
            if col.startswith("metrics.") and not col.startswith(("metrics.step.", "metrics.best.",
                                                                  "metrics.headline/")):  # copies
                row[col[len("metrics."):]] = r[col]
        err = r.get("tags.error")
        row["error"] = err if isinstance(err, str) else None
        host = r.get("tags.host")
        row["host"] = host if isinstance(host, str) else None  # who ran it (grids of several hosts)
        row["run_name"] = r.get("tags.mlflow.runName")
        row["experiment_id"] = r.get("experiment_id")
        row["run_id"] = r["run_id"]
        rows.append(row)
    df = pd.DataFrame(rows)
    df = df.sort_values("trial").reset_index(drop=True) if "trial" in df.columns else sort_rows(df, axes)
    return df, axes


def _check_store(uri: str) -> None:
    """Refuse a URI MLflow cannot open (one line, not its traceback), and refuse to *create* an
    empty SQLite store (MLflow would, taking ~7 s, then find nothing)."""
    from testbed.tracking.tracker import check_tracking_uri

    check_tracking_uri(uri, key="--tracking-uri")
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.is_file():
            raise ConfigError(f"no tracking database at {path} (--tracking-uri {redact(uri)}); run an experiment first "
                              f"or point --tracking-uri at the store that has the runs")


def _axes_of(raw: pd.DataFrame) -> list[str]:
    """Swept keys from `testbed.axes` tags; else params that differ between runs (a group's
    own keys dropped when its name differs: policy=a,b changes every policy.* param)."""
    tagged: list[str] = []
    if "tags.testbed.axes" in raw.columns:
        for v in raw["tags.testbed.axes"].dropna():
            for a in json.loads(v):
                if a not in tagged:
                    tagged.append(a)
    if tagged:
        return tagged
    varying = []
    for col in raw.columns:
        if not col.startswith("params."):
            continue
        key = col[len("params."):]
        if key.startswith(IGNORED_PARAMS):
            continue
        vals = raw[col].fillna("<absent>")
        if vals.nunique() > 1:
            varying.append(key)
    groups = {k[:-len(".name")] for k in varying if k.endswith(".name")}
    axes = []
    for key in varying:
        head = key.split(".", 1)[0]
        if head in groups:
            if key == f"{head}.name":
                axes.append(head)
            continue
        axes.append(key)
    return axes


def build_report(experiments: Sequence[str], tracking_uri: str, out: Path | None = None, x: str | None = None,
                 metrics: Sequence[str] | None = None, console: Any = None) -> Path:
    """`testbed report`: rebuild table and figures of experiments from the tracking store."""
    df, axes = runs_frame(experiments, tracking_uri)
    if df.empty or "run_id" not in df.columns:
        raise ConfigError(f"experiment(s) {', '.join(experiments)} hold no runs in {redact(tracking_uri)}")
    name = "+".join(experiments)
    out_dir = Path(out) if out else Path("runs") / "report" / _safe(name)
    table_metrics = list(metrics) if metrics else list(TABLE_METRICS)
    fig_metrics = list(metrics) if metrics else list(FIGURE_METRICS)
    for m in table_metrics:
        if m not in df.columns:
            valid = sorted(c for c in df.columns if c not in ("run_id", "run_name", "error", "status", "host",
                                                             "experiment_id", "trial", *axes))
            raise ConfigError(f"unknown metric {m!r}; valid choices: {', '.join(valid)}")
    write_comparison(df, axes, out_dir, x=x, metrics=table_metrics, figure_metrics=fig_metrics)
    (out_dir / "report.json").write_text(json.dumps({"experiments": list(experiments), "tracking_uri": redact(tracking_uri),
                                                     "axes": axes, "runs": len(df)}, indent=2) + "\n")
    if console is not None:
        print_table(console, df, axes, f"{name}: {len(df)} runs",
                    metrics=[m for m in (metrics or PRINT_METRICS)])
    return out_dir
