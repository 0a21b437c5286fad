"""Ratio claims at matched load (testbed/reproduce/claims.py `matched_load`): a group where one system
served less of the offered load (its request throughput lower) is left out, with the reason."""
from __future__ import annotations

import pytest

from engine.base.errors import ConfigError
from testbed import reproduce as R
from testbed.reproduce.studies import _claim


def _row(system: str, rate: float, ttft: float, thr: float) -> dict:
    return {"part": "rate", "system": system, "workload.rate": rate, "status": "finished", "ttft_mean_s": ttft,
            "request_throughput": thr}


ROWS = [_row("new", 0.3, 1.5, 0.285), _row("old", 0.3, 2.0, 0.281),  # both keep up: 0.75x counts
        _row("new", 0.5, 1.8, 0.458), _row("old", 0.5, 62.0, 0.336)]  # old past capacity: 0.03x must not


def claim(**kw) -> R.Claim:
    return R.Claim(id="ttft", text="", published="", metric="ttft_mean_s", a={"system": "new"}, b={"system": "old"},
                   pair_by=("workload.rate",), aggregate="min", claimed=0.54, **kw)


def test_the_best_point_is_taken_only_where_the_load_is_matched():
    assert R.evaluate_claim(claim(), ROWS).measured == pytest.approx(1.8 / 62.0)  # the old rule: a backlog
    res = R.evaluate_claim(claim(matched_load=0.05), ROWS)
    assert res.measured == pytest.approx(0.75)
    assert "load not matched: request throughput 1.36x" in res.verdict.text


@pytest.mark.parametrize("bad", [0, 1.5, True, "5%"])
def test_matched_load_must_be_a_fraction_on_a_ratio_claim(bad):
    with pytest.raises(ConfigError, match="matched_load"):
        _claim({"id": "c", "metric": "m", "matched_load": bad}, "s")
    with pytest.raises(ConfigError, match="matched_load"):
        _claim({"id": "c", "metric": "m", "kind": "value", "matched_load": 0.05}, "s")
