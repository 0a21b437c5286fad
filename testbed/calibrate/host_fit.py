"""The host-overhead fit: prepare, sample and schedule rows of the published CPU-overhead tables
(gpu-op-profiles/cpu_overheads/<device>-<commit>.csv) by rows, vocabulary, TP degree and code version.

One line per op fitted to every row had 52% median error and -49% bias on A100 (A40 40%, -31%):
the tables hold three code versions (commits 513ddc1, 6d98aa8, e2d00e9: e2d00e9's schedule is 5x
faster than 6d98aa8's), TP > 1 pays a worker round trip (A40 prepare at batch 8: 0.37 ms at TP 1,
0.8-1.1 ms at TP 2-8; sampling at TP >= 4 ~5-8 ms flat) and sampling grows with the vocabulary
(Qwen-72B's 152k: 2x Llama's 32k at batch 64). Here each (commit, TP class: 1, 2, >= 4) has its own
fixed cost and, for prepare and schedule, its own cost per sequence; sampling costs per sequence x
vocabulary entry, per commit. Robust least squares (soft L1) on relative error: a few rows sit far
below their neighbours (A40 Qwen-72B schedule at batch 112: 0.25 ms between 1.75 and 1.17).

Held out, declared before fitting: every row of internlm-20b (vocabulary 103k, between the fitted
32k, 51k and 152k) and Llama-2-70b-hf (TP 2-8), on both devices.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.pricing.profile_table import ProfileTable

__all__ = ["HELD_OUT_MODELS", "HostModel", "fit_host_model", "tp_class", "SHIPPED_GROUP"]

HELD_OUT_MODELS = ("internlm-20b", "Llama-2-70b-hf")
OPS = ("prepare", "sample", "schedule")
REF_VOCAB = 32000.0
# The group the shipped profiles price with: the code version measured on both devices and on
# every model (6d98aa8), at TP 1 (a pipeline stage of the PP studies is one GPU).
SHIPPED_GROUP = ("6d98aa8", "1")


def tp_class(tp: int) -> str:
    return "1" if tp <= 1 else "2" if tp == 2 else "4+"


def commit_of(table: ProfileTable) -> str:
    """`<device>-<commit>.csv` -> commit."""
    return Path(table.meta.get("source", "x-unknown")).stem.split("-", 1)[-1]


def is_held_out(table: ProfileTable) -> bool:
    return table.meta.get("model", "").split("/")[-1] in HELD_OUT_MODELS


@dataclass
class HostModel:
    """Fitted per op: `fixed[(commit, tp class)]`, `per_seq[(commit, tp class)]` (prepare,
    schedule), `per_seq_vocab[commit]` (sample; seconds per sequence per 32k vocabulary entries)."""

    fixed: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    per_seq: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    per_seq_vocab: dict[str, float] = field(default_factory=dict)

    def predict(self, op: str, commit: str, tp: int, batch: int, vocab: int) -> float:
        g = (commit, tp_class(tp))
        fixed = self.fixed[op].get(g, _nearest(self.fixed[op], g))
        if op == "sample":
            return fixed + self.per_seq_vocab.get(commit, 0.0) * batch * vocab / REF_VOCAB
        return fixed + self.per_seq[op].get(g, _nearest(self.per_seq[op], g)) * batch


def _nearest(table: dict[tuple[str, str], float], g: tuple[str, str]) -> float:
    """A group not fitted: the same commit's other TP classes (mean), else every group's."""
    same = [v for k, v in table.items() if k[0] == g[0]]
    vals = same or list(table.values())
    return float(np.mean(vals)) if vals else 0.0


def _rows(tables: Sequence[ProfileTable], vocab_of, held: bool):
    for t in tables:
        if is_held_out(t) != held:
            continue
        commit, vocab = commit_of(t), vocab_of(t.meta["model"])
        for r in t.rows:
            yield r.op, commit, r.tp, r.batch, vocab, r.time_s


def fit_host_model(tables: Sequence[ProfileTable], vocab_of) -> HostModel | None:
    """Fit on every row but the held-out models'. `vocab_of(model name)` -> vocabulary size."""
    from scipy.optimize import least_squares, nnls

    rows = list(_rows(tables, vocab_of, held=False))
    if not rows:
        return None
    model = HostModel()
    for op in OPS:
        sel = [r for r in rows if r[0] == op]
        if not sel:
            continue
        groups = sorted({(c, tp_class(tp)) for _, c, tp, *_ in sel})
        commits = sorted({c for _, c, *_ in sel})
        cols = []
        for g in groups:
            member = np.array([(c, tp_class(tp)) == g for _, c, tp, *_ in sel], dtype=float)
            cols.append(member)
            if op != "sample":
                cols.append(member * np.array([b for *_, b, _, _ in sel], dtype=float))
        if op == "sample":
            for c in commits:
                cols.append(np.array([(cc == c) * b * v / REF_VOCAB for _, cc, _, b, v, _ in sel], dtype=float))
        y = np.array([r[-1] for r in sel])
        a = np.array(cols).T / y[:, None]
        start, _ = nnls(a, np.ones(len(y)))
        coef = least_squares(lambda x: a @ x - 1.0, start, bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.1).x
        k = 0
        model.fixed[op], model.per_seq[op] = {}, {}
        for g in groups:
            model.fixed[op][g] = float(coef[k]); k += 1
            if op != "sample":
                model.per_seq[op][g] = float(coef[k]); k += 1
        if op == "sample":
            for c in commits:
                model.per_seq_vocab[c] = float(coef[k]); k += 1
    return model


def error_rows(tables: Sequence[ProfileTable], model: HostModel, vocab_of) -> list[dict]:
    """Every host row, fitted and held out, with the model's prediction (calibrate tables' report)."""
    out = []
    for held in (False, True):
        for t in tables:
            if is_held_out(t) != held:
                continue
            commit, vocab = commit_of(t), vocab_of(t.meta["model"])
            for r in t.rows:
                out.append(dict(family="host", model=t.meta["model"], tp=r.tp, x=r.batch, bucket=r.op,
                                measured=r.time_s, fitted=model.predict(r.op, commit, r.tp, r.batch, vocab),
                                default=np.nan, held=held))
    return out
