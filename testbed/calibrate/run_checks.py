"""What a real run's folder must hold before `calibrate runs` or `validate --runs` trusts it (issue 48
item 2): each file checked for shape, types and physical ranges, one `error:` line naming the file
and its row. The probes found 8 tracebacks (negative or NaN span durations, a cut or header-only
`microbatches.csv`, a `prompt_len` of 1e15 that ran out of memory) and silent fits of nonsense:
`completed_s=1e300` gave a profile with `return_fixed_s = 1.25e297`, exit 0.

A real run is recognised by what only the torch engine writes: the sampled token ids of its finished
requests (`requests.csv`'s `output_token_ids`; the simulator samples none). A simulated run whose
config was edited to say `executor: torch` was fitted as real.

The config is checked against the run's own files: the request count of `summary.json` and
`requests.csv`, the micro-batch count, and (when `run_info.json` is there) the KV block size.
Called from `runs.load_run` and `runs.read_spans` (small hooks, so the loaders stay as they are)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from engine.base.errors import ConfigError

MAX_SECONDS = 1e7  # ~116 days: no run's clock goes further; 1e300 did and was fitted
MAX_TOKENS = 2_000_000  # per request or micro-batch: above any model's context (1e15 ran out of memory)
MB_COLUMNS = {"mb_id": "int", "scheduled_s": "time", "completed_s": "time", "kind": "kind",
              "num_prefill_tokens": "count", "num_decode_seqs": "count", "num_tokens": "count", "num_seqs": "count"}
REQ_COLUMNS = {"request_id": "int", "arrival_s": "time", "prompt_len": "length", "output_len": "count"}
KINDS = ("prefill", "decode", "mixed")
PACKED_MARKER = ".packed-real-run"  # written by manifest.unpacked into each run of a measurements/ archive


def _show(value: Any) -> str:
    """A cell as written in the file (numpy scalars as plain numbers)."""
    return repr(value.item() if hasattr(value, "item") else value)


def _bad(path: Path, row: int | None, what: str) -> ConfigError:
    where = f"{path}" if row is None else f"{path} row {row + 1}"  # rows as a spreadsheet counts them, header = 0
    return ConfigError(f"{where}: {what}")


def check_table(path: Path, df: pd.DataFrame, columns: Mapping[str, str]) -> None:
    """Columns present, at least one row, each value of its type and physical range."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise _bad(path, None, f"lacks column(s) {', '.join(missing)}; a run's file has {', '.join(columns)}")
    if df.empty:
        raise _bad(path, None, "has no rows: the run wrote nothing, or the file was cut")
    for col, kind in columns.items():
        _check_column(path, df[col], col, kind)


def _check_column(path: Path, values: pd.Series, col: str, kind: str) -> None:
    if kind == "kind":
        bad = ~values.isin(KINDS)
        if bad.any():
            i = int(bad.to_numpy().argmax())
            raise _bad(path, i, f"{col}={_show(values.iloc[i])}; valid: {', '.join(KINDS)}")
        return
    num = pd.to_numeric(values, errors="coerce")
    hi = MAX_SECONDS if kind == "time" else MAX_TOKENS if kind in ("count", "length") else 2**53
    lo = 1 if kind == "length" else 0
    ok = num.notna() & num.map(lambda v: math.isfinite(v) if isinstance(v, float) else True) & (num >= lo) & (num <= hi)
    if kind != "time":
        ok &= num.fillna(0.5) % 1 == 0
    if not ok.all():
        i = int((~ok).to_numpy().argmax())
        what = "seconds" if kind == "time" else "a whole number"
        raise _bad(path, i, f"{col}={_show(values.iloc[i])} is not {what} in [{lo}, {hi:g}]")


def check_microbatches(path: Path, mbs: pd.DataFrame) -> None:
    check_table(path, mbs, MB_COLUMNS)
    early = mbs["completed_s"] < mbs["scheduled_s"]
    if early.any():
        i = int(early.to_numpy().argmax())
        raise _bad(path, i, f"completed_s={_show(mbs['completed_s'].iloc[i])} is before its scheduled_s="
                            f"{_show(mbs['scheduled_s'].iloc[i])}")
    dup = mbs["mb_id"].duplicated()
    if dup.any():
        i = int(dup.to_numpy().argmax())
        raise _bad(path, i, f"mb_id={_show(mbs['mb_id'].iloc[i])} appears twice")


def check_requests(path: Path, reqs: pd.DataFrame) -> None:
    check_table(path, reqs, REQ_COLUMNS)
    dup = reqs["request_id"].duplicated()
    if dup.any():
        i = int(dup.to_numpy().argmax())
        raise _bad(path, i, f"request_id={_show(reqs['request_id'].iloc[i])} appears twice")


