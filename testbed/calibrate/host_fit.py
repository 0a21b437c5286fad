"""The host-overhead fit: prepare, sample and schedule rows of the published CPU-overhead tables
(gpu-op-profiles/cpu_overheads/<device>-<commit>.csv) by rows, vocabulary, TP degree and code version.

One line per op fitted to every row had 52% median error and -49% bias on A100 (A40 40%, -31%):
the tables hold three code versions (commits 513ddc1, 6d98aa8, e2d00e9: e2d00e9's schedule is 5x
faster than 6d98aa8's), TP > 1 pays a worker round trip (A40 prepare at batch 8: 0.37 ms at TP 1,
0.8-1.1 ms at TP 2-8; sampling at TP >= 4 ~5-8 ms flat) and sampling grows with the vocabulary
(Qwen-72B's 152k: 2x Llama's 32k at batch 64). Here each (commit, TP class: 1, 2, >= 4) has its own
fixed cost and its own cost per sequence (sampling: per sequence x vocabulary entry). Robust least squares (soft L1) on relative error: a few rows sit far
below their neighbours (A40 Qwen-72B schedule at batch 112: 0.25 ms between 1.75 and 1.17).

Held out, declared before fitting: every row of internlm-20b (vocabulary 103k, between the fitted
32k, 51k and 152k) and Llama-2-70b-hf (TP 2-8), on both devices.

The sample rows include the lm_head. Vidur's profiler times Sarathi-Serve's `SAMPLER_E2E`
(microsoft/vidur vidur/profiling/cpu_overhead/benchmark_runner.py reads `cpu_operation_metrics`).
That timer wraps `self.sampler(output, seq_metadata_list)` (sarathi/model_executor/model_runner.py,
`ModelRunner.run`), and Sarathi's `Sampler.forward` starts with `_get_logits`: the
`hidden @ lm_head.weight.T` GEMM plus `gather_from_tensor_model_parallel_region`
(sarathi/model_executor/layers/sampler.py). `CpuTimer.__exit__` calls `torch.cuda.synchronize()`
(sarathi/metrics/cpu_timer.py), so the row holds the GEMM's GPU time. The cost model already prices
that GEMM and gather in the last stage's forward (`KernelPricer.lm_head_s`). `fit_host_model`
therefore takes `lm_head_s(model, tp, rows)`, the same price the way the tables were measured. The
sampling coefficients are fitted to what is left, on the relative error of the total. A run pays
lm_head once in the forward and the rest in `sample_s`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.pricing.profile_table import ProfileTable

__all__ = ["HELD_OUT_MODELS", "HostModel", "LmHead", "fit_host_model", "tp_class", "SHIPPED_GROUP"]

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
    schedule), `per_seq_vocab[(commit, tp class)]` (sample; seconds per sequence per 32k vocabulary
    entries, without the lm_head: per TP class too, since the logits gather left in a TP > 1 row
    grows with rows x vocabulary at the node's own rate)."""

    fixed: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    per_seq: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    per_seq_vocab: dict[tuple[str, str], float] = field(default_factory=dict)

    def predict(self, op: str, commit: str, tp: int, batch: int, vocab: int) -> float:
        g = (commit, tp_class(tp))
        fixed = self.fixed[op].get(g, _nearest(self.fixed[op], g))
        if op == "sample":
            return fixed + self.per_seq_vocab.get(g, _nearest(self.per_seq_vocab, g)) * batch * vocab / REF_VOCAB
        return fixed + self.per_seq[op].get(g, _nearest(self.per_seq[op], g)) * batch


def _nearest(table: dict[tuple[str, str], float], g: tuple[str, str]) -> float:
    """A group not fitted: the same commit's other TP classes (mean), else every group's."""
    same = [v for k, v in table.items() if k[0] == g[0]]
    vals = same or list(table.values())
    return float(np.mean(vals)) if vals else 0.0


LmHead = Callable[[str, int, int], float]  # (model name, TP degree, rows) -> seconds of lm_head


def _no_lm_head(model: str, tp: int, rows: int) -> float:
    return 0.0


def in_row(op: str, lm_head_s: LmHead, model: str, tp: int, batch: int) -> float:
    """The part of a measured row the stage forward already prices: the lm_head in `sample` rows."""
    return lm_head_s(model, tp, batch) if op == "sample" else 0.0


def _rows(tables: Sequence[ProfileTable], vocab_of, held: bool, lm_head_s: LmHead):
    for t in tables:
        if is_held_out(t) != held:
            continue
        model = t.meta["model"]
        commit, vocab = commit_of(t), vocab_of(model)
        for r in t.rows:
            yield r.op, commit, r.tp, r.batch, vocab, in_row(r.op, lm_head_s, model, r.tp, r.batch), r.time_s


def fit_host_model(tables: Sequence[ProfileTable], vocab_of, lm_head_s: LmHead = _no_lm_head) -> HostModel | None:
    """Fit on every row but the held-out models'. `vocab_of(model name)` -> vocabulary size;
    `lm_head_s(model name, tp, rows)`: the lm_head price each sample row already holds (default none)."""
    from scipy.optimize import least_squares, nnls

    rows = list(_rows(tables, vocab_of, held=False, lm_head_s=lm_head_s))
    if not rows:
        return None
    model = HostModel()
    for op in OPS:
        sel = [r for r in rows if r[0] == op]
        if not sel:
            continue
        groups = sorted({(c, tp_class(tp)) for _, c, tp, *_ in sel})
        per = np.array([r[3] * (r[4] / REF_VOCAB if op == "sample" else 1.0) for r in sel], dtype=float)
        cols = []
        for g in groups:
            member = np.array([(c, tp_class(tp)) == g for _, c, tp, *_ in sel], dtype=float)
            cols += [member, member * per]
        y = np.array([r[-1] for r in sel])
        target = 1.0 - np.array([r[5] for r in sel]) / y  # relative error of fit + lm_head against the row
        a = np.array(cols).T / y[:, None]
        start, _ = nnls(a, np.clip(target, 0.0, None))
        coef = least_squares(lambda x: a @ x - target, start, bounds=(0.0, np.inf), loss="soft_l1", f_scale=0.1).x
        model.fixed[op], model.per_seq[op] = {}, {}
        per_seq = model.per_seq_vocab if op == "sample" else model.per_seq[op]
        for k, g in enumerate(groups):
            model.fixed[op][g], per_seq[g] = float(coef[2 * k]), float(coef[2 * k + 1])
    return model


def error_rows(tables: Sequence[ProfileTable], model: HostModel, vocab_of,
               lm_head_s: LmHead = _no_lm_head) -> list[dict]:
    """Every host row, fitted and held out, with the model's prediction (calibrate tables' report):
    for sample rows the fit + the lm_head the stage forward prices, what a run pays for that row."""
    out = []
    for held in (False, True):
        for t in tables:
            if is_held_out(t) != held:
                continue
            name = t.meta["model"]
            commit, vocab = commit_of(t), vocab_of(name)
            for r in t.rows:
                fitted = model.predict(r.op, commit, r.tp, r.batch, vocab) + in_row(r.op, lm_head_s, name, r.tp, r.batch)
                out.append(dict(family="host", model=name, tp=r.tp, x=r.batch, bucket=r.op,
                                measured=r.time_s, fitted=fitted, default=np.nan, held=held))
    return out
