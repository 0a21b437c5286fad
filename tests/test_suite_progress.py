"""The suite's header estimate from per-file times (issue 49 item 5, round two): tests/durations.csv,
written by scripts/refresh_test_durations.py from a real run's JUnit XML, read by tests/progress.py."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import progress

REPO = Path(__file__).resolve().parents[1]


def refresh_script():
    spec = importlib.util.spec_from_file_location("refresh_test_durations", REPO / "scripts" / "refresh_test_durations.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<properties><property name="load" value="{load}" /><property name="cores" value="2" /></properties>
<testcase classname="tests.test_kv" name="a" time="1.5" /><testcase classname="tests.test_kv" name="b" time="2.5" />
<testcase classname="tests.test_cli.TestX" name="c" time="7.0" /></testsuite></testsuites>"""


def test_a_files_pace_is_its_wall_time_over_its_runs_load_stretch(tmp_path):
    table = tmp_path / "durations.csv"
    table.write_text("# measured: today\n# cores: 2\nfile,tests,wall_s,load\n"
                     "tests/test_a.py,4,2.0,0.5\ntests/test_b.py,2,23.1,32\n")
    paces = progress.read_paces(table)
    assert paces.measured == "today"
    assert paces.per_file["tests/test_a.py"] == 0.5  # load 0.5 on 2 cores: no stretch
    assert abs(paces.per_file["tests/test_b.py"] - 23.1 / 2 / (0.7 * 33 / 2)) < 1e-9
    # a partial table: the other tests share what the measured fast set leaves
    known = 2.0 + 2 * paces.per_file["tests/test_b.py"]
    assert abs(paces.rest - (progress.FAST_SET_WALL_S - known) / (progress.FAST_SET_TESTS - 6)) < 1e-9
    est_a, _ = progress.estimate_s(["tests/test_a.py"] * 4, paces)
    est_new, _ = progress.estimate_s(["tests/test_new.py"] * 4, paces)
    assert est_new / est_a == paces.rest / 0.5  # the same load stretch on both


def test_a_table_that_does_not_parse_falls_back_to_the_mean_pace(tmp_path):
    table = tmp_path / "durations.csv"
    table.write_text("file,tests,wall_s\ntests/test_a.py,4,2.0\n")  # no load column
    assert progress.read_paces(table) == progress.Paces({}, "")
    assert progress.read_paces(tmp_path / "missing.csv").rest == progress.WALL_PER_TEST_S


def test_the_refresh_script_writes_the_table_from_a_junit_xml_and_merges(tmp_path, capsys):
    mod = refresh_script()
    xml, out = tmp_path / "run.xml", tmp_path / "durations.csv"
    xml.write_text(JUNIT.format(load="3.5"))
    assert mod.main([str(xml), "--out", str(out)]) == 0
    rows = [ln for ln in out.read_text().splitlines() if not ln.startswith("#")]
    assert rows == ["file,tests,wall_s,load", "tests/test_cli.py,1,7.00,3.5", "tests/test_kv.py,2,4.00,3.5"]
    paces = progress.read_paces(out)
    assert paces.per_file["tests/test_kv.py"] == 2.0 / progress.stretch_at(3.5, 2)
    out.write_text(out.read_text() + "tests/test_old.py,5,1.00,1.0\n")
    xml.write_text(JUNIT.format(load="9.0").replace("tests.test_cli.TestX", "tests.test_kv"))
    assert mod.main([str(xml), "--out", str(out), "--merge"]) == 0
    rows = [ln for ln in out.read_text().splitlines() if not ln.startswith("#")]
    assert rows == ["file,tests,wall_s,load", "tests/test_cli.py,1,7.00,3.5", "tests/test_kv.py,3,11.00,9.0",
                    "tests/test_old.py,5,1.00,1.0"]


def test_the_refresh_script_refuses_what_it_cannot_use(tmp_path, capsys):
    mod = refresh_script()
    assert mod.main([str(tmp_path / "none.xml")]) == 2
    bad = tmp_path / "bad.xml"
    bad.write_text("not xml")
    assert mod.main([str(bad)]) == 2
    bad.write_text(JUNIT.replace('<property name="load" value="{load}" />', ""))
    assert mod.main([str(bad), "--out", str(tmp_path / "t.csv")]) == 2
    err = capsys.readouterr().err
    assert [ln.split(":")[0] for ln in err.splitlines()] == ["error"] * 3 and "give --load and --cores" in err
    assert not (tmp_path / "t.csv").exists()


def test_the_shipped_table_parses_and_names_test_files_that_exist():
    paces = progress.read_paces()
    assert paces.per_file and paces.measured
    assert all((REPO / f).is_file() for f in paces.per_file)
