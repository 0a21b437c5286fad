"""One naming style (testbed/config/naming.py) and the prior estimate of long commands
(testbed/sweep/estimate.py): issue 49 items 2 and 7."""
from __future__ import annotations

import re

from testbed.config.spec import compose_spec
from testbed.config.naming import point_name
from testbed.sweep.compare import grid
from testbed.sweep.estimate import estimate_line, estimate_s, point_cpu_s


def test_points_windows_and_trials_are_told_apart_in_one_style():
    values = {"policy": "gllm", "workload.rate": 0.8}
    assert point_name(values) == "gllm · rate=0.8"
    assert point_name(values, window=2) == "gllm · rate=0.8 · w2" != point_name(values, window=1)
    assert point_name({"policy": "gllm"}, trial=7) == "gllm · trial=7"
    assert point_name({}) == "base"


def test_the_console_names_a_compare_point_as_mlflow_does():
    _, points = grid(["policy=gllm,sarathi", "workload.rate=0.25,0.5"])
    assert [p.label for p in points] == ["gllm · rate=0.25", "gllm · rate=0.5", "sarathi · rate=0.25",
                                         "sarathi · rate=0.5"]
    assert points[0].dirname == "000_policy=gllm_workload.rate=0.25"  # folders keep the full keys


def test_the_estimate_grows_with_the_simulated_time_and_says_its_load():
    slow, fast = (compose_spec(["workload=azure", f"workload.rate={r}", "output.mlflow=false"]) for r in (0.25, 1.5))
    assert point_cpu_s(slow) > point_cpu_s(fast) > 0
    assert estimate_s([slow, fast])[0] > estimate_s([fast])[0]
    assert re.match(r"estimate: ~[0-9.]+ (s|min) of wall time for 2 run\(s\) at load [0-9.]+ on \d+ cores",
                    estimate_line([slow, fast]))
