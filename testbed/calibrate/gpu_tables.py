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
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from engine.profile_table import ProfileRow, ProfileTable
from engine.errors import ConfigError

__all__ = ["PublishedTables", "read_published", "DEVICES", "TABLES_SUBDIR", "shape_meta"]

TABLES_SUBDIR = "gpu-op-profiles"
DEVICES = ("a100", "h100", "a40")
_MLP_OPS = {"attn_pre_proj": "gemm_qkv", "attn_post_proj": "gemm_o", "mlp_up_proj": "gemm_up",
            "mlp_down_proj": "gemm_down", "input_layernorm": "norm", "post_attention_layernorm": "norm",
            "attn_rope": "rope", "mlp_act": "act", "add": "add", "emb": "emb"}
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


def _ms(value: str) -> float:
    return float(value) * 1e-3


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="") as f:
            return list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def read_mlp(path: Path, device: str) -> ProfileTable:
    """One model's `mlp.csv` -> operator rows for every token count and TP degree."""
    recs = _rows(path)
    if not recs:
        raise ConfigError(f"{path}: no rows")
    first = recs[0]
    meta = {"device": device, "model": path.parent.name, "source": str(path),
            **shape_meta(int(first["n_embd"]), int(first["n_head"]), int(first["n_kv_head"]),
                         int(first["n_expanded_embd"]), int(first["vocab_size"]),
                         first["use_gated_mlp"].strip().lower() == "true")}
    rows = []
    for rec in recs:
        tokens, tp = int(rec["num_tokens"]), int(rec["num_tensor_parallel_workers"])
        for column, op in _MLP_OPS.items():
            value = rec.get(f"time_stats.{column}.median")
            if value:
                rows.append(ProfileRow(op, None, "", 0, tokens, 0, 0, 0, _ms(value), tp=tp))
    return ProfileTable(rows, meta)


def read_attention_csv(path: Path, device: str) -> ProfileTable:
    """A complete attention table: decode rows (batch x KV length) and prefill rows (chunk x prefix)."""
    recs = _rows(path)
    if not recs:
        raise ConfigError(f"{path}: no rows")
    first = recs[0]
    meta = {"device": device, "model": path.stem, "source": str(path), "backend": first.get("attention_backend", ""),
            **shape_meta(int(first["n_embd"]), int(first["n_q_head"]), int(first["n_kv_head"]))}
    rows = []
    for rec in recs:
        tp = int(rec["num_tensor_parallel_workers"])
        if rec["is_prefill"].strip() == "True":
            rows.append(ProfileRow("attn_prefill", None, "", 1, int(rec["prefill_chunk_size"]),
                                   int(rec["kv_cache_size"]), 0, 0, _ms(rec["time_stats.attn_prefill.median"]), tp=tp))
        else:
            rows.append(ProfileRow("attn_decode", None, "", int(rec["batch_size"]), 0, 0, int(rec["kv_cache_size"]), 0,
                                   _ms(rec["time_stats.attn_decode.median"]), tp=tp))
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
        tp, size = int(parts[1]), int(parts[2])
        if parts[0] == "P" and len(parts) > 3:
            rows.append(ProfileRow("kv_write", None, "", 1, size, 0, 0, 0, _ms(parts[3]), tp=tp))
        for item in body.split():
            key, _, ms = item.partition(":")
            if parts[0] == "D":
                rows.append(ProfileRow("attn_decode", None, "", int(key), 0, 0, size, 0, _ms(ms), tp=tp))
            else:
                rows.append(ProfileRow("attn_prefill", None, "", 1, size, int(key), 0, 0, _ms(ms), tp=tp))
    return (ProfileTable(rows, meta) if rows and meta else None), skipped


def read_network(path: Path, setup: str) -> ProfileTable:
    """NCCL times: the median over ranks of each (GPUs, GPUs per node, size) point."""
    recs = _rows(path)
    collective = path.stem  # send_recv or all_reduce
    groups: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    for rec in recs:
        key = (int(rec["num_workers"]), int(rec["devices_per_node"]), int(rec["size"]))
        groups[key].append(_ms(rec[f"time_stats.{collective}.median"]))
    rows = [ProfileRow(collective, None, "", 0, 0, 0, 0, size, statistics.median(times), tp=nw,
                       link="node" if dpn >= nw else "cross-node")
            for (nw, dpn, size), times in sorted(groups.items())]
    return ProfileTable(rows, {"setup": setup, "source": str(path)})


def read_host(path: Path) -> list[ProfileTable]:
    """Per-iteration host costs by batch size, one table per model (median columns, any case)."""
    recs = _rows(path)
    by_model: dict[str, list[ProfileRow]] = defaultdict(list)
    for rec in recs:
        low = {k.lower(): v for k, v in rec.items() if k}
        batch, tp = int(float(low["batch_size"])), int(float(low["tensor_parallel_degree"]))
        for column, op in _HOST_OPS.items():
            value = low.get(f"{column}_median")
            if value:
                by_model[low["model_name"]].append(
                    ProfileRow(op, None, "decode", batch, 0, 0, _HOST_CONTEXT, 0, _ms(value), tp=tp))
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
    return out


def tables_from_profile(table: ProfileTable, device: str) -> PublishedTables:
    """A user's own operator-level profile (testbed's CSV with `gemm_*`, `norm`, ..., `attn_*`,
    `send_recv`, `all_reduce`, `prepare`/`sample`/`schedule` rows and the layer shape in its
    `# hidden=... q_heads=... kv_heads=... intermediate=... vocab=...` metadata) as the tables of
    one device, so the published tables' fit and report apply to it unchanged."""
    from engine.profile_table import ATTENTION_OPS, TOKEN_OPS

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
