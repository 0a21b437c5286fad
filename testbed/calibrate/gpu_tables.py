"""Read the published GPU profiling tables into the project's own profile rows.

The tables are the per-operator CUDA kernel times published with the Vidur simulator (Agrawal et
al., MLSys 2024; docs/calibration.md#measured-kernels says what is in them). They are data, never
committed: they are found under `<data_dir>/gpu-op-profiles/` by the data-directory rule. This
reader turns them into `ProfileRow`s, the same rows `testbed profile` writes on a real engine, so
one fitting path (testbed/calibrate/kernel_fit.py) serves the published tables and a user's own profile:

- `compute/<device>/<org>/<model>/mlp.csv` -> per-layer operator rows (`gemm_qkv`, `gemm_o`,
  `gemm_up`, `gemm_down`, `norm` x2, `rope`, `act`, `add`, `emb`) by `tokens` and `tp`;
- `attention/*.csv` and `attention_samples/*.txt` -> `attn_decode` (`batch` sequences at KV length
  `context`), `attn_prefill` (a chunk of `tokens` after `prefix` cached tokens) and, where a sample
  line has it, `kv_write` (storing a chunk's K/V in the paged cache);
- `network/<setup>/{send_recv,all_reduce}.csv` -> `send_recv` / `all_reduce` rows by `nbytes`,
  `tp` (GPUs taking part) and `link` (`node`: all in one node; `cross-node`);
- `cpu_overheads/<device>-<commit>.csv` -> `prepare`, `sample` and `schedule` rows by batch.

Times are the tables' medians (5 measured runs each), converted from milliseconds to seconds.
Each table's `meta` holds the layer shape (`hidden`, `q_heads`, `kv_heads`, `intermediate`,
`vocab`, `gated`), the device, model and source file.
"""
from __future__ import annotations

import csv
import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from engine.pricing.profile_table import ProfileRow, ProfileTable
from engine.base.errors import ConfigError

__all__ = ["PublishedTables", "read_published", "DEVICES", "TABLES_SUBDIR", "shape_meta"]

TABLES_SUBDIR = "gpu-op-profiles"
DEVICES = ("a100", "h100", "a40")
_MLP_OPS = {"attn_pre_proj": "gemm_qkv", "attn_post_proj": "gemm_o", "mlp_up_proj": "gemm_up",
            "mlp_down_proj": "gemm_down", "input_layernorm": "norm", "post_attention_layernorm": "norm",
            "attn_rope": "rope", "mlp_act": "act", "add": "add", "emb": "emb"}
_MLP_SHAPE = ("n_embd", "n_head", "n_kv_head", "n_expanded_embd", "vocab_size", "use_gated_mlp")
_HOST_OPS = {"prepare_inputs_e2e": "prepare", "sampler_e2e": "sample", "schedule": "schedule"}
# The host tables' decode steps ran 256-token prompts (their README); the context is recorded for
# completeness, the host cost model does not depend on it.
_HOST_CONTEXT = 256


@dataclass
class PublishedTables:
    """One device's tables, as profile tables (each with its own layer shape in `meta`)."""

    device: str
    compute: dict[str, ProfileTable] = field(default_factory=dict)  # by model name
    attention: list[ProfileTable] = field(default_factory=list)
    network: dict[str, ProfileTable] = field(default_factory=dict)  # by setup (a100_dgx, ...)
    host: list[ProfileTable] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what was not read, and why

    @property
    def num_rows(self) -> int:
        tables = [*self.compute.values(), *self.attention, *self.network.values(), *self.host]
        return sum(len(t.rows) for t in tables)


def shape_meta(hidden: int, q_heads: int, kv_heads: int, intermediate: int = 0, vocab: int = 0,
               gated: bool = True) -> dict[str, str]:
    """The layer shape of a table. `mlp.csv` says whether the MLP is gated (`use_gated_mlp`) but not
    its activation: the tables' gated models are SwiGLU (SiLU), their one non-gated model is phi-2,
    whose config.json names `gelu_new`."""
    return {"hidden": str(hidden), "q_heads": str(q_heads), "kv_heads": str(kv_heads),
            "intermediate": str(intermediate), "vocab": str(vocab), "gated": str(bool(gated)).lower(),
            "hidden_act": "silu" if gated else "gelu_new"}


