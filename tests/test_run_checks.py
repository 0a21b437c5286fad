"""`calibrate runs` and `validate --runs` check every file they read (issue 48 items 2 and 3): one
`error:` line naming the file and its row, exit 2, before any fit; outputs checked first. Each case
below was a traceback or a silent accept on the old code (noted per case)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from test_calibrate_runs import _as_real_run
from testbed.cli import main


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """One traced run folder, as the torch engine writes it (simulated, with sampled ids)."""
    return _as_real_run(tmp_path_factory.mktemp("real"))


def _copy(real_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(real_run, tmp_path / "run"))


def _edit_csv(path: Path, row: int, col: str, value) -> None:
    df = pd.read_csv(path, dtype={"output_token_ids": str})
    df[col] = df[col].astype(object)
    df.loc[row, col] = value
    df.to_csv(path, index=False)


def _fit(run: Path, tmp_path: Path, *extra: str) -> list[str]:
    return ["calibrate", "runs", str(run), "--name", "x", "--base", "h100-80g", "--out", str(tmp_path / "p"), *extra]


def _one_error(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err[-2000:]
    for n in needles:
        assert n in " ".join(err.split()), err
    return err


@pytest.mark.parametrize("file, row, col, value, needle", [
    ("microbatches.csv", 3, "completed_s", 1e300, "row 4: completed_s=1e+300"),  # old: profile with 1.25e297, exit 0
    ("microbatches.csv", 2, "completed_s", float("nan"), "row 3: completed_s=nan"),
    ("microbatches.csv", 5, "scheduled_s", -1.0, "row 6: scheduled_s=-1.0"),  # old: accepted
    ("microbatches.csv", 1, "kind", "bogus", "kind='bogus'"),
    ("requests.csv", 0, "prompt_len", 10**15, "row 1: prompt_len"),  # old: MemoryError traceback
    ("requests.csv", 4, "arrival_s", "soon", "arrival_s='soon'"),
])
def test_a_bad_value_names_its_file_and_row(real_run, tmp_path, capsys, file, row, col, value, needle):
    run = _copy(real_run, tmp_path)
    _edit_csv(run / file, row, col, value)
    _one_error(capsys, main(_fit(run, tmp_path)), file, needle)
    assert not (tmp_path / "p" / "x.yaml").exists()


def test_a_cut_or_header_only_table_is_one_line(real_run, tmp_path, capsys):
    """Old: a traceback from deep in the replay."""
    run = _copy(real_run, tmp_path)
    head = (run / "microbatches.csv").read_text().splitlines()[0]
    (run / "microbatches.csv").write_text(head + "\n")
    _one_error(capsys, main(_fit(run, tmp_path)), "microbatches.csv", "has no rows")
    (run / "microbatches.csv").write_text(head + "\n0,0.1,0.2,pre")
    _one_error(capsys, main(_fit(run, tmp_path)), "microbatches.csv")


def test_negative_and_nan_span_durations_are_refused(real_run, tmp_path, capsys):
    """Old: a traceback (negative or NaN durations in trace.json)."""
    import json

    run = _copy(real_run, tmp_path)
    trace = json.loads((run / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    spans[3]["dur"] = -5.0
    (run / "trace.json").write_text(json.dumps(trace))
    _one_error(capsys, main(_fit(run, tmp_path)), "trace.json event", "dur=-5.0")


def test_a_simulated_run_edited_to_say_torch_is_not_real(real_run, tmp_path, capsys):
    """Old: fitted as real (the executor field was the only check)."""
    run = _copy(real_run, tmp_path)
    _edit_csv(run / "requests.csv", slice(None), "output_token_ids", "")
    _one_error(capsys, main(_fit(run, tmp_path)), "no sampled token ids")


def test_a_config_that_is_not_the_runs_is_refused(real_run, tmp_path, capsys):
    """Old: accepted without a word (request count, block size, unknown keys)."""
    run = _copy(real_run, tmp_path)
    tree = yaml.safe_load((run / "config.yaml").read_text())
    tree["workload"]["num_requests"] = 61
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    _one_error(capsys, main(_fit(run, tmp_path)), "workload.num_requests=61", "requests.csv has 60")
    tree["workload"]["num_requests"] = 60
    tree["kv"]["block_size"] = 32
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    _one_error(capsys, main(_fit(run, tmp_path)), "kv.block_size=32", "run_info.json")
    tree["kv"]["block_size"] = 16
    tree["bogus"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(tree))
    _one_error(capsys, main(_fit(run, tmp_path)), "unknown key(s) bogus")


def test_names_outputs_and_repeats(real_run, tmp_path, capsys):
    """`--name ../../evil` wrote outside --out; a file --out was a traceback after the fit; the same
    run twice was fitted twice; a non-UTF-8 --table was a traceback (all old)."""
    _one_error(capsys, main(_fit(real_run, tmp_path, "--name", "../../evil")), "invalid --name='../../evil'")
    (tmp_path / "file").write_text("")
    argv = _fit(real_run, tmp_path)
    argv[argv.index("--out") + 1] = str(tmp_path / "file")
    _one_error(capsys, main(argv), "invalid --out=", "a file, not a folder")
    argv = _fit(real_run, tmp_path)
    _one_error(capsys, main(argv[:3] + [str(real_run)] + argv[3:]), "given twice")
    (tmp_path / "t.csv").write_bytes(b"\xff\xfe\x00bad")
    _one_error(capsys, main(_fit(real_run, tmp_path, "--table", str(tmp_path / "t.csv"))), "cannot read profile table")
    code = main(["validate", "--runs", str(real_run), str(real_run), "hardware=h100-80g", "--out", str(tmp_path / "v")])
    _one_error(capsys, code, "given twice")
