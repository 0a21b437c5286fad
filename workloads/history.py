"""The data set behind a workload, as history for policies that learn from it (TD-Pipe's output-
length predictor, policies/length_predictor.py; docs/policies-specialised.md#tdpipe).

Here, not in policies/, because it reads workload files: the runner hands `history_for_run` to
the controller (`Controller(history=...)`) and a policy asks `view.history(mode)`; `testbed
predictor train` reads `history_requests` and gives the records to `train_predictor`.

History and leakage. A predictor must never be tested on what it was trained on:
- `history_requests(workload_cfg, data_dir)` is every record of the workload's data set that
  passes its length filters, whatever its `num_requests`, arrival or `start_s` (ShareGPT: the
  whole pairs file with that tokenizer's counts; Azure: every trace row; synthetic: an
  independent draw with another seed). Training on it is for a model used on other data.
- `history_for_run(run, data_dir, mode)` finds the data set the run was drawn from (by prompt
  text for ShareGPT, by (prompt, output) length pairs for the Azure traces) and returns it MINUS
  the run's own requests (a multiset difference on `request_key`, so a duplicated pair is
  removed once per run request). For workloads with no data set behind them (synthetic) it falls
  back to the run's own requests and says so (`source="run ..."`), which leaks.
"""
from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.base.errors import ConfigError, TestbedError, bad_value
from engine.core.policy import History, request_key
from engine.core.request import Request
from workloads.azure import TRACE_FILES, load_trace
from workloads.base import build_workload, workload_config
from workloads.data import SHAREGPT_PAIRS, resolve_data_file
from workloads.sharegpt import TOKENIZERS, load_pairs


def without(history: Sequence[Request], exclude: Sequence[Request]) -> list[Request]:
    """`history` minus `exclude` as multisets of `request_key`."""
    drop = Counter(request_key(r) for r in exclude)
    out = []
    for r in history:
        k = request_key(r)
        if drop[k] > 0:
            drop[k] -= 1
        else:
            out.append(r)
    return out


def _sharegpt_records(data_dir, tokenizer: str, lo: int = 1, hi: int | None = None,
                      olo: int = 1, ohi: int | None = None) -> list[Request]:
    pairs = load_pairs(resolve_data_file(SHAREGPT_PAIRS, None, data_dir))
    in_col, out_col, extra = TOKENIZERS[tokenizer]
    inp = pairs.counts[in_col] + extra
    out = pairs.counts[out_col]
    ok = (inp >= lo) & (out >= olo)
    if hi is not None:
        ok &= inp <= hi
    if ohi is not None:
        ok &= out <= ohi
    return [Request(i, 0.0, int(inp[j]), int(out[j]), pairs.prompts[j]) for i, j in enumerate(np.flatnonzero(ok))]


def _azure_records(data_dir, trace: str, lo: int = 1, hi: int | None = None,
                   olo: int = 1, ohi: int | None = None) -> list[Request]:
    _, ctx, gen = load_trace(resolve_data_file(TRACE_FILES[trace], None, data_dir))
    ok = (ctx >= max(1, lo)) & (gen >= max(1, olo))
    if hi is not None:
        ok &= ctx <= hi
    if ohi is not None:
        ok &= gen <= ohi
    return [Request(i, 0.0, int(ctx[j]), int(gen[j])) for i, j in enumerate(np.flatnonzero(ok))]


def history_requests(workload_cfg: Mapping[str, Any] | str, data_dir=None) -> tuple[str, list[Request]]:
    """(name, records) of the data set behind a workload config: every record passing its length
    filters, whatever its `num_requests`, arrival or `start_s` (see the module docstring)."""
    cfg = workload_config(workload_cfg)
    if cfg.name == "sharegpt":
        if cfg.path is not None:
            raise ConfigError("train_predictor reads the pairs file through the data dir; workload.path is not supported")
        recs = _sharegpt_records(data_dir, cfg.tokenizer, cfg.min_input_len, cfg.max_input_len,
                                 cfg.min_output_len, cfg.max_output_len)
        return f"sharegpt-{cfg.tokenizer}", recs
    if cfg.name == "azure":
        recs = _azure_records(data_dir, cfg.trace, cfg.min_input_len, cfg.max_input_len,
                              cfg.min_output_len, cfg.max_output_len)
        return f"azure-{cfg.trace}", recs
    settings = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
    settings["seed"] = cfg.seed + 1_000_003  # an independent draw of the same distributions
    settings["arrival"] = "offline"
    return cfg.name, build_workload(settings, data_dir)


def history_for_run(run: Sequence[Request], data_dir=None, mode: str = "auto") -> History:
    """The data set `run` was drawn from, minus `run` itself (`mode="auto"`), or `run` itself
    (`mode="run"`). Length filters are approximated by the run's own prompt-length range.
    The controller's history provider (`engine.core.policy.HistoryProvider`; see `view.history`)."""
    run = tuple(run)
    if mode == "run":
        return History("run (trains on the run's own requests: leaks)", run)
    if mode != "auto":
        raise bad_value("policy.history", mode, "must be auto or run")
    lo, hi = min(r.prompt_len for r in run), max(r.prompt_len for r in run)
    texts = [r for r in run if r.prompt_text]
    try:
        if texts:
            tok = _sharegpt_tokenizer(texts[:200], data_dir)
            if tok is not None:
                recs = _sharegpt_records(data_dir, tok, lo, hi)
                return History(f"sharegpt-{tok} pairs with prompt length in [{lo}, {hi}], minus the run",
                               tuple(without(recs, run)), f"sharegpt-{tok}")
        else:
            keys = Counter((r.prompt_len, r.output_len) for r in run)
            for trace in ("conv", "code"):
                recs = _azure_records(data_dir, trace)
                have = Counter((r.prompt_len, r.output_len) for r in recs)
                matched = sum(min(n, have[k]) for k, n in keys.items())
                if matched >= 0.99 * len(run):
                    return History(f"azure-{trace} trace rows minus the run", tuple(without(recs, run)),
                                   f"azure-{trace}")
    except TestbedError as exc:  # data not found: fall through to the warning below
        reason = str(exc)
    else:
        reason = "no data set matches these requests"
    warnings.warn(f"TD-Pipe length predictor: {reason}; training on the run's own requests (leaks)",
                  stacklevel=3)  # the policy that asked `view.history`
    return History("run (leaks: no data set found)", run)


def _sharegpt_tokenizer(sample: Sequence[Request], data_dir) -> str | None:
    """Which token counts of the pairs file the run's prompt lengths are (None if no match)."""
    pairs = load_pairs(resolve_data_file(SHAREGPT_PAIRS, None, data_dir))
    wanted = {r.prompt_text for r in sample}
    index: dict[str, list[int]] = {}
    for j, t in enumerate(pairs.prompts):
        if t in wanted:
            index.setdefault(t, []).append(j)  # the same prompt text can occur several times
    hits = [(r, index[r.prompt_text]) for r in sample if r.prompt_text in index]
    if len(hits) < 0.9 * len(sample):
        return None
    for name, (in_col, out_col, extra) in TOKENIZERS.items():
        ok = sum(any(r.prompt_len == pairs.counts[in_col][j] + extra and r.output_len == pairs.counts[out_col][j]
                     for j in js) for r, js in hits)
        if ok >= 0.99 * len(hits):
            return name
    return None


__all__ = ["history_requests", "history_for_run", "without", "History", "request_key"]
