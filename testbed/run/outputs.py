"""The run directory: everything one experiment leaves behind, for people and for MLflow.

    <output.dir>/<run folder>/
      summary.json        stable keys (engine/core/metrics.SUMMARY_KEYS), deterministic for a seed
      run_info.json       wall time, memory, derived sizes (not deterministic, so kept apart)
      config.yaml         the fully resolved config
      requests.csv        one row per request (TTFT, TPOT, E2EL, status, fail reason)    output.requests (true)
      microbatches.csv    one row per micro-batch (tokens, kind, KV usage, policy tags)  output.microbatches
                          (null: the real engine's runs only; true: the simulator's too)
      trace.json          Chrome/Perfetto trace, one track per stage, link and sampler
                          (output.trace=sampled: a subset of micro-batches; full: every span; off: none)
      timeline.png        the pipeline timeline of 40 consecutive traced micro-batches
      kv_usage.png        KV usage and tokens per micro-batch over time

Sizes: the full trace of `testbed run policy=gllm workload=azure` at the trace's own rate (10,302
micro-batches) is 14 MB and took 1.5-3 s to write; the sampled one keeps the first 256
micro-batches and windows of 64 (one per 1,024 micro-batches, at most 12 written, evenly spread),
~1.2 MB and ~0.1 s. The main job at 1.5 req/s (34,000 micro-batches) writes ~4 MB.

This module imports nothing heavy (no pandas, no matplotlib): `testbed run` pays for what it
writes, not for imports (measured: pandas+matplotlib imports cost ~1.5 s of a 6 s run).
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from engine.base.errors import ConfigError, TestbedError, bad_value
from engine.core.trace import Tracer
from testbed.config.redact import redacted
from testbed.config.spec import check_run_name
from testbed.config.naming import SEP, part, point_name

if TYPE_CHECKING:
    from testbed.run.result import RunResult
    from testbed.config.spec import RunSpec

TRACE_MODES = ("sampled", "full", "off")
SAMPLE_HEAD = 256  # micro-batches traced from the start (warm-up)
SAMPLE_WINDOW = 64  # then this many consecutive micro-batches ...
SAMPLE_PERIOD = 1024  # ... out of every this many
SAMPLE_MAX_WINDOWS = 12  # written: at most this many windows, evenly spread over the run
MAX_PLOT_POINTS = 2000  # points of the KV figure and of MLflow's step series
TIMELINE_MICROBATCHES = 40


class SampledTracer(Tracer):
    """A tracer that keeps the spans of a subset of micro-batches (busy time still counts every
    span, so bubble ratio and utilisation are unchanged): the first SAMPLE_HEAD, then
    SAMPLE_WINDOW consecutive ones out of every SAMPLE_PERIOD. Spans left out by sampling are
    not 'dropped' (the summary's trace_spans_dropped counts only the max_spans cap)."""

    def keeps(self, mb_id: int) -> bool:
        return mb_id < SAMPLE_HEAD or (mb_id - SAMPLE_HEAD) % SAMPLE_PERIOD < SAMPLE_WINDOW

    def written_spans(self) -> list[tuple[str, str, float, float, int]]:
        """The spans to write: the head and at most SAMPLE_MAX_WINDOWS windows evenly spread over
        the run (a 1.5 req/s main job has 34,000 micro-batches: 33 windows, 3.2 MB of trace)."""
        windows = sorted({(s[4] - SAMPLE_HEAD) // SAMPLE_PERIOD for s in self.spans if s[4] >= SAMPLE_HEAD})
        if len(windows) <= SAMPLE_MAX_WINDOWS:
            return self.spans
        n = len(windows)
        keep = {windows[round(i * (n - 1) / (SAMPLE_MAX_WINDOWS - 1))] for i in range(SAMPLE_MAX_WINDOWS)}
        return [s for s in self.spans if s[4] < SAMPLE_HEAD or (s[4] - SAMPLE_HEAD) // SAMPLE_PERIOD in keep]


class BusyOnlyTracer(Tracer):
    """output.trace=off: busy time for the summary, no spans kept (none counted as dropped)."""

    def keeps(self, mb_id: int) -> bool:
        return False


def make_tracer(output: Mapping[str, Any], executor: str = "sim") -> Tracer:
    """The run's tracer for `output.trace` (the `output` config section as a dict). Sampling
    applies to the simulator only: torch engine runs are short, and `testbed profile` reads the
    spans of every micro-batch it launches."""
    trace = output.get("trace", "sampled")
    spans = output.get("max_trace_spans", 200_000)
    if isinstance(spans, bool) or not isinstance(spans, int) or spans < 0:
        raise bad_value("output.max_trace_spans", spans, "must be an integer >= 0")
    if trace not in TRACE_MODES:
        raise bad_value("output.trace", trace, f"valid choices: {', '.join(TRACE_MODES)}")
    if trace == "off":
        return BusyOnlyTracer(max_spans=0)
    return SampledTracer(max_spans=spans) if trace == "sampled" and executor == "sim" else Tracer(max_spans=spans)


# --- names -----------------------------------------------------------------------------------------

NAME_SKIP = ("output.", "data_dir", "check_integrity")


def display_name(spec: RunSpec, overrides: Sequence[str] = ()) -> str:
    """The MLflow run name: what differs first, e.g. `gllm · azure · rate=4 · pp=2`, in the one
    naming style (testbed/config/naming.py). Policy and workload always lead; then the workload's rate
    (online arrivals) and every other override the user gave, as `<last key>=<value>` (group
    choices as the bare choice)."""
    wl = spec.workload
    parts = [spec.policy_name, spec.workload_name]
    seen = {"policy", "workload"}
    rate = getattr(wl, "rate", None)
    if rate is not None and getattr(wl, "arrival", "poisson") != "offline":
        parts.append(part("workload.rate", rate))
        seen.add("workload.rate")
    for ov in overrides:
        key, _, value = ov.partition("=")
        key = key.lstrip("+~")
        if key in seen or key.startswith(NAME_SKIP):
            continue
        seen.add(key)
        parts.append(part(key, value))
    return SEP.join(parts)


axis_name = point_name  # a sweep point's MLflow run name: what varies (`sarathi · rate=0.5`)


def folder_name(spec: RunSpec, who: str | None = None, what: str | None = None) -> str:
    """`output.run_name`, else the one pattern of every command's run folder,
    `<who>_<what>_<UTC time>` (no spaces; sorts by who, then what, then time): who ran (the
    policy; `bench serve`: its --label, since it did not run the server's policy) and on what
    (the workload; `serve`: `serve-<executor>`)."""
    name = spec.output.run_name
    if name:
        return check_run_name(str(name))
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    parts = (who or spec.policy_name, what or spec.workload_name)
    return "_".join(re.sub(r"[^A-Za-z0-9.=+-]+", "-", p) for p in parts) + f"_{stamp}"


run_name = folder_name  # older name, used by callers outside `testbed run`


def prepare_output_dir(path: str | os.PathLike) -> Path:
    """Create `output.dir` (and check it is a writable directory) before any run starts."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise bad_value("output.dir", str(path), "is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise bad_value("output.dir", str(path), f"cannot be created ({exc.strerror or exc})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise bad_value("output.dir", str(path), "is not writable")
    return p


def reserve_run_dir(base: Path, name: str) -> Path:
    """Create and return `base/name`, or `base/name-2`, `-3`, ... if taken: a run never writes
    into an earlier run's folder (mkdir is atomic, so concurrent runs get distinct folders)."""
    for i in range(1, 10_000):
        cand = base / (name if i == 1 else f"{name}-{i}")
        try:
            cand.mkdir()
        except FileExistsError:
            continue
        return cand
    raise ConfigError(f"output.run_name {name!r}: 10,000 folders of that name exist in {base}")


# --- writing ---------------------------------------------------------------------------------------

def _clean(value):
    """JSON has no NaN: write null so every JSON reader accepts summary.json."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class OutputWriteError(TestbedError):
    """The run folder could not be written (a full disk, a quota, a read-only mount)."""


@contextlib.contextmanager
def _atomic_open(path: Path):
    """Write `path` whole or not at all: into `<name>.part`, renamed over `path` once complete, so a
    full disk never leaves a truncated file behind (the partial one is removed)."""
    part = path.with_name(path.name + ".part")
    try:
        with part.open("w", newline="") as fh:
            yield fh
        os.replace(part, path)
    except BaseException as exc:
        part.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write() names no file
            exc.filename = str(path)
        raise


def _write_text(path: Path, text: str) -> None:
    with _atomic_open(path) as fh:
        fh.write(text)


def write_csv(rows: list[dict], path: Path, float_digits: int | None = None) -> None:
    """Rows as CSV (columns in first-seen order; NaN and None as empty cells, as pandas writes).
    `float_digits` rounds floats to that many significant digits (default: exact repr)."""
    cols: dict[str, None] = {}
    for r in rows:
        for k in r:
            cols.setdefault(k, None)
    with _atomic_open(path) as fh:
        w = csv.writer(fh, lineterminator="\n")  # as pandas writes: the same bytes as earlier versions
        w.writerow(cols)
        keys = list(cols)
        for r in rows:
            w.writerow([_cell(v, float_digits) for v in (r.get(k) for k in keys)])


def _cell(v, digits: int | None):
    if v is None:
        return ""
    if isinstance(v, float):
        if math.isnan(v):
            return ""
        return f"{v:.{digits}g}" if digits else v
    return v


def write_run_dir(result: RunResult, out_dir: Path, plots: bool = True, trace: str | None = None) -> Path:
    """Write the run folder (each file whole or not at all). `trace` defaults to the run's
    `output.trace` (sampled). A file that cannot be written raises OutputWriteError naming it."""
    try:
        _write_files(result, out_dir, trace)
    except OSError as exc:
        where = exc.filename or out_dir
        raise OutputWriteError(f"cannot write the run folder {out_dir}: {exc.strerror or exc} ({where}); "
                               f"free space there or choose another output.dir") from None
    if plots:
        from testbed.run.plots import render_plots

        render_plots(plot_data(result), out_dir)
    return out_dir


def _write_files(result: RunResult, out_dir: Path, trace: str | None) -> None:
    from omegaconf import OmegaConf

    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {k: _clean(v) for k, v in result.summary.items()}
    hardware = result.spec.settings.hardware
    # which cost profile priced the run (docs/calibration.md#measured-kernels): name and version
    summary |= {"hardware_profile": getattr(hardware, "name", None), "hardware_version": getattr(hardware, "version", None)}
    if "server" in result.info:  # `bench serve`: the server's hardware, not the client's config default
        summary |= {"hardware_profile": result.info["server"]["hardware"],
                    "hardware_version": result.info["server"]["hardware_version"]}
    _write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    info = redacted(dict(result.info))
    info["error"] = result.error
    _write_text(out_dir / "run_info.json", json.dumps(info, indent=2, default=str) + "\n")
    _write_text(out_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(redacted(result.spec.tree()))))
    if result.spec.output.requests:  # off by default for sweep points (testbed/sweep/jobs.point_budget)
        write_csv(result.requests, out_dir / "requests.csv")
    if keeps_microbatches(result.spec):
        write_csv(result.microbatches, out_dir / "microbatches.csv")  # exact: byte-comparable across versions
    if result.breakdown is not None:  # where each stage's time went (engine/core/breakdown.py)
        _write_text(out_dir / "breakdown.json", json.dumps(result.breakdown, indent=2) + "\n")
    mode = trace or result.spec.output.trace
    if mode != "off":
        write_trace(result, out_dir / "trace.json")


def update_run_info(run_dir: Path, **values: Any) -> None:
    """Add `values` to run_info.json (the end-to-end time, known only once the files are written)."""
    path = run_dir / "run_info.json"
    info = json.loads(path.read_text())
    info.update(values)
    _write_text(path, json.dumps(info, indent=2, default=str) + "\n")


def keeps_microbatches(spec: RunSpec) -> bool:
    """`output.microbatches`, by default true for the real engine's runs (what `calibrate runs` and
    `validate --runs` read; short runs) and false for the simulator's: the main job's file was 5.2
    MB of its 6.8 MB folder, and the README tour's runs/ 476 MB with every probe's (issue 49 item 3).
    A sweep point without `output.requests` keeps none unless asked."""
    out = spec.output
    if out.microbatches is not None:
        return bool(out.microbatches)
    return out.requests and spec.settings.executor.name != "sim"


def trace_tracks(result: RunResult) -> list[str]:
    return result.stage_tracks + sorted({s[0] for s in result.tracer.spans} - set(result.stage_tracks),
                                        key=_natural)


def write_trace(result: RunResult, path: Path) -> None:
    """Chrome/Perfetto JSON (the format of engine/core/trace.Tracer.write_chrome_trace), streamed line by
    line instead of built as one list of dicts: 3x faster and without a second copy in memory."""
    tracer = result.tracer
    tids = {t: i for i, t in enumerate(trace_tracks(result))}
    with _atomic_open(path) as fh:
        fh.write('{"traceEvents": [\n')
        first = True
        for t, tid in tids.items():
            name = json.dumps(t)
            fh.write(('' if first else ',\n') + f'{{"ph": "M", "name": "thread_name", "pid": 0, "tid": {tid}, '
                     f'"args": {{"name": {name}}}}},\n{{"ph": "M", "name": "thread_sort_index", "pid": 0, '
                     f'"tid": {tid}, "args": {{"sort_index": {tid}}}}}')
            first = False
        names: dict[str, str] = {}
        spans = tracer.written_spans() if isinstance(tracer, SampledTracer) else tracer.spans
        for track, name, start, end, mb_id in spans:
            tid = tids.setdefault(track, len(tids))
            jn = names.get(name) or names.setdefault(name, json.dumps(name))
            fh.write(('' if first else ',\n') + f'{{"ph": "X", "name": {jn}, "pid": 0, "tid": {tid}, '
                     f'"ts": {round(start * 1e6, 3)!r}, "dur": {round((end - start) * 1e6, 3)!r}, '
                     f'"args": {{"mb": {int(mb_id)}}}}}')
            first = False
        fh.write(f'\n], "displayTimeUnit": "ms", "otherData": {{"dropped_spans": {tracer.dropped}}}}}\n')


def plot_data(result: RunResult) -> dict:
    """What the two figures need, small and JSON-safe (it is sent to the background process
    that renders them): the spans of TIMELINE_MICROBATCHES consecutive traced micro-batches from
    the middle of the trace (steady state, not warm-up) and at most MAX_PLOT_POINTS KV samples."""
    spans = result.tracer.spans
    traced = sorted({s[4] for s in spans if s[4] >= 0})
    window: list[int] = []
    if traced:
        mid = len(traced) // 2
        lo = max(0, mid - TIMELINE_MICROBATCHES // 2)
        window = traced[lo:lo + TIMELINE_MICROBATCHES]
        # keep one consecutive run of ids (sampled traces have gaps between windows)
        for i in range(1, len(window)):
            if window[i] != window[i - 1] + 1:
                window = window[:i] if i >= len(window) - i else window[i:]
                break
    keep = set(window)
    tl = [[s[0], s[1], s[2], s[3]] for s in spans if s[4] in keep and s[1] != "wait"]
    mbs = result.microbatches
    stride = max(1, math.ceil(len(mbs) / MAX_PLOT_POINTS))
    sample = mbs[::stride]
    return {"title": f"{result.info.get('policy', '')}, {result.info.get('executor', '')}",
            "stage_tracks": list(result.stage_tracks),
            "timeline": {"first": window[0] if window else 0, "last": window[-1] if window else 0, "spans": tl},
            "kv": {"t": [m["scheduled_s"] for m in sample], "kv_usage": [m["kv_usage"] for m in sample],
                   "num_tokens": [m["num_tokens"] for m in sample]},
            "breakdown": result.breakdown}


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
