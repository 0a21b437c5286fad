"""testbed/calibrate/error_figure.py: the figure's counts are the test reports' (set 12, reported once)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from testbed.calibrate.error_figure import error_figure, group_means, within_band

SET12 = Path(__file__).resolve().parents[1] / "measurements" / "cpu-tiny-llama-2026-11-28"


@pytest.mark.parametrize("pp, tp, tpot, both", [(1, 18, 16, 16), (2, 17, 14, 13)])
def test_groups_within_ten_percent_match_set_12s_test_reports(pp: int, tp: int, tpot: int, both: int,
                                                              tmp_path: Path) -> None:
    long = pd.read_csv(SET12 / f"errors-set12-pp{pp}.csv")
    groups = group_means(long[long["set"] == "test"])
    counts = within_band(groups)
    assert counts["throughput_tok_s"] == (tp, 18) and counts["tpot_mean_s"] == (tpot, 18)
    wide = groups.pivot_table(index=["setting", "policy"], columns="metric", values=["sim", "real"])
    err = (wide["sim"] / wide["real"] - 1.0).abs()
    assert int(((err["throughput_tok_s"] <= 0.1) & (err["tpot_mean_s"] <= 0.1)).sum()) == both  # "13 of 18"
    png = error_figure(long, tmp_path / "e.png", f"set 12 P={pp}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_group_is_the_mean_over_its_repeats_and_the_engine_range_is_kept() -> None:
    long = pd.DataFrame([
        {"run": "a-r1", "set": "test", "policy": "a", "setting": "s", "metric": "tpot_mean_s", "predicted": 1.0, "actual": 0.8},
        {"run": "a-r2", "set": "test", "policy": "a", "setting": "s", "metric": "tpot_mean_s", "predicted": 1.0, "actual": 1.2},
        {"run": "b-r1", "set": "test", "policy": "b", "setting": "s", "metric": "tpot_mean_s", "predicted": 1.3, "actual": 1.0},
    ])
    g = group_means(long).set_index("policy")
    assert g.loc["a", "real"] == pytest.approx(1.0) and (g.loc["a", "lo"], g.loc["a", "hi"]) == (0.8, 1.2)
    assert within_band(group_means(long)) == {"tpot_mean_s": (1, 2)}
