"""A capacity probe ends once its failure is certain (testbed/capacity/early.py): the search's
probes, verdicts and answer are those of full runs; only a stopped probe's value is a lower bound."""
from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from testbed.capacity.early import EarlyStop
from testbed.cli import main

SEARCH = ["capacity", "policy=gllm", "workload=azure", "output.progress=false", "output.mlflow=false",
          "capacity.window_requests=300", "capacity.windows=2", "capacity.precision=0.1", "capacity.workers=1"]


def _seq(arrival, first=None, finish=None, out=11, status="decoding"):
    return SimpleNamespace(request=SimpleNamespace(arrival_s=arrival, output_len=out), first_token_s=first,
                           finish_s=finish, status=SimpleNamespace(value=status))


def test_only_certain_misses_are_counted():
    stop = EarlyStop(ttft_s=4.0, tpot_s=0.2, target=0.8)
    now = 10.0
    assert stop.misses([_seq(5.0)], now) == 1  # waiting 5 s for its first token
    assert stop.misses([_seq(7.0)], now) == 0  # waiting 3 s: may still make it
    assert stop.misses([_seq(0.0, first=5.0)], now) == 1  # first token after 5 s
    assert stop.misses([_seq(8.0, first=9.0)], now) == 0  # decoding for 1 s of its 10 gaps
    assert stop.misses([_seq(0.0, first=1.0, out=11)], now) == 1  # 9 s for <= 10 gaps: TPOT >= 0.9 s already
    assert stop.misses([_seq(0.0, first=1.0, finish=2.0, status="finished")], now) == 0
    assert stop.misses([_seq(0.0, status="failed")], now) == 1
    assert stop.misses([_seq(20.0)], now) == 0  # not arrived yet


@pytest.mark.slow  # two searches: 127 s of wall time at load ~20; `./tb test -m slow`
def test_a_search_with_early_stops_gives_the_same_probes_and_answer(tmp_path, capsys):
    found = {}
    for flag in ("true", "false"):
        code = main([*SEARCH, f"capacity.early_stop={flag}", f"output.dir={tmp_path}", f"capacity.experiment=es-{flag}"])
        assert code == 0, capsys.readouterr().err[-2000:]
        out = tmp_path / "capacity" / f"es-{flag}"
        found[flag] = (pd.read_csv(out / "table.csv").iloc[0], pd.read_csv(out / "probes.csv"))
    (row, probes), (row_full, probes_full) = found["true"], found["false"]
    assert row["capacity_req_s"] == row_full["capacity_req_s"] and row["search"] == row_full["search"]
    keys = ["window", "workload.rate", "capacity.passed"]
    assert probes[keys].equals(probes_full[keys])
    stopped = probes["stopped_at"].notna()
    assert stopped.any() and probes_full["stopped_at"].isna().all()
    assert not probes.loc[stopped, "capacity.passed"].any()  # only failures stop early ...
    assert (probes.loc[stopped, "stopped_at"] < probes.loc[stopped, "num_requests"]).all()
    assert (probes.loc[stopped, "capacity.value"] <= probes_full.loc[stopped, "capacity.value"]).all()
    checks = probes["capacity.phase"].isin(["verify", "upper", "holdout"])  # ... and never a confirmation
    assert probes.loc[checks, "capacity.value"].equals(probes_full.loc[checks, "capacity.value"])
