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

import csv
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.base.errors import ConfigError, TestbedError, bad_value
from engine.core.request import Request
from engine.base.typed import setting
from workloads.arrivals import MAX_RATE, MIN_RATE
from workloads.base import MAX_TOKENS, WORKLOADS, WorkloadSpec, check_range, check_types, key, make_requests
from workloads.data import resolve_data_file

TRACE_FILES = {"conv": "azure/AzureLLMInferenceTrace_conv.csv", "code": "azure/AzureLLMInferenceTrace_code.csv"}


@dataclass(frozen=True)
class AzureConfig:
    name: str = "azure"
    trace: str = setting("conv", choices=tuple(TRACE_FILES))
    path: str | None = None  # explicit CSV path; None = resolve via workloads.data
    num_requests: int | None = setting(2000, min=1)  # None = every row that passes the filters
    start_s: float = setting(0.0, min=0)  # offset into the trace, seconds after its first row
    rate: float | None = setting(None, min=MIN_RATE, max=MAX_RATE)  # None = real timestamps; else rescale to this mean req/s
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


MIN_YEAR, MAX_YEAR = 1678, 2261  # whole years inside datetime64[ns]'s range (1677-09-21 to 2262-04-11)
TIMESTAMP_FORMAT = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{1,9}")  # 2023-11-16 18:15:46.6805900


@functools.lru_cache(maxsize=4)
def _load_trace(path: str, mtime_ns: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(timestamps in ns, ContextTokens, GeneratedTokens), sorted by time; cached per file version.

    Every row must parse: a bad timestamp or a token count that is blank, non-numeric, fractional
    or negative is an error naming the file, the line and the value (never dropped or truncated).
    Read with the csv module and numpy, not pandas: importing pandas alone took 0.86 s of the
    main job's 2.7 s outside the simulation."""
    header, rows, lines = _read_csv(path)
    missing = [c for c in ("TIMESTAMP", *TOKEN_COLUMNS) if c not in header]
    if missing:
        raise TestbedError(f"Azure trace {path} has no column(s) {', '.join(missing)}; "
                           f"its header is {', '.join(header)}")
    stamps = [row[header.index("TIMESTAMP")] for row in rows]
    for line, text in zip(lines, stamps):
        if not TIMESTAMP_FORMAT.fullmatch(text):
            _bad(path, line, "TIMESTAMP", text, "a time like 2023-11-16 18:15:46.6805900")
        if not MIN_YEAR <= int(text[:4]) <= MAX_YEAR:  # numpy's nanoseconds would wrap around silently
            _bad(path, line, "TIMESTAMP", text, f"a time in the years {MIN_YEAR}-{MAX_YEAR}")
    try:
        t_ns = np.array(stamps, dtype="datetime64[ns]").astype(np.int64)  # 7 digits -> ns exact
    except ValueError:  # right shape, impossible date (month 13): find the row
        for line, text in zip(lines, stamps):
            try:
                np.datetime64(text, "ns")
            except ValueError:
                _bad(path, line, "TIMESTAMP", text, "a time like 2023-11-16 18:15:46.6805900")
        raise
    cols = [_token_column(path, lines, [row[header.index(c)] for row in rows], c) for c in TOKEN_COLUMNS]
    order = np.argsort(t_ns, kind="stable")
    arrays = (t_ns[order], cols[0][order], cols[1][order])
    for a in arrays:
        a.setflags(write=False)
    return arrays


def _read_csv(path: str) -> tuple[list[str], list[list[str]], list[int]]:
    """(header, rows as text, each row's line number); blank lines skipped, a short row padded with
    blanks (reported by the column checks), a row with extra fields an error."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise TestbedError(f"cannot read Azure trace {path}: no header line")
            rows, lines = [], []
            for row in reader:
                if not row:
                    continue
                if len(row) > len(header):
                    raise TestbedError(f"cannot read Azure trace {path}: line {reader.line_num} has "
                                       f"{len(row)} fields, the header {len(header)}")
                rows.append(row + [""] * (len(header) - len(row)))
                lines.append(reader.line_num)
    except (UnicodeDecodeError, csv.Error) as exc:
        raise TestbedError(f"cannot read Azure trace {path}: {_one_line(exc)}") from exc
    return header, rows, lines


def _token_column(path: str, lines: list[int], raw: list[str], column: str) -> np.ndarray:
    out = np.empty(len(raw), dtype=np.int64)
    for i, (line, text) in enumerate(zip(lines, raw)):
        value = _whole_number(text.strip())
        if value is None:
            _bad(path, line, column, text, f"a whole number in [0, {MAX_TOKENS}]")
        out[i] = value
    return out


def _whole_number(text: str) -> int | None:
    """`text` as an int >= 0 when it is one ("12", "12.0", "1.2e3"); None for blanks, words,
    fractions, negatives, infinities and counts past MAX_TOKENS."""
    if text.isascii() and text.isdigit():
        value = int(text)
    else:
        try:
            number = float(text)
        except ValueError:
            return None
        if not number.is_integer():  # also NaN and infinities
            return None
        value = int(number)
    return value if 0 <= value <= MAX_TOKENS else None


def _bad(path: str, line: int, column: str, value: str, expected: str) -> None:
    raise TestbedError(f"Azure trace {path} line {line}: invalid {column}={value!r}: must be {expected}")


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
