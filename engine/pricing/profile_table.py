"""Profile tables: measured stage, operator and transfer times, read and written as CSV.

Profile table (CSV, `#` lines are comments; `# key=value` comments before the header are the
table's metadata: model, pp, layers, hardware, source). One row per measurement (or per median
of repetitions):

    op,stage,kind,batch,tokens,prefix,context,nbytes,time_s

- op=forward: stage forward time (the cost model's `stage_compute_s`, lm_head included on the
  last stage, sampling excluded). `stage` is 0-based, or `max` for the slowest stage (what
  TD-Pipe's tables hold). kind=prefill: `batch` prompts, each a chunk of `tokens` tokens after
  `prefix` cached tokens, each sampling; kind=decode: `batch` decodes each attending `context`
  tokens (the new one included); kind=mixed: one chunk of `tokens` after `prefix` (sampling) with
  `batch` decodes at `context` (the designs: engine/pricing/profile_grid.py).
- op=prepare: CPU input preparation of the batch described as above (`prep_s`).
- op=sample: sampling on the last stage (`sample_s`).
- op=transfer: one stage-to-stage hop of `nbytes` bytes (latency + nbytes / bandwidth).

Torch-free and in engine/ because the torch engine's profiler writes these rows
(engine/torch_exec/driver/profile.py); fitting them is `testbed profile`'s business
(testbed/calibrate/fit.py).
"""
from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine.pricing.costmodel import BatchShape
from engine.base.errors import ConfigError

COLUMNS = ("op", "stage", "kind", "batch", "tokens", "prefix", "context", "nbytes", "time_s")
# Optional columns of operator-level rows (testbed/calibrate/gpu_tables.py, testbed/calibrate/kernel_fit.py): the
# tensor-parallel degree of the measurement and the link a collective ran on.
EXTRA_COLUMNS = ("tp", "link")
# Operator-level rows: one kernel of one decoder layer on one GPU (tokens = M), attention calls
# (attn_decode: batch x context; attn_prefill: a chunk of tokens after prefix; kv_write: storing the
# K/V of `tokens` new tokens in the paged cache), NCCL collectives by nbytes, and the host's
# per-iteration scheduling.
TOKEN_OPS = ("gemm_qkv", "gemm_o", "gemm_up", "gemm_down", "norm", "rope", "act", "add", "emb")
ATTENTION_OPS = ("attn_decode", "attn_prefill", "kv_write")
OPERATOR_OPS = TOKEN_OPS + ATTENTION_OPS + ("send_recv", "all_reduce", "schedule")
OPS = ("forward", "prepare", "sample", "transfer") + OPERATOR_OPS
KINDS = ("prefill", "decode", "mixed", "")
@dataclass(frozen=True)
class ProfileRow:
    op: str
    stage: int | None  # None = the slowest stage ("max")
    kind: str = ""
    batch: int = 0
    tokens: int = 0
    prefix: int = 0
    context: int = 0
    nbytes: int = 0
    time_s: float = 0.0
    tp: int = 1
    link: str = ""

    def shape(self) -> BatchShape:
        if self.kind == "prefill":
            return BatchShape.from_parts([(self.prefix, self.tokens, True)] * self.batch)
        if self.kind == "decode":
            return BatchShape.decode(self.batch, self.context)
        if self.kind == "mixed":
            return BatchShape.from_parts([(self.prefix, self.tokens, True)], [self.context] * self.batch)
        raise ValueError(f"no batch shape for kind {self.kind!r}")


@dataclass
class ProfileTable:
    rows: list[ProfileRow]
    meta: dict[str, str] = field(default_factory=dict)

    def select(self, op: str) -> list[ProfileRow]:
        return [r for r in self.rows if r.op == op]


def _int(value: str, name: str, where: str, minimum: int = 0) -> int:
    try:
        v = int(value)
    except ValueError:
        raise ConfigError(f"{where}: column {name}={value!r} is not an integer") from None
    if v < minimum:
        raise ConfigError(f"{where}: column {name}={v} must be >= {minimum}")
    return v


