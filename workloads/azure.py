"""Azure LLM inference traces (2023): real arrival times and real prompt/output lengths.

The trace carries timestamps and token counts only (no text). Selection happens in this order:
rows at or after `start_s` seconds into the trace, then the length filters, then the first
`num_requests` of what is left (None = all). Arrivals are the kept rows' timestamps minus the
first kept one's, so the first request arrives at 0. With `rate` set, all gaps are scaled by one
factor so that the mean rate, (n-1) gaps over the span, equals `rate`: the burst structure of
the trace is kept, only its speed changes.

Rows with ContextTokens == 0 or GeneratedTokens == 0 (none in the 2023 files) are dropped, not
clamped: a request needs at least one prompt and one output token, and inventing a token would
change the trace. `seed` is not used (the trace is deterministic); it exists so every workload
has the same keys for the tuner and run records.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ConfigError, TestbedError, bad_value
from engine.request import Request
from engine.typed import setting
from workloads.arrivals import MAX_RATE
from workloads.base import WORKLOADS, WorkloadSpec, check_range, check_types, key, make_requests
from workloads.data import resolve_data_file

TRACE_FILES = {"conv": "azure/AzureLLMInferenceTrace_conv.csv", "code": "azure/AzureLLMInferenceTrace_code.csv"}


@dataclass(frozen=True)
class AzureConfig:
    name: str = "azure"
    trace: str = setting("conv", choices=tuple(TRACE_FILES))
    path: str | None = None  # explicit CSV path; None = resolve via workloads.data
    num_requests: int | None = setting(2000, min=1)  # None = every row that passes the filters
    start_s: float = setting(0.0, min=0)  # offset into the trace, seconds after its first row
    rate: float | None = setting(None, gt=0, max=MAX_RATE)  # None = real timestamps; else rescale to this mean req/s
    min_input_len: int = 1
    max_input_len: int | None = None
    min_output_len: int = 1
    max_output_len: int | None = None
    seed: int = setting(0, min=0)  # unused: the trace is deterministic

    def __post_init__(self) -> None:
        check_types(self)
        check_range("min_input_len", self.min_input_len, "max_input_len", self.max_input_len)
        check_range("min_output_len", self.min_output_len, "max_output_len", self.max_output_len)


TOKEN_COLUMNS = ("ContextTokens", "GeneratedTokens")


@functools.lru_cache(maxsize=4)
def _load_trace(path: str, mtime_ns: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(timestamps in ns, ContextTokens, GeneratedTokens), sorted by time; cached per file version.

    Every row must parse: a bad timestamp or a token count that is blank, non-numeric, fractional
    or negative is an error naming the file, the line and the value (never dropped or truncated)."""
    import pandas as pd  # here, not at module level: `import workloads` stays fast for the CLI

    try:  # read as text so that no value is converted (or silently truncated) before it is checked
        df = pd.read_csv(path, dtype=str, keep_default_na=False)  # a row with extra fields is an error too
    except (ValueError, UnicodeDecodeError) as exc:  # ParserError (names the line), EmptyDataError
        raise TestbedError(f"cannot read Azure trace {path}: {_one_line(exc)}") from exc
    missing = [c for c in ("TIMESTAMP", *TOKEN_COLUMNS) if c not in df.columns]
    if missing:
        raise TestbedError(f"Azure trace {path} has no column(s) {', '.join(missing)}; "
                           f"its header is {', '.join(map(str, df.columns))}")
    ts = pd.to_datetime(df["TIMESTAMP"], format="%Y-%m-%d %H:%M:%S.%f", errors="coerce")  # 7 digits -> ns exact
    _first_bad(path, "TIMESTAMP", df["TIMESTAMP"], ts.isna().to_numpy(), "a time like 2023-11-16 18:15:46.6805900")
    cols = [_token_column(path, df, c) for c in TOKEN_COLUMNS]
    t_ns = ts.to_numpy(dtype="datetime64[ns]").astype(np.int64)
    order = np.argsort(t_ns, kind="stable")
    arrays = (t_ns[order], cols[0][order], cols[1][order])
    for a in arrays:
        a.setflags(write=False)
    return arrays


def _token_column(path: str, df, column: str) -> np.ndarray:
    import pandas as pd

    raw = df[column]
    num = pd.to_numeric(raw.str.strip(), errors="coerce").to_numpy(dtype=float)
    bad = ~np.isfinite(num) | (num < 0) | (num != np.floor(num)) | (num > np.iinfo(np.int64).max / 2)
    _first_bad(path, column, raw, bad, "a whole number >= 0")
    return num.astype(np.int64)


def _first_bad(path: str, column: str, raw, bad: np.ndarray, expected: str) -> None:
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TestbedError(f"Azure trace {path} line {i + 2}: invalid {column}={raw.iloc[i]!r}: must be {expected}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_trace(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    st = path.stat()
    return _load_trace(str(path), st.st_mtime_ns, st.st_size)


def build_azure(cfg: AzureConfig, data_dir: str | None = None) -> list[Request]:
    path = resolve_data_file(TRACE_FILES[cfg.trace], cfg.path, data_dir)
    t_ns, ctx, gen = load_trace(path)
    if len(t_ns) == 0:
        raise TestbedError(f"Azure trace {path} has no rows")
    duration_s = (t_ns[-1] - t_ns[0]) / 1e9
    if cfg.start_s > duration_s:
        raise bad_value(key("start_s"), cfg.start_s, f"the {cfg.trace} trace is only {duration_s:.1f} s long")

    keep = (ctx > 0) & (gen > 0)  # see module docstring: dropped, never clamped
    keep &= t_ns >= t_ns[0] + round(cfg.start_s * 1e9)
    keep &= (ctx >= cfg.min_input_len) & (gen >= cfg.min_output_len)
    if cfg.max_input_len is not None:
        keep &= ctx <= cfg.max_input_len
    if cfg.max_output_len is not None:
        keep &= gen <= cfg.max_output_len
    idx = np.flatnonzero(keep)
    if len(idx) == 0:
        raise ConfigError(f"no rows of {path.name} pass workload.start_s and the length filters")
    if cfg.num_requests is not None:
        if cfg.num_requests > len(idx):
            raise bad_value(key("num_requests"), cfg.num_requests,
                            f"only {len(idx)} rows of {path.name} remain after start_s and the length filters")
        idx = idx[:cfg.num_requests]

    arrivals = (t_ns[idx] - t_ns[idx[0]]) / 1e9
    if cfg.rate is not None and len(idx) > 1:
        span = arrivals[-1]
        if span <= 0:
            raise ConfigError(f"cannot rescale to workload.rate={cfg.rate}: the {len(idx)} kept requests "
                              f"all share one timestamp")
        arrivals = arrivals * ((len(idx) - 1) / (span * cfg.rate))
    return make_requests(arrivals, ctx[idx], gen[idx])


WORKLOADS.add("azure", WorkloadSpec(AzureConfig, build_azure))