def check_real(path: Path, reqs: pd.DataFrame) -> None:
    """The run sampled tokens: only the torch engine does (see the module's docstring)."""
    if (path / PACKED_MARKER).is_file():  # unpacked from measurements/: ids dropped by the packer
        return
    ids = reqs["output_token_ids"] if "output_token_ids" in reqs.columns else pd.Series(dtype=object)
    if not ids.fillna("").astype(str).str.strip().ne("").any():
        raise ConfigError(f"run {path} has no sampled token ids in requests.csv (output_token_ids): it was not "
                          f"run by the torch engine (its config.yaml says executor=torch, but a simulated run "
                          f"samples no tokens); calibrate from real runs (testbed run executor=torch)")


def check_summary(path: Path, summary: Any, reqs: pd.DataFrame, mbs: pd.DataFrame) -> None:
    """summary.json is an object whose counts are those of the run's tables."""
    if not isinstance(summary, dict):
        raise _bad(path / "summary.json", None, f"is a JSON {type(summary).__name__}, not an object")
    for key, n, file in (("num_requests", len(reqs), "requests.csv"), ("num_microbatches", len(mbs), "microbatches.csv")):
        said = summary.get(key)
        if said is not None and said != n:
            raise _bad(path / "summary.json", None, f"{key}={said!r} but {file} has {n} rows: the files are of "
                                                    f"different runs, or one was edited")


def check_config(path: Path, tree: Any, spec: Any, reqs: pd.DataFrame) -> None:
    """config.yaml: an object of known sections that agrees with the run's own files."""
    if not isinstance(tree, dict):
        raise _bad(path / "config.yaml", None, f"is a YAML {type(tree).__name__}, not a config")
    unknown = sorted(set(tree) - set(known_sections()))
    if unknown:
        raise _bad(path / "config.yaml", None, f"unknown key(s) {', '.join(map(str, unknown))}; valid keys: "
                                               f"{', '.join(known_sections())}")
    said = (tree.get("workload") or {}).get("num_requests") if isinstance(tree.get("workload"), dict) else None
    if isinstance(said, int) and said != len(reqs):
        raise _bad(path / "config.yaml", None, f"workload.num_requests={said} but requests.csv has {len(reqs)} "
                                               f"requests: the config is not this run's")
    info = run_info(path)
    block = info.get("kv_block_size")
    if isinstance(block, int) and block != spec.settings.kv.block_size:
        raise _bad(path / "config.yaml", None, f"kv.block_size={spec.settings.kv.block_size} but run_info.json "
                                               f"says the run used {block}: the config is not this run's")


def run_info(path: Path) -> dict:
    """A run folder's run_info.json as a dict ({} where it is missing, unreadable or not an object)."""
    import json

    try:
        info = json.loads((path / "run_info.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


_SECTIONS: tuple[str, ...] = ()


def known_sections() -> tuple[str, ...]:
    """The top-level keys a composed config has (read once from a composed default)."""
    global _SECTIONS
    if not _SECTIONS:
        from testbed.config.spec import compose_spec

        _SECTIONS = tuple(compose_spec(["policy=sarathi", "workload=synthetic"]).tree())
    return _SECTIONS


def check_span(path: Path, index: int, event: Any) -> tuple[int, str, float, float] | None:
    """One trace event as (mb, name, start s, duration s), checked; None when it is not a span."""
    if not isinstance(event, dict) or event.get("ph") != "X":
        return None
    try:
        mb, ts, dur = int(event["args"]["mb"]), float(event["ts"]), float(event["dur"])
        name = str(event["name"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{path} event {index}: a span without a numeric mb, ts and dur") from None
    if not (math.isfinite(ts) and math.isfinite(dur) and 0 <= dur <= MAX_SECONDS * 1e6 and abs(ts) <= MAX_SECONDS * 1e6):
        raise ConfigError(f"{path} event {index}: span {name!r} of micro-batch {mb} has ts={ts!r}, dur={dur!r} "
                          f"(microseconds, finite, dur >= 0)")
    return mb, name, ts, dur


def distinct_runs(paths: Sequence[str | Path]) -> None:
    """The same run given twice would be fitted (or averaged) twice: refused."""
    seen: dict[Path, str] = {}
    for p in paths:
        key = Path(p).resolve()
        if key in seen:
            raise ConfigError(f"run directory {p} is given twice (also as {seen[key]}); name each run once")
        seen[key] = str(p)


def read_table(path: str | Path):
    """A profile table (`--table`, `--profile`), or one `error:` line for a file that is not one
    (a non-UTF-8 file was a UnicodeDecodeError traceback)."""
    from engine.pricing.profile_table import read_profile

    try:
        return read_profile(path)
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError, pd.errors.ParserError) as exc:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot read profile table {path}: {text[:300]}") from None
