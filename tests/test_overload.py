"""The overload warning judges the queue over the arrival window (testbed/run/overload.py), so a
short healthy run's drain tail does not trip it (issue 49 item 4) and a growing queue does."""
from __future__ import annotations

import math

from testbed.cli import main
from testbed.run.overload import judge, queue_growth


def rows(n: int, gap: float, serve_gap: float, decode_s: float) -> list[dict]:
    """`n` requests arriving every `gap` s, served (first token) one every `serve_gap` s, each then
    decoding for `decode_s` s."""
    out, free = [], 0.0
    for i in range(n):
        arrival = i * gap
        first = max(arrival, free) + serve_gap
        free = first
        out.append({"arrival_s": arrival, "first_token_s": first, "finish_s": first + decode_s,
                    "prompt_len": 100, "output_len": 200})
    return out


def test_a_long_drain_tail_is_not_an_overload():
    """Every request served on arrival, then decoding for 47 s (the 300-request gLLM run at 0.75
    req/s that the first rule called overloaded: offered / served over the whole run 1.13)."""
    healthy = rows(300, 1 / 0.75, 0.5, 47.0)
    span = healthy[-1]["arrival_s"] - healthy[0]["arrival_s"]
    run = healthy[-1]["finish_s"] - healthy[0]["arrival_s"]
    assert span and (run / span) > 1.10  # what the old rule compared, in effect
    load = judge(healthy)
    assert not load.overloaded and abs(load.growth) < 0.01


def test_a_growing_queue_is_an_overload():
    over = judge(rows(300, 1.0, 1.25, 5.0))  # a fifth of the arrivals pile up
    assert over.overloaded and math.isclose(over.growth, 0.2, abs_tol=0.02)


def test_too_few_arrivals_or_offline_say_nothing():
    assert judge(rows(1, 1.0, 1.0, 1.0)) is None
    assert judge([{**r, "arrival_s": 0.0} for r in rows(20, 1.0, 1.0, 1.0)]) is None  # offline
    assert math.isnan(queue_growth([0.0, 1.0, 2.0], [0.5, 1.5, 2.5]))


def test_a_short_healthy_main_job_run_does_not_warn(tmp_path, capsys):
    """The issue's case itself: gLLM, 300 Azure requests at 0.75 req/s (attainment 0.90)."""
    assert main(["run", "policy=gllm", "workload=azure", "workload.num_requests=300", "workload.rate=0.75",
                 "output.progress=false", "output.mlflow=false", "output.plots=false", "output.trace=off",
                 f"output.dir={tmp_path}"]) == 0
    assert "overloaded" not in capsys.readouterr().err