def _ms(value: str, path: Path, line: int, column: str) -> float:
    """A table's time in ms -> seconds. A cell that is no finite time > 0 is an error naming the
    file, line and column: nan or 0 ended in "Residuals are not finite" from the fit, inf was fitted
    silently (issue 38 item 7)."""
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms > 0):
        raise ConfigError(f"{path} line {line}: invalid {column}={value!r}: must be a time in ms > 0 (finite)")
    return ms * 1e-3


def _int(value: str, path: Path, line: int, column: str) -> int:
    try:
        return int(float(value))
    except (ValueError, OverflowError):
        raise ConfigError(f"{path} line {line}: invalid {column}={value!r}: must be a whole number") from None


def _rows(path: Path, required: tuple[str, ...] = ()) -> list[tuple[int, dict[str, str]]]:
    """(line number, record) of a CSV table whose header has every `required` column (a table
    with other columns was a KeyError traceback: issue 38 item 7)."""
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = [c for c in (reader.fieldnames or []) if c]
            missing = [c for c in required if c not in header]
            if missing:
                raise ConfigError(f"{path} has no column(s) {', '.join(missing)}; its header: {', '.join(header)}")
            return [(reader.line_num, rec) for rec in reader]
    except (OSError, csv.Error, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def read_mlp(path: Path, device: str) -> ProfileTable:
    """One model's `mlp.csv` -> operator rows for every token count and TP degree."""
    recs = _rows(path, _MLP_SHAPE + ("num_tokens", "num_tensor_parallel_workers"))
    if not recs:
        raise ConfigError(f"{path}: no rows")
    line, first = recs[0]
    shape = [_int(first[c], path, line, c) for c in _MLP_SHAPE[:-1]]
    meta = {"device": device, "model": path.parent.name, "source": str(path),
            **shape_meta(*shape, first["use_gated_mlp"].strip().lower() == "true")}
    rows = []
    for line, rec in recs:
        tokens = _int(rec["num_tokens"], path, line, "num_tokens")
        tp = _int(rec["num_tensor_parallel_workers"], path, line, "num_tensor_parallel_workers")
        for column, op in _MLP_OPS.items():
            name = f"time_stats.{column}.median"
            value = rec.get(name)
            if value:
                rows.append(ProfileRow(op, None, "", 0, tokens, 0, 0, 0, _ms(value, path, line, name), tp=tp))
    return ProfileTable(rows, meta)


def missing_ops(path: Path) -> list[str]:
    """What a model's `mlp.csv` does not measure (phi-2 has no post_attention_layernorm; a table
    without a GEMM column loses its linear rows): said, not passed over in silence."""
    with path.open(newline="") as f:
        header = next(csv.reader(f), [])
    return [f"{path.parent.name}/mlp.csv has no column time_stats.{c}.median ({op} not measured)"
            for c, op in _MLP_OPS.items() if f"time_stats.{c}.median" not in header]


def read_attention_csv(path: Path, device: str) -> ProfileTable:
    """A complete attention table: decode rows (batch x KV length) and prefill rows (chunk x prefix)."""
    recs = _rows(path, ("n_embd", "n_q_head", "n_kv_head", "num_tensor_parallel_workers", "is_prefill",
                        "prefill_chunk_size", "kv_cache_size", "batch_size", "time_stats.attn_prefill.median",
                        "time_stats.attn_decode.median"))
    if not recs:
        raise ConfigError(f"{path}: no rows")
    line, first = recs[0]
    meta = {"device": device, "model": path.stem, "source": str(path), "backend": first.get("attention_backend", ""),
            **shape_meta(*(_int(first[c], path, line, c) for c in ("n_embd", "n_q_head", "n_kv_head")))}
    if first.get("max_model_len", "").strip():
        # the profiler's block tables span max_model_len: FlashAttention-2's split heuristic counts
        # their width, not the row's context (the 70B table's small batches split by 4,096 tokens
        # at every context: batch 7 at 1,024 tokens takes 24 us in 7 pieces, batch 8 36 us in 3)
        meta["kv_width"] = _int(first["max_model_len"], path, line, "max_model_len")
    rows = []
    for line, rec in recs:
        def num(c: str) -> int:
            return _int(rec[c], path, line, c)

        if rec["is_prefill"].strip() == "True":
            t = _ms(rec["time_stats.attn_prefill.median"], path, line, "time_stats.attn_prefill.median")
            rows.append(ProfileRow("attn_prefill", None, "", 1, num("prefill_chunk_size"), num("kv_cache_size"), 0, 0,
                                   t, tp=num("num_tensor_parallel_workers")))
        else:
            t = _ms(rec["time_stats.attn_decode.median"], path, line, "time_stats.attn_decode.median")
            rows.append(ProfileRow("attn_decode", None, "", num("batch_size"), 0, 0, num("kv_cache_size"), 0, t,
                                   tp=num("num_tensor_parallel_workers")))
    return ProfileTable(rows, meta)


_SAMPLE_HEAD = re.compile(r"\((?P<backend>[A-Z_]+), n_embd (?P<h>\d+), (?P<q>\d+) q(?: heads)?, (?P<kv>\d+) kv")


def read_attention_samples(path: Path, device: str) -> tuple[ProfileTable | None, list[str]]:
    """A samples file: `D tp kv extra | batch:ms ...` (decode) and `P tp chunk kv_save | kv:ms ...`
    (prefill) lines after a `# source` line naming the backend and head counts. A prefill line's
    fourth field is the `attn_kv_cache_save` median of its chunk (the column layout the files'
    common source, vidur_hbf_hbm_backend @a336807, writes: one `kv_write` row per line); a decode
    line's is the output reshape (not read). Only lines of a FLASH_ATTENTION source are kept (the
    other backends are other kernels); other line kinds are reported as skipped."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    rows, skipped, meta = [], [], None
    backend_ok = False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            m = _SAMPLE_HEAD.search(line)
            if m:
                backend_ok = m["backend"] == "FLASH_ATTENTION"
                if backend_ok and meta is None:
                    meta = {"device": device, "model": path.stem, "source": str(path), "backend": m["backend"],
                            **shape_meta(int(m["h"]), int(m["q"]), int(m["kv"]))}
                if not backend_ok:
                    skipped.append(f"{path.name} line {lineno}: backend {m['backend']} (not FLASH_ATTENTION)")
            continue
        head, _, body = line.partition("|")
        parts = head.split()
        if not parts:
            continue
        if parts[0] not in ("D", "P") or len(parts) < 3:
            skipped.append(f"{path.name} line {lineno}: line kind {parts[0]!r} (layout not documented)")
            continue
        if not backend_ok:
            continue
        tp, size = _int(parts[1], path, lineno, "tp"), _int(parts[2], path, lineno, "size")
        if parts[0] == "P" and len(parts) > 3:
            rows.append(ProfileRow("kv_write", None, "", 1, size, 0, 0, 0, _ms(parts[3], path, lineno, "kv_write"),
                                   tp=tp))
        for item in body.split():
            key, _, ms = item.partition(":")
            n, t = _int(key, path, lineno, "key"), _ms(ms, path, lineno, f"{key}:")
            if parts[0] == "D":
                rows.append(ProfileRow("attn_decode", None, "", n, 0, 0, size, 0, t, tp=tp))
            else:
                rows.append(ProfileRow("attn_prefill", None, "", 1, size, n, 0, 0, t, tp=tp))
    return (ProfileTable(rows, meta) if rows and meta else None), skipped


def read_network(path: Path, setup: str) -> ProfileTable:
    """NCCL times: the median over ranks of each (GPUs, GPUs per node, size) point."""
    collective = path.stem  # send_recv or all_reduce
    time_col = f"time_stats.{collective}.median"
    recs = _rows(path, ("num_workers", "devices_per_node", "size", time_col))
    groups: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for line, rec in recs:
        key = tuple(_int(rec[c], path, line, c) for c in ("num_workers", "devices_per_node", "size"))
        groups[key].append(_ms(rec[time_col], path, line, time_col))
    rows = [ProfileRow(collective, None, "", 0, 0, 0, 0, size, statistics.median(times), tp=nw,
                       link="node" if dpn >= nw else "cross-node")
            for (nw, dpn, size), times in sorted(groups.items())]
    return ProfileTable(rows, {"setup": setup, "source": str(path)})


def read_host(path: Path) -> list[ProfileTable]:
    """Per-iteration host costs by batch size, one table per model (median columns, any case)."""
    by_model: dict[str, list[ProfileRow]] = defaultdict(list)
    for line, rec in _rows(path):
        low = {k.lower(): v for k, v in rec.items() if k}
        missing = [c for c in ("model_name", "batch_size", "tensor_parallel_degree") if c not in low]
        if missing:
            raise ConfigError(f"{path} has no column(s) {', '.join(missing)}")
        batch = _int(low["batch_size"], path, line, "batch_size")
        tp = _int(low["tensor_parallel_degree"], path, line, "tensor_parallel_degree")
        for column, op in _HOST_OPS.items():
            value = low.get(f"{column}_median")
            if value:
                by_model[low["model_name"]].append(ProfileRow(op, None, "decode", batch, 0, 0, _HOST_CONTEXT, 0,
                                                              _ms(value, path, line, f"{column}_median"), tp=tp))
    return [ProfileTable(rows, {"model": model, "source": str(path)}) for model, rows in by_model.items()]


def read_published(data_dir: str | Path, device: str) -> PublishedTables:
    """Every table of `device` (a100, h100 or a40) under `data_dir/gpu-op-profiles` (or `data_dir`
    itself when it is that folder)."""
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; valid: {', '.join(DEVICES)}")
    root = Path(data_dir)
    if (root / TABLES_SUBDIR).is_dir():
        root = root / TABLES_SUBDIR
    if not (root / "compute").is_dir():
        raise ConfigError(f"no published GPU tables under {data_dir} (expected {TABLES_SUBDIR}/compute/...)")
    out = PublishedTables(device)
    for path in sorted((root / "compute" / device).glob("*/*/mlp.csv")):
        out.compute[path.parent.name] = read_mlp(path, device)
        out.skipped += missing_ops(path)
    for path in sorted((root / "attention").glob(f"{device}-*.csv")):
        out.attention.append(read_attention_csv(path, device))
    for path in sorted((root / "attention_samples").glob(f"{device}_*.txt")):
        table, skipped = read_attention_samples(path, device)
        out.skipped += skipped
        if table is not None:
            out.attention.append(table)
    for path in sorted((root / "network").glob(f"{device}_*/*.csv")):
        out.network[f"{path.parent.name}/{path.stem}"] = read_network(path, path.parent.name)
    for path in sorted((root / "cpu_overheads").glob(f"{device}-*.csv")):
        out.host += read_host(path)
    if not out.compute:
        raise ConfigError(f"no compute tables for {device} under {root / 'compute' / device}")
    if not out.network:
        out.skipped.append(f"no network tables (network/{device}_*/send_recv.csv, all_reduce.csv): links are not "
                           f"fitted, the hardware profile's own link figures stay")
    return out


def tables_from_profile(table: ProfileTable, device: str) -> PublishedTables:
    """A user's own operator-level profile (testbed's CSV with `gemm_*`, `norm`, ..., `attn_*`,
    `send_recv`, `all_reduce`, `prepare`/`sample`/`schedule` rows and the layer shape in its
    `# hidden=... q_heads=... kv_heads=... intermediate=... vocab=...` metadata) as the tables of
    one device, so the published tables' fit and report apply to it unchanged."""
    from engine.pricing.profile_table import ATTENTION_OPS, TOKEN_OPS

    missing = [k for k in ("hidden", "q_heads", "kv_heads") if k not in table.meta]
    if missing:
        raise ConfigError(f"an operator-level profile needs its layer shape in the metadata; missing "
                          f"{', '.join('# ' + k + '=...' for k in missing)}")
    meta = {"model": table.meta.get("model", "profile"), "device": device, "gated": "true", "intermediate": "0",
            "vocab": "0", **table.meta}
    out = PublishedTables(device)

    def part(ops) -> ProfileTable:
        return ProfileTable([r for r in table.rows if r.op in ops], dict(meta))
    compute = part(TOKEN_OPS)
    if compute.rows:
        out.compute[meta["model"]] = compute
    attention = part(ATTENTION_OPS)
    if attention.rows:
        out.attention.append(attention)
    for collective in ("send_recv", "all_reduce"):
        rows = part((collective,))
        if rows.rows:
            out.network[f"profile/{collective}"] = rows
    host = part(("prepare", "sample", "schedule"))
    if host.rows:
        out.host.append(host)
    return out
