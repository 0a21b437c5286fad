"""Issue 47: a declared fit / validation / test split (testbed/calibrate/manifest.py), the rank
agreement of the policies (rank.py), stalls on every latency figure (stall_effects.py), the run's
clock starting after the policy prepared, and the CPU host's own cores in the simulator."""
from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from engine.pricing.hardware import get_hardware
from testbed.calibrate.manifest import MEASUREMENTS_DIR, load_manifest
from testbed.calibrate.rank import Replayed, kendall_tau, rank_table
from testbed.calibrate.stall_effects import stall_latency
from test_calibrate_runs import ENGINE_TERMS, _as_real_run

# the quiet campaign's options, chosen on its validation runs (mean |error| of throughput and mean TPOT:
# P=1 no table, hop receive 4.99% (link 5.05%); P=2 table, hop receive 5.37% (link 5.65%, no table 6.06%))
PP1_TABLE, PP1_HOP, PP2_TABLE, PP2_HOP = "0", "receive", "1", "receive"


# ---- rank agreement ----------------------------------------------------------------------------
def test_kendall_tau_b_orders_and_counts_engine_ties_as_neither():
    none = [[False] * 3 for _ in range(3)]
    assert kendall_tau([3, 2, 1], [30, 20, 10], none)[:3] == (1.0, 3, 0)
    assert kendall_tau([3, 2, 1], [10, 20, 30], none)[:3] == (-1.0, 0, 3)
    tied = [[False, True, False], [True, False, False], [False, False, False]]  # the engine can't order 0 and 1
    tau, conc, disc, ties = kendall_tau([3, 2, 1], [20, 30, 10], tied)
    assert (conc, disc, ties) == (2, 0, 1) and 0 < tau < 1


def _row(policy: str, tp: float, sim_tp: float, run: str) -> Replayed:
    return Replayed(run, "test", policy, "P=2 sharegpt offline", None, {"throughput_tok_s": tp},
                    {"throughput_tok_s": sim_tp})


def test_policies_whose_repeats_overlap_are_ties_and_any_order_of_them_agrees():
    rows = [_row("a", x, 100, f"a{i}") for i, x in enumerate((90, 100, 110))]
    rows += [_row("b", x, 95, f"b{i}") for i, x in enumerate((105, 115, 120))]  # overlaps a: a tie
    rows += [_row("c", x, 10, f"c{i}") for i, x in enumerate((50, 52, 51))]
    tp = next(t for t in rank_table(rows) if t["metric"] == "throughput")
    assert tp["agree"] and tp["engine_ties"] == 1 and tp["discordant"] == 0
    rows[-3:] = [_row("c", x, 200, f"c{i}") for i, x in enumerate((50, 52, 51))]  # the simulator puts c first
    tp = next(t for t in rank_table(rows) if t["metric"] == "throughput")
    assert not tp["agree"] and tp["discordant"] == 2


def test_a_metric_the_engine_ties_everywhere_is_no_order_and_not_counted():
    """SLO attainment 1.0 for every policy: nothing to agree with (it used to count as agreeing)."""
    from testbed.calibrate.rank import format_rank

    def metrics(tp: float, lat: float) -> dict:
        return {"throughput_tok_s": tp, "ttft_mean_s": lat, "tpot_mean_s": lat, "slo_attainment": 1.0}

    rows = [Replayed(f"{p}{i}", "test", p, "P=1 azure 3 req/s", None, metrics(tp + i, lat + i), metrics(sim, lat))
            for p, tp, sim, lat in (("a", 100, 90, 1), ("b", 50, 60, 5), ("c", 10, 70, 9)) for i in range(2)]
    table = rank_table(rows)
    slo = next(t for t in table if t["metric"] == "SLO attainment")
    tp = next(t for t in table if t["metric"] == "throughput")
    assert not slo["ordered"] and tp["ordered"] and not tp["agree"]
    text = format_rank(table, [])
    assert "2 of 3 (setting, metric) orders agree" in text and "1 more with every pair tied" in text


# ---- stalls on latency ---------------------------------------------------------------------------
def test_a_stall_lengthens_the_ttft_of_the_waiting_and_the_tpot_of_the_decoding(tmp_path):
    reqs = pd.DataFrame({"arrival_s": [0.0, 0.0], "first_token_s": [3.0, 0.5], "finish_s": [4.0, 4.5],
                         "ttft_s": [3.0, 0.5], "tpot_s": [0.1, 0.4], "num_generated": [11, 11],
                         "status": ["finished", "finished"]})
    reqs.to_csv(tmp_path / "requests.csv", index=False)
    got = stall_latency(tmp_path / "requests.csv", [(1.0, 2.0, 1.0)])  # 1 s stall between 1 and 2 s
    assert got["ttft_touched"] == 1 and got["tpot_touched"] == 1
    assert got["ttft_mean_without"] == pytest.approx((2.0 + 0.5) / 2)
    assert got["tpot_mean_without"] == pytest.approx((0.1 + 0.4 - 1.0 / 10) / 2)


