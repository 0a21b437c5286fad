"""A manifest's `runs:` as a list of archives (testbed/calibrate/manifest.py, scripts/pack_runs.py):
unpacked in order into one tree, a later archive adding runs or files (a fit run's trace.json); a
test set declared before it is taken names an archive not there yet, and only its test runs may be
missing until then."""
from __future__ import annotations

import importlib.util
import io
import json
import lzma
import tarfile
from pathlib import Path

import pytest
import yaml

from engine.base.errors import ConfigError
from testbed.calibrate.manifest import load_manifest
from testbed.calibrate.manifest import test_set_id as set_id_of

ROOT = Path(__file__).resolve().parents[1]


def _archive(path: Path, files: dict[str, str]) -> None:
    with lzma.open(path, "wb") as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))


def _manifest(folder: Path, runs, test=("t1",)) -> Path:
    path = folder / "manifest.yaml"
    path.write_text(yaml.safe_dump({"runs": runs, "profiles": {"p": {"fit": ["f1"], "validation": ["v1"],
                                                                    "test": list(test)}}}))
    return path


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    _archive(tmp_path / "m" / "a.tar.xz", {"runs/f1/summary.json": "{}", "runs/v1/summary.json": "{}"})
    _archive(tmp_path / "m" / "b.tar.xz", {"runs/f1/trace.json": "[]"})
    return tmp_path / "m"


def test_later_archives_add_files_and_an_absent_one_may_hold_only_test_runs(folder):
    m = load_manifest(_manifest(folder, ["a.tar.xz", "b.tar.xz", "c.tar.xz"]))
    assert m.absent == ("c.tar.xz",)
    assert (m.run_dir("f1") / "summary.json").is_file() and (m.run_dir("f1") / "trace.json").is_file()
    assert not m.run_dir("t1").exists()
    _archive(folder / "c.tar.xz", {"runs/t1/summary.json": json.dumps({"num_finished": 100})})
    m = load_manifest(_manifest(folder, ["a.tar.xz", "b.tar.xz", "c.tar.xz"]))
    assert m.absent == () and (m.run_dir("t1") / "summary.json").is_file()


def test_an_absent_archive_does_not_excuse_a_missing_fit_or_validation_run(folder):
    path = folder / "manifest.yaml"
    path.write_text(yaml.safe_dump({"runs": ["a.tar.xz", "c.tar.xz"], "profiles": {"p": {
        "fit": ["f1"], "validation": ["v2"], "test": ["t1"]}}}))
    with pytest.raises(ConfigError, match="names runs not in.*v2"):
        load_manifest(path)
    with pytest.raises(ConfigError, match="names runs not in.*t1"):  # one archive: nothing is excused
        load_manifest(_manifest(folder, "a.tar.xz"))


