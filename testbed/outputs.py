"""The run directory: everything one experiment leaves behind, for people and for MLflow.

    <output.dir>/<run name>/
      summary.json        stable keys (engine/metrics.SUMMARY_KEYS), deterministic for a seed
      run_info.json       wall time, memory, derived sizes (not deterministic, so kept apart)
      config.yaml         the fully resolved config
      requests.csv        one row per request (TTFT, TPOT, E2EL, status, fail reason)
      microbatches.csv    one row per micro-batch (tokens, kind, KV usage, policy tags)
      trace.json          Chrome/Perfetto trace, one track per stage, link and sampler
      timeline.png        the pipeline timeline of the first micro-batches
      kv_usage.png        KV usage and running sequences over time
"""
from __future__ import annotations

import json
import math
import re
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
from omegaconf import OmegaConf

from testbed.runner import RunResult


def run_name(cfg: dict) -> str:
    name = (cfg.get("output") or {}).get("run_name")
    if name:
        return str(name)
    pol = cfg["policy"]["name"]
    wl = cfg["workload"]["name"]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
    return f"{stamp}_{pol}_{wl}"


def _clean(value):
    """JSON has no NaN: write null so every JSON reader accepts summary.json."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_run_dir(result: RunResult, out_dir: Path, plots: bool = True) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {k: _clean(v) for k, v in result.summary.items()}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    info = dict(result.info)
    info["error"] = result.error
    (out_dir / "run_info.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(result.config)))
    pd.DataFrame(result.requests).to_csv(out_dir / "requests.csv", index=False)
    pd.DataFrame(result.microbatches).to_csv(out_dir / "microbatches.csv", index=False)
    tracks = result.stage_tracks + sorted({s[0] for s in result.tracer.spans} - set(result.stage_tracks),
                                          key=_natural)
    result.tracer.write_chrome_trace(out_dir / "trace.json", tracks)
    if plots:
        from testbed.plots import plot_kv_usage, plot_timeline

        plot_timeline(result, out_dir / "timeline.png")
        plot_kv_usage(result, out_dir / "kv_usage.png")
    return out_dir


def _natural(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