# ---- the manifest ----------------------------------------------------------------------------------
def _manifest(tmp_path: Path, body: dict) -> Path:
    path = tmp_path / "m" / "manifest.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"runs": "runs", "profiles": body}))
    (path.parent / "runs").mkdir(exist_ok=True)
    return path


@pytest.mark.parametrize("body, message", [
    ({"p": {"fit": ["a"], "test": ["a"]}}, "run a is in both fit and test of p"),
    ({"p": {"fit": ["a"], "held_out": ["b"]}}, "profile p has held_out; valid keys"),
    ({"p": {"test": ["a"]}}, "profile p has no fit runs"),
    ({"p": {"fit": ["a"], "spent_test": ["a"]}}, "run a is in both fit and spent_test of p"),
    ({"p": {"fit": ["nowhere"]}}, "names runs not in"),
])
def test_a_bad_manifest_is_one_error_line(tmp_path, capsys, body, message):
    from testbed.cli import main

    (tmp_path / "m" / "runs" / "a").mkdir(parents=True)
    path = _manifest(tmp_path, body)
    assert main(["validate", "--runs", str(path), "hardware=h100-80g"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0]


def test_a_bad_output_path_fails_before_any_replay_and_logs_no_test_report(tmp_path, capsys):
    from testbed.cli import main

    for name in ("fit1", "test1"):
        (tmp_path / "m" / "runs" / name).mkdir(parents=True)  # empty: a replay would fail on them
    path = _manifest(tmp_path, {"p": {"base": "h100-80g", "fit": ["fit1"], "test": ["test1"]}})
    (tmp_path / "a-folder").mkdir()
    assert main(["validate", "--runs", str(path), "hardware=h100-80g", "--test",
                 "--errors-csv", str(tmp_path / "a-folder")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: invalid --errors-csv=") and "it is a folder" in err[0]
    assert not (path.parent / "test_reports.log").exists()


def test_calibrate_fits_the_fit_runs_only_and_validate_reports_the_test_runs_once(tmp_path, capsys, monkeypatch):
    from engine.pricing.hardware import HARDWARE
    from testbed.calibrate.fit import save_hardware_profile
    from testbed.cli import main

    truth = _as_real_run(tmp_path)
    path = _manifest(tmp_path, {"truth-split": {"base": "h100-80g", "fit": ["fit1"], "validation": ["val1"],
                                                "test": ["test1"]}})
    for name in ("fit1", "val1", "test1"):
        shutil.copytree(truth, path.parent / "runs" / name)
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(tmp_path / "profiles"))
    assert main(["calibrate", "runs", str(path), "--name", "split-fit", "--out", str(tmp_path / "profiles")]) == 0
    prov = yaml.safe_load((tmp_path / "profiles" / "split-fit.yaml").read_text())["profile"]
    assert [r["dir"] for r in prov["runs"]] == ["fit1"] and prov["split"] == "truth-split"
    exact = dataclasses.replace(get_hardware("h100-80g"), name="truth-terms",
                                calibration=dict(get_hardware("h100-80g").calibration, **ENGINE_TERMS))
    save_hardware_profile(exact, tmp_path / "profiles" / "truth-terms.yaml")
    try:
        capsys.readouterr()
        assert main(["validate", "--runs", str(path), "hardware=truth-terms", "--out", str(tmp_path / "v")]) == 0
        out = capsys.readouterr().out
        assert "validation runs" in out and "test runs" not in out.split("(test runs")[0]
        csv_path = tmp_path / "errors.csv"
        for _ in range(2):
            assert main(["validate", "--runs", str(path), "hardware=truth-terms", "--test", "--errors-csv",
                         str(csv_path), "--out", str(tmp_path / "v")]) == 0
        out = capsys.readouterr().out
    finally:
        HARDWARE.pop("truth-terms", None)
        HARDWARE.pop("split-fit", None)
    assert "first report of truth-split's test runs" in out and "reported before (1x)" in out
    assert len((path.parent / "test_reports.log").read_text().splitlines()) == 2
    rows = list(csv.DictReader(csv_path.open()))
    assert {r["run"] for r in rows} == {"fit1", "val1", "test1"} and {r["set"] for r in rows} == {"fit", "validation", "test"}
    tp = next(r for r in rows if r["run"] == "test1" and r["metric"] == "throughput_tok_s")
    assert abs(float(tp["error"])) < 1e-6 and float(tp["predicted"]) == pytest.approx(float(tp["actual"]), rel=1e-5)
    # a refit is tested on new runs: the reported ones are spent, and the new test set's first report says so
    path.write_text(yaml.safe_dump({"runs": "runs", "profiles": {"truth-split": {
        "base": "h100-80g", "fit": ["fit1"], "validation": ["val1"], "spent_test": ["test1"], "test": ["test2"]}}}))
    shutil.copytree(truth, path.parent / "runs" / "test2")
    save_hardware_profile(exact, tmp_path / "profiles" / "truth-terms.yaml")
    try:
        capsys.readouterr()
        assert main(["validate", "--runs", str(path), "hardware=truth-terms", "--test", "--errors-csv",
                     str(csv_path), "--out", str(tmp_path / "v")]) == 0
        out = capsys.readouterr().out
    finally:
        HARDWARE.pop("truth-terms", None)
    assert "first report of truth-split's test runs" in out
    assert {r["run"] for r in csv.DictReader(csv_path.open())} == {"fit1", "val1", "test2"}
    assert "test_set=" in (path.parent / "test_reports.log").read_text().splitlines()[-1]


@pytest.mark.parametrize("folder", ["cpu-tiny-llama", "cpu-tiny-llama-2026-11-28"])
def test_the_shipped_cpu_profiles_are_fitted_on_their_manifests_fit_runs_only(folder):
    """measurements/<folder>/: every run the manifest names is in the archive, and each fitted
    profile beside it was fitted on exactly its split's fit runs (provenance)."""
    m = load_manifest(MEASUREMENTS_DIR / folder / "manifest.yaml")
    for name, split in m.profiles.items():
        assert len(split.runs()) == len(set(split.runs())) >= 30
        assert {r.split('-')[2] for r in split.test} == {"gllm", "sarathi", "vllm", "molink", "sipipe", "tdpipe"}
        prov = yaml.safe_load((m.path.parent / "profiles" / f"{name}.yaml").read_text())["profile"]
        assert sorted(r["dir"] for r in prov["runs"]) == sorted(split.fit)
        assert json.loads((m.run_dir(split.test[0]) / "summary.json").read_text())["num_finished"] == 100


# ---- the run's clock and the host's cores ------------------------------------------------------------
def test_the_clock_starts_after_the_policy_prepares():
    from engine.core.controller import Controller
    from engine.core.executor import Executor
    from engine.core.kv import BlockManager
    from engine.core.trace import Tracer
    from toy_policy import ToyFcfsPolicy

    calls = []

    class Recorder(Executor):
        pipeline_depth, tracer = 1, Tracer()

        def launch(self, mb): ...
        def next_completion(self, deadline=None): return None
        def now(self): return 0.0
        def wait_until(self, t): ...
        def start(self): calls.append("executor.start")
        def start_clock(self): calls.append("start_clock")

    class Preparing(ToyFcfsPolicy):
        def start(self, view): calls.append("policy.start")

    Controller([], Preparing(), Recorder(), BlockManager(16, 4)).start()
    assert calls == ["executor.start", "policy.start", "start_clock"]


def test_on_a_cpu_device_overlapped_preparation_is_priced_serially():
    """SiPipe's overlapped input preparation runs on the cores the CPU engine's forward uses."""
    from conftest import small_config
    from testbed.run.runner import run_experiment

    base = ("policy=sipipe", "parallel.pp=2", "workload.num_requests=30", "model=tiny-llama",
            "cost.prep_fixed_s=0.004")
    free = run_experiment(small_config(*base)).summary["throughput_tok_s"]
    shared = run_experiment(small_config(*base, "executor.host_device=true")).summary["throughput_tok_s"]
    assert shared < free * 0.99


@pytest.mark.slow
@pytest.mark.parametrize("folder, name, option, hop", [
    ("cpu-tiny-llama", "cpu-tiny-llama-pp1-runs", "0", "link"), ("cpu-tiny-llama", "cpu-tiny-llama-pp2-runs", "1", "link"),
    ("cpu-tiny-llama-2026-11-28", "cpu-tiny-llama-quiet-pp1-runs", PP1_TABLE, PP1_HOP),
    ("cpu-tiny-llama-2026-11-28", "cpu-tiny-llama-quiet-pp2-runs", PP2_TABLE, PP2_HOP)])
def test_the_shipped_cpu_profiles_refit_exactly_from_the_repository(tmp_path, folder, name, option, hop):
    from testbed.cli import main

    manifest = MEASUREMENTS_DIR / folder / "manifest.yaml"
    assert main(["calibrate", "runs", str(manifest), "--profile", name, "--table-option", option, "--hop", hop,
                 "--name", name, "--out", str(tmp_path)]) == 0
    fitted = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
    shipped = yaml.safe_load((manifest.parent / "profiles" / f"{name}.yaml").read_text())
    for key in set(shipped) - {"profile", "version"}:
        assert fitted[key] == shipped[key], key
    assert fitted["profile"]["errors"] == shipped["profile"]["errors"]
