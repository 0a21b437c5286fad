"""`calibrate tables` (issue 48 item 4): `--device a40` ended in a KeyError 'gqa' traceback (its tables
have no attention); `--out /dev/null` and `--save /proc/nope` crashed only after 190-210 s of fitting;
a non-UTF-8 `--profile` was a traceback; a device's missing tables gave no warning."""
from __future__ import annotations

import pandas as pd
import pytest

from testbed.calibrate.tables import breakdowns, missing_families
from testbed.cli import main


def _errors(families: list[str]) -> pd.DataFrame:
    """An error frame as `error_frame` builds it, with rows of `families` only."""
    rows = [dict(family=f, model="m", tp=1, x=1, bucket="b", measured=1.0, fitted=1.1, default=1.2, held=True,
                 device="a40") for f in families]
    df = pd.DataFrame(rows)
    df["err_fitted"], df["err_default"] = df.fitted / df.measured - 1, df.default / df.measured - 1
    return df


def test_a_device_without_attention_tables_is_reported_with_a_warning():
    """The A40's frame has no attention rows, hence no `gqa` column: KeyError on the old code."""
    df = _errors(["linear", "send_recv"])
    parts = breakdowns(df)
    assert parts["shape"].empty and parts["gqa"].empty and len(parts["model"]) == 1
    assert missing_families(df) == ["attention"]
    assert missing_families(_errors(["linear"])) == ["attention", "network"]


@pytest.mark.parametrize("argv, needle", [
    (["--out", "/dev/null"], "invalid --out='/dev/null': it is a file, not a folder"),
    (["--save", "/proc/nope"], "invalid --save='/proc/nope': cannot write there"),
])
def test_outputs_are_checked_before_the_fit(argv, needle, tmp_path, capsys):
    args = ["calibrate", "tables", "--device", "a40", *argv]
    if "--out" not in argv:
        args += ["--out", str(tmp_path / "r")]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and len(err.splitlines()) == 1 and needle in " ".join(err.split()), err


def test_a_non_utf8_profile_is_one_line(tmp_path, capsys):
    bad = tmp_path / "p.csv"
    bad.write_bytes(b"# testbed profile\xff\xfe\n")
    assert main(["calibrate", "tables", "--profile", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "cannot read profile table" in err and len(err.splitlines()) == 1, err


@pytest.mark.slow  # ~3 min: the A100 fit the A40 borrows from, then the A40's
def test_calibrate_tables_a40_ends_with_a_report(tmp_path, capsys):
    assert main(["calibrate", "tables", "--device", "a40", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "no attention rows" in err and (tmp_path / "r" / "report.md").is_file()