def test_a_set_declared_before_any_run_was_packed_says_so(folder, capsys):
    from testbed.cli import main

    path = _manifest(folder, ["x.tar.xz", "y.tar.xz"])
    with pytest.raises(ConfigError, match=r"none of its archives exists yet \(x.tar.xz, y.tar.xz\).*pack_runs.py"):
        load_manifest(path)
    assert main(["validate", "--runs", str(path), "hardware=h100-80g"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: manifest") and "none of its archives exists yet" in err[0]


def test_validate_test_says_the_test_runs_are_not_packed_yet(folder, capsys):
    from testbed.cli import main

    path = _manifest(folder, ["a.tar.xz", "b.tar.xz", "c.tar.xz"])
    assert main(["validate", "--runs", str(path), "hardware=h100-80g", "--test"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not packed yet (c.tar.xz missing): t1" in err[0]


def test_pack_runs_packs_into_the_named_archive_only_what_the_others_lack(folder, tmp_path):
    spec = importlib.util.spec_from_file_location("pack_runs", ROOT / "scripts" / "pack_runs.py")
    pack_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pack_runs)
    src = tmp_path / "src"
    for run, files in {"f1": ("summary.json", "trace.json"), "t1": ("summary.json", "trace.json")}.items():
        (src / run).mkdir(parents=True)
        for f in files:
            (src / run / f).write_text("{}")
    path = _manifest(folder, ["a.tar.xz", "b.tar.xz", "c.tar.xz"])
    out = pack_runs.pack(path, src, "c.tar.xz")
    with tarfile.open(out) as tar:  # f1's files are in a and b; t1 is a test run: no trace kept
        assert tar.getnames() == ["runs/t1/summary.json"]
    with pytest.raises(SystemExit):
        pack_runs.pack(path, src)  # several archives: the one to pack must be named


# ---- sets 5-11's profiles (measurements/cpu-tiny-llama-2026-11-28/manifest-set{5,...,11}.yaml) -----------
MEASURED = ROOT / "measurements" / "cpu-tiny-llama-2026-11-28"
SET5 = MEASURED / "manifest-set5.yaml"
SET6 = MEASURED / "manifest-set6.yaml"
SET7 = MEASURED / "manifest-set7.yaml"
SET8 = MEASURED / "manifest-set8.yaml"
SET9 = MEASURED / "manifest-set9.yaml"
SET10 = MEASURED / "manifest-set10.yaml"
SET11 = MEASURED / "manifest-set11.yaml"
SET12 = MEASURED / "manifest-set12.yaml"
SET13 = MEASURED / "manifest-set13.yaml"
SET15 = MEASURED / "manifest-set15.yaml"
SET16 = MEASURED / "manifest-set16.yaml"  # set 13's design on the engine with the column-major CPU head
SET14 = MEASURED / "manifest-set14.yaml"  # set 13's frozen profiles tested on a later campaign: no refit
SET17 = MEASURED / "manifest-set17.yaml"  # set 16's runs, --mixed-by-rows a candidate (lost), tested on r47-r49
SET18 = MEASURED / "manifest-set18.yaml"  # set 16's runs, --sampler-contention a candidate (won at P=2), r50-r52
SET19 = MEASURED / "manifest-set19.yaml"  # set 18's frozen profiles tested on a later campaign (r53-r55): no refit
# the options each profile's validation runs chose: the quick-table option and any further flags (set 5:
# 3.30% / 4.58%, docs/measurements/diag-cpu-2026-11-28b.md; set 6: 2.11% / 2.39%,
# docs/measurements/real-runs-2026-11-28c.md; set 7: 2.28% / 1.62%, P=2 with --inflight-handover,
# docs/measurements/real-runs-2026-11-28d.md; set 8, fitted on set 7's six repeats: 1.897% / 1.927%, P=2 with the
# table and --inflight-handover, both predicted with `validate --spread 0.05`; set 9, fitted on set 8's r7-r9 with
# set 8's options: spread 0.05 at P=1 (1.948%), none at P=2 (2.290%), docs/measurements/real-runs-2026-11-28e.md;
# set 10, set 9's fit chosen again on r7-r12: no decode-by-batch, no spread at both depths (1.939% / 2.965%); set 11,
# fitted on this machine's r13-r15: P=1 --decode-by-batch (1.677%), P=2 spread 0.05 (2.182%),
# docs/measurements/real-runs-2026-11-28f.md; set 12, fit and test interleaved in one campaign: P=1 as fitted (1.812%),
# P=2 --decode-by-batch, spread 0.025 (2.076%); set 13, the same design on the warmed engine: --decode-by-batch at
# both depths, no spread (1.349% / 2.245%); set 15, set 13's design repeated: --decode-by-batch at both depths,
# spread 0.05 at P=1 (2.242%), none at P=2 (1.951%); set 16, the same design on the engine with the column-major CPU
# head and its own quick tables as bases: --decode-by-batch at both depths, spread 0.05 at P=1 (3.065%), 0.025 at P=2
# (2.759%); set 17, set 16's runs with --mixed-by-rows a candidate: it lost, set 16's choices again; set 18, set 16's
# runs with --sampler-contention a candidate: it fits to 0 at P=1 (set 16's choice again), and won at P=2, spread
# 0.025 (2.631%))
FIT_OPTIONS = {"cpu-tiny-llama-set5-pp1-runs": (SET5, "1", ()), "cpu-tiny-llama-set5-pp2-runs": (SET5, "0", ()),
               "cpu-tiny-llama-set6-pp1-runs": (SET6, "0", ()), "cpu-tiny-llama-set6-pp2-runs": (SET6, "1", ()),
               "cpu-tiny-llama-set7-pp1-runs": (SET7, "0", ()),
               "cpu-tiny-llama-set7-pp2-runs": (SET7, "0", ("--inflight-handover",)),
               "cpu-tiny-llama-set8-pp1-runs": (SET8, "0", ()),
               "cpu-tiny-llama-set8-pp2-runs": (SET8, "1", ("--inflight-handover",)),
               "cpu-tiny-llama-set9-pp1-runs": (SET9, "0", ()),
               "cpu-tiny-llama-set9-pp2-runs": (SET9, "0", ("--inflight-handover",)),
               "cpu-tiny-llama-set10-pp1-runs": (SET10, "0", ()),
               "cpu-tiny-llama-set10-pp2-runs": (SET10, "0", ("--inflight-handover",)),
               "cpu-tiny-llama-set11-pp1-runs": (SET11, "0", ("--decode-by-batch",)),
               "cpu-tiny-llama-set11-pp2-runs": (SET11, "0", ("--inflight-handover",)),
               "cpu-tiny-llama-set12-pp1-runs": (SET12, "0", ()),
               "cpu-tiny-llama-set12-pp2-runs": (SET12, "0", ("--inflight-handover", "--decode-by-batch")),
               "cpu-tiny-llama-set13-pp1-runs": (SET13, "0", ("--decode-by-batch",)),
               "cpu-tiny-llama-set13-pp2-runs": (SET13, "0", ("--inflight-handover", "--decode-by-batch")),
               "cpu-tiny-llama-set15-pp1-runs": (SET15, "0", ("--decode-by-batch",)),
               "cpu-tiny-llama-set15-pp2-runs": (SET15, "0", ("--inflight-handover", "--decode-by-batch")),
               "cpu-tiny-llama-set16-pp1-runs": (SET16, "0", ("--decode-by-batch",)),
               "cpu-tiny-llama-set16-pp2-runs": (SET16, "0", ("--inflight-handover", "--decode-by-batch")),
               "cpu-tiny-llama-set17-pp1-runs": (SET17, "0", ("--decode-by-batch",)),
               "cpu-tiny-llama-set17-pp2-runs": (SET17, "0", ("--inflight-handover", "--decode-by-batch")),
               "cpu-tiny-llama-set18-pp1-runs": (SET18, "0", ("--decode-by-batch",)),
               "cpu-tiny-llama-set18-pp2-runs": (SET18, "0", ("--inflight-handover", "--decode-by-batch",
                                                              "--sampler-contention"))}
REPEATS = {SET5: ((1, 2, 3, 4), (5, 6, 7)), SET6: ((1, 2, 3), (4, 5, 6)),
           SET7: ((1, 2, 3), (4, 5, 6)), SET8: ((1, 2, 3, 4, 5, 6), (7, 8, 9)),
           SET9: ((7, 8, 9), (10, 11, 12)), SET10: ((7, 8, 9, 10, 11, 12), (13, 14, 15)),
           SET11: ((13, 14, 15), (16, 17, 18)), SET12: ((19, 21, 23), (20, 22, 24)),
           SET13: ((25, 27, 29), (26, 28, 30)), SET14: ((25, 27, 29), (31, 32, 33)),
           SET15: ((35, 37, 39), (36, 38, 40)), SET16: ((41, 43, 45), (42, 44, 46)),
           SET17: ((41, 43, 45), (47, 48, 49)), SET18: ((41, 43, 45), (50, 51, 52)),
           SET19: ((41, 43, 45), (53, 54, 55))}  # (fit and validation, test)


@pytest.mark.parametrize("manifest", sorted(REPEATS), ids=lambda p: p.stem)
def test_each_sets_profiles_are_fitted_on_their_fit_runs_only_and_tested_on_later_repeats(manifest):
    seen, test = REPEATS[manifest]
    m = load_manifest(manifest)
    for name, split in m.profiles.items():
        assert {r.rsplit("-", 1)[1] for r in split.fit + split.validation} == {f"r{r}" for r in seen}
        assert sorted(split.test) == sorted(f"pp{name[-6]}-{w}-{p}-r{r}" for w in ("sharegpt", "azlo", "azhi")
                                            for p in ("gllm", "sarathi", "vllm", "molink", "sipipe", "tdpipe")
                                            for r in test)
        prov = yaml.safe_load((m.path.parent / "profiles" / f"{name}.yaml").read_text())["profile"]
        assert sorted(r["dir"] for r in prov["runs"]) == sorted(split.fit)
        assert all((m.run_dir(r) / "trace.json").is_file() for r in split.fit)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIT_OPTIONS))
def test_each_sets_profiles_refit_exactly_from_the_repository(tmp_path, name):
    from testbed.cli import main

    manifest, option, flags = FIT_OPTIONS[name]
    assert main(["calibrate", "runs", str(manifest), "--profile", name, "--table-option", option,
                 "--hop", "receive", *flags, "--name", name, "--out", str(tmp_path)]) == 0
    fitted = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
    shipped = yaml.safe_load((manifest.parent / "profiles" / f"{name}.yaml").read_text())
    for key in set(shipped) - {"profile", "version"}:
        assert fitted[key] == shipped[key], key
    assert fitted["profile"]["errors"] == shipped["profile"]["errors"]


def test_set14_tests_set13s_frozen_profiles_on_new_runs_only():
    """Set 14 refits nothing: its profiles are set 13's, fitted and chosen on set 13's runs, and set 13's test
    runs are spent (neither fitted on, chosen on nor reported again)."""
    m13, m14 = load_manifest(SET13), load_manifest(SET14)
    assert set(m14.profiles) == set(m13.profiles)
    for name, split in m14.profiles.items():
        old = m13.profiles[name]
        assert (split.fit, split.validation, split.spent_test) == (old.fit, old.validation, old.test)
        assert not set(split.test) & set(old.test + old.fit + old.validation)
        assert split.options["decode_by_batch"] == [True] and split.options["spread"] == [0.0]
        assert all(m14.run_dir(r).is_dir() for r in split.test)
    log = (SET14.parent / "test_reports.log").read_text()
    assert sum(f"{name} " in ln and f"test_set={set_id_of(m14.profiles[name])}" in ln
               for name in m14.profiles for ln in log.splitlines()) == 2  # each reported once


def test_set17_refits_set16s_runs_and_tests_its_choice_on_new_runs_only():
    """Set 17 fits and chooses on set 16's fit and validation runs (its candidate --mixed-by-rows lost), so its
    profiles price as set 16's; set 16's test runs are spent, set 17's are new and reported once."""
    m16, m17 = load_manifest(SET16), load_manifest(SET17)
    for name, split in m17.profiles.items():
        old = m16.profiles[name.replace("set17", "set16")]
        assert (split.fit, split.validation, split.spent_test) == (old.fit, old.validation, old.test)
        assert not set(split.test) & set(old.test + old.fit + old.validation)
        assert split.options["mixed_by_rows"] == [False, True] and split.options["decode_by_batch"] == [True]
        shipped = [yaml.safe_load((SET17.parent / "profiles" / f"{n}.yaml").read_text())
                   for n in (name, name.replace("set17", "set16"))]
        assert shipped[0]["calibration"] == shipped[1]["calibration"]
        assert "mixed_row_extra_s" not in shipped[0]["calibration"]
        assert all(m17.run_dir(r).is_dir() for r in split.test)
    log = (SET17.parent / "test_reports.log").read_text()
    assert sum(f"{name} " in ln and f"test_set={set_id_of(m17.profiles[name])}" in ln
               for name in m17.profiles for ln in log.splitlines()) == 2  # each reported once


def test_set18_fits_set16s_runs_with_its_chosen_term_and_spends_both_earlier_test_sets():
    """Set 18 fits and chooses on set 16's fit and validation runs; its candidate --sampler-contention fits to 0 at
    P=1 (set 16's profile again) and carries a term at P=2; set 16's and set 17's test runs are spent."""
    m16, m17, m18 = load_manifest(SET16), load_manifest(SET17), load_manifest(SET18)
    for name, split in m18.profiles.items():
        old, spent = m16.profiles[name.replace("set18", "set16")], m17.profiles[name.replace("set18", "set17")]
        assert (split.fit, split.validation) == (old.fit, old.validation)
        assert split.spent_test == old.test + spent.test
        assert not set(split.test) & set(split.spent_test + old.fit + old.validation)
        assert split.options["sampler_contention"] == [False, True] and split.options["mixed_by_rows"] == [False]
        shipped = [yaml.safe_load((SET18.parent / "profiles" / f"{n}.yaml").read_text())["calibration"]
                   for n in (name, name.replace("set18", "set16"))]
        if name.endswith("pp1-runs"):
            assert shipped[0] == shipped[1]
        else:
            assert shipped[0]["cpu_sample_per_busy_stage_s"] > 0 and "cpu_sample_per_busy_stage_s" not in shipped[1]
        assert all(m18.run_dir(r).is_dir() for r in split.test)
    log = (SET18.parent / "test_reports.log").read_text()
    assert sum(f"{name} " in ln and f"test_set={set_id_of(m18.profiles[name])}" in ln
               for name in m18.profiles for ln in log.splitlines()) == 2  # each reported once


def test_set19_tests_set18s_frozen_profiles_on_new_runs_only():
    """Set 19 refits nothing: its profiles are set 18's with the options set 18's validation chose, and every
    earlier test set of those profiles (sets 16-18) is spent."""
    m18, m19 = load_manifest(SET18), load_manifest(SET19)
    assert set(m19.profiles) == set(m18.profiles)
    for name, split in m19.profiles.items():
        old = m18.profiles[name]
        assert (split.fit, split.validation, split.spent_test) == (old.fit, old.validation, old.spent_test + old.test)
        assert not set(split.test) & set(split.spent_test + old.fit + old.validation)
        chosen = {"pp1": ([False], [0.05]), "pp2": ([True], [0.025])}[name.split("-")[-2]]
        assert (split.options["sampler_contention"], split.options["spread"]) == chosen
        assert all(m19.run_dir(r).is_dir() for r in split.test)
    log = (SET19.parent / "test_reports.log").read_text()
    assert sum(f"{name} " in ln and f"test_set={set_id_of(m19.profiles[name])}" in ln
               for name in m19.profiles for ln in log.splitlines()) == 2  # each reported once


def test_a_micro_batch_launched_behind_another_is_timed_from_that_ones_completion():
    import pandas as pd

    from testbed.calibrate.offline import own_times

    mbs = pd.DataFrame({"mb_id": [0, 1, 2, 3], "scheduled_s": [0.0, 0.01, 0.5, 0.6],
                        "completed_s": [0.40, 0.42, 0.55, 0.9]})
    got = own_times(mbs)  # mb 1 waited behind mb 0's 0.4 s prefill: its own time is 0.02 s
    assert got == pytest.approx({0: 0.40, 1: 0.02, 2: 0.05, 3: 0.30})