def _check_row(row: ProfileRow, where: str) -> None:
    if row.op in TOKEN_OPS and row.tokens < 1:
        raise ConfigError(f"{where}: op={row.op} needs tokens >= 1")
    if row.op == "attn_decode" and (row.batch < 1 or row.context < 1):
        raise ConfigError(f"{where}: op=attn_decode needs batch >= 1 and context >= 1")
    if row.op in ("attn_prefill", "kv_write") and row.tokens < 1:
        raise ConfigError(f"{where}: op={row.op} needs tokens >= 1")
    if row.op in ("send_recv", "all_reduce") and row.nbytes < 1:
        raise ConfigError(f"{where}: op={row.op} needs nbytes >= 1")
    if row.tp < 1:
        raise ConfigError(f"{where}: tp must be >= 1")
    if row.op in ("forward", "prepare", "sample", "schedule"):
        if row.kind not in ("prefill", "decode", "mixed"):
            raise ConfigError(f"{where}: op={row.op} needs kind=prefill, decode or mixed, got {row.kind!r}")
        if row.batch < 1:
            raise ConfigError(f"{where}: batch must be >= 1")
        if row.kind in ("prefill", "mixed") and row.tokens < 1:
            raise ConfigError(f"{where}: a {row.kind} row needs tokens >= 1")
        if row.kind in ("decode", "mixed") and row.context < 1:
            raise ConfigError(f"{where}: a {row.kind} row needs context >= 1")
    if not (math.isfinite(row.time_s) and row.time_s > 0):
        raise ConfigError(f"{where}: time_s={row.time_s!r} must be a positive number of seconds")


def read_profile(path: str | Path) -> ProfileTable:
    """Read a profile table; any malformed line raises ConfigError naming `file line N`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    return parse_profile(text, path.name)


def parse_profile(text: str, name: str = "profile") -> ProfileTable:
    meta: dict[str, str] = {}
    rows: list[ProfileRow] = []
    header: list[str] | None = None
    for lineno, line in enumerate(text.splitlines(), 1):
        where = f"{name} line {lineno}"
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            body = stripped[1:].strip()
            if header is None and "=" in body:
                k, _, v = body.partition("=")
                meta[k.strip()] = v.strip()
            continue
        cells = next(csv.reader([line]))
        cells = [c.strip() for c in cells]
        if header is None:
            header = cells
            missing = [c for c in ("op", "time_s") if c not in header]
            unknown = [c for c in header if c not in COLUMNS + EXTRA_COLUMNS]
            if missing or unknown:
                raise ConfigError(f"{where}: bad header {','.join(header)!r}; expected columns "
                                  f"{','.join(COLUMNS)} (op and time_s required)"
                                  + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
            continue
        if len(cells) != len(header):
            raise ConfigError(f"{where}: {len(cells)} fields, the header has {len(header)}")
        rec = dict(zip(header, cells))
        op = rec["op"]
        if op not in OPS:
            raise ConfigError(f"{where}: unknown op {op!r}; valid: {', '.join(OPS)}")
        kind = rec.get("kind", "")
        if kind not in KINDS:
            raise ConfigError(f"{where}: unknown kind {kind!r}; valid: prefill, decode, mixed")
        st = rec.get("stage", "0")
        stage = None if st in ("max", "") else _int(st, "stage", where)
        try:
            t = float(rec["time_s"])
        except ValueError:
            raise ConfigError(f"{where}: column time_s={rec['time_s']!r} is not a number") from None
        row = ProfileRow(op, stage, kind, *(_int(rec.get(c, "0") or "0", c, where)
                                            for c in ("batch", "tokens", "prefix", "context", "nbytes")), t,
                         _int(rec.get("tp", "1") or "1", "tp", where, 1), rec.get("link", ""))
        _check_row(row, where)
        rows.append(row)
    if header is None or not rows:
        raise ConfigError(f"{name}: no measurements (expected a header {','.join(COLUMNS)} and rows)")
    return ProfileTable(rows, meta)


def write_profile(table: ProfileTable, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    for k, v in table.meta.items():
        buf.write(f"# {k}={v}\n")
    w = csv.writer(buf, lineterminator="\n")
    extra = any(r.tp != 1 or r.link for r in table.rows)  # operator rows; forward-only tables keep 9 columns
    w.writerow(COLUMNS + EXTRA_COLUMNS if extra else COLUMNS)
    for r in table.rows:
        cells = [r.op, "max" if r.stage is None else r.stage, r.kind, r.batch, r.tokens, r.prefix,
                 r.context, r.nbytes, f"{r.time_s:.9g}"]
        w.writerow(cells + [r.tp, r.link] if extra else cells)
    path.write_text(buf.getvalue())
    return path


def rows_from_iter(items: Iterable[ProfileRow]) -> ProfileTable:
    return ProfileTable(list(items))


__all__ = ["ProfileRow", "ProfileTable", "read_profile", "parse_profile", "write_profile", "rows_from_iter",
           "TOKEN_OPS", "ATTENTION_OPS", "OPERATOR_OPS"]
