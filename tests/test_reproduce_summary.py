"""`testbed reproduce --verdicts`: one table of every study's full-size verdicts, each claim's baseline as run."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.base.errors import ConfigError
from testbed import reproduce as R
from testbed.cli import main
from testbed.reproduce.claims import ClaimResult, format_value
from testbed.reproduce.studies import MARKER
from testbed.reproduce.summary import LABELS, collect, counts_line
from testbed.reproduce.verdicts import VERDICT_TEXT, Verdict


def _result(root: Path, study: str, verdicts: dict[str, str], measured=None, **marker) -> None:
    """A finished study folder as `testbed reproduce <study>` leaves it (claims.json written by
    `ClaimResult.as_dict` + marker). `verdicts`: claim id -> category (default "direction", which a claim
    published without a number gets unsized, as `verdicts.verdict` gives it); `measured`: claim id -> value
    (default 1.25)."""
    folder = root / study
    folder.mkdir(parents=True)
    claims = [ClaimResult(c, (measured or {}).get(c.id, 1.25), 1.0,
                          Verdict(verdicts.get(c.id, "direction"), "", sized=c.claimed is not None), []).as_dict()
              for c in R.load_study(study).claims]
    (folder / "claims.json").write_text(json.dumps(claims))
    (folder / MARKER).write_text(json.dumps({"study": study, "quick": False, "state": "done",
                                             "commit": "abc1234", "overrides": [], **marker}))


def test_rows_name_each_claims_baseline_as_it_ran_and_the_counts_add_up(tmp_path):
    _result(tmp_path, "tdpipe-scaling", {"vs-tp-hb": "size", "superlinear-2to4": "none"})
    _result(tmp_path, "gllm-sensitivity", {})
    rows, notes = collect(tmp_path)
    scaling = [r for r in rows if r.study == "tdpipe-scaling"]
    assert [r.claim for r in scaling] == [c.text for c in R.load_study("tdpipe-scaling").claims]
    pp_sb = next(r for r in scaling if r.claim.startswith("TD-Pipe / PP+SB"))
    assert pp_sb.baseline == "PP+SB: `policy=vllm parallel.tp=1 parallel.pp=1,2,4`; gpus=4"
    assert pp_sb.published.startswith("up to 2.73x") and pp_sb.measured == "1.25x"
    hb = next(r for r in scaling if r.claim.startswith("TD-Pipe / PP+HB"))
    assert "policy.chunked_prefill=true policy.max_num_batched_tokens=512" in hb.baseline
    scale = next(r for r in scaling if "4-GPU / 2-GPU" in r.claim)
    assert scale.baseline == "TD-Pipe: `policy=tdpipe parallel.tp=1 parallel.pp=1,2,4`; gpus=2" and scale.verdict == LABELS[3]
    spread = [r for r in rows if r.study == "gllm-sensitivity"]
    assert spread and all(r.baseline == "-" for r in spread if "spread" in r.claim.lower())
    # a claim published without a number that held in direction is counted as such, not as "direction only"
    no_number = [c.id for c in R.load_study("gllm-sensitivity").claims if c.claimed is None and c.at_most is None]
    labels = {r.claim: r.verdict for r in spread}
    assert all(labels[c.text] != LABELS[1] for c in R.load_study("gllm-sensitivity").claims if c.id in no_number)
    line = counts_line(rows)
    assert line.startswith(f"{len(rows)} claims: ") and " 1 size / " in line and "/ 1 not reproduced /" in line
    assert any(n.startswith("gllm-rates: no full-size result") for n in notes)
    assert not any(n.startswith("tdpipe-scaling") for n in notes)


def test_a_run_with_overrides_or_unfinished_is_not_counted(tmp_path):
    _result(tmp_path, "gllm-rates", {}, overrides=["policy.T=16"])
    _result(tmp_path, "tdpipe-ablation", {}, state="interrupted")
    rows, notes = collect(tmp_path)
    assert rows == []
    assert "gllm-rates: run with overrides policy.T=16; not counted" in notes
    assert "tdpipe-ablation: its last run is interrupted, not done; not counted" in notes


def test_cli_writes_the_table_and_names_the_commit(tmp_path, capsys):
    _result(tmp_path, "gllm-capacity", {})
    assert main(["reproduce", "--verdicts", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    table = (tmp_path / "verdicts.md").read_text()
    assert table in out and "| gllm-capacity |" in table and "commit(s) of these results: abc1234" in table
    paper = R.load_study("gllm-capacity").paper
    assert f"| {paper} | 2 | 0 | 0 | 2 | 0 | 0 |" in table  # both claims have no published size


def test_bad_folder_and_stale_claims_are_one_error_line(tmp_path, capsys):
    assert main(["reproduce", "--verdicts", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no study results in") and "\n" not in err and "tdpipe-scaling" in err
    _result(tmp_path, "gllm-rates", {})
    claims = json.loads((tmp_path / "gllm-rates" / "claims.json").read_text())
    (tmp_path / "gllm-rates" / "claims.json").write_text(json.dumps(claims[1:]))
    assert main(["reproduce", "--verdicts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"has no claim {claims[0]['id']!r}" in err and "rerun `testbed reproduce gllm-rates`" in err


def test_each_value_is_printed_as_the_studys_report_prints_it(tmp_path):
    """The table's "testbed" column is `format_value` of the claim (ratio 1.25x, percent -67.3%, spread
    1.2%, plain value 0.667), for every claim of every study; a claim with no measurement reads n/a and
    is counted as not assessed."""
    value = {"spread": 0.012116, "value": 0.6667, "percent": 0.327}  # else 3.0568 (a ratio)
    measured, expect, missing = {}, {}, None
    for name in R.list_studies():
        study = R.load_study(name)
        measured[name] = {c.id: value.get(c.kind, value.get(c.show, 3.0568)) for c in study.claims}
        expect.update({(name, c.text): format_value(c, measured[name][c.id]) for c in study.claims})
        if name == "gllm-rates":
            missing = study.claims[0]
            measured[name][missing.id] = None
            expect[(name, missing.text)] = "n/a"
        verdicts = {missing.id: "n/a"} if name == "gllm-rates" else {}
        _result(tmp_path, name, verdicts, measured[name])
    rows, notes = collect(tmp_path)
    assert notes == [] and {(r.study, r.claim): r.measured for r in rows} == expect
    shown = set(expect.values())
    assert {"1.2%", "-67.3%", "3.06x", "0.667", "n/a"} <= shown  # a spread, a percent, a ratio, a value
    line = counts_line(rows)
    assert line.endswith(f" / 1 {VERDICT_TEXT['n/a']}") and sum(r.verdict == VERDICT_TEXT["n/a"] for r in rows) == 1


def test_the_counted_labels_are_every_label_a_verdict_can_have():
    every = {Verdict(category, "", sized=sized).label for category in VERDICT_TEXT for sized in (True, False)}
    assert set(LABELS) | {VERDICT_TEXT["n/a"]} == every and len(LABELS) == len(set(LABELS)) == len(every) - 1


def test_a_verdict_text_of_another_version_is_one_error_line(tmp_path, capsys):
    _result(tmp_path, "gllm-capacity", {})
    claims = json.loads((tmp_path / "gllm-capacity" / "claims.json").read_text())
    claims[0]["verdict_text"] = "reproduced, roughly"
    (tmp_path / "gllm-capacity" / "claims.json").write_text(json.dumps(claims))
    assert main(["reproduce", "--verdicts", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "'reproduced, roughly'" in err
    assert repr(LABELS[2]) in err and "rerun `testbed reproduce gllm-capacity`" in err
    with pytest.raises(ConfigError, match="another version of study gllm-capacity"):
        collect(tmp_path)
