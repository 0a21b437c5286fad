"""`testbed reproduce`: every study runs in --quick mode and writes its report (claim table,
verdict lines, figures, MLflow runs); the verdict rules on hand-made numbers; where user overrides
go."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.core.policy import POLICIES
from mlflow_db import fresh_mlflow_db
from testbed import reproduce as R
from testbed.cli import main

import policies  # noqa: F401  (registers every policy)

VERDICT_LABELS = set(R.VERDICT_TEXT.values()) | {"reproduced in direction (no size published)"}
STUDIES = ["tdpipe-scaling", "tdpipe-ablation", "gllm-rates", "gllm-sensitivity", "sipipe-ablation", "molink-tables"]
# the two longest quick studies (15 s and 11 s of CPU) run with `-m slow` (issue 25 item 15)
QUICK_SET = [pytest.param(s, marks=pytest.mark.slow) if s in ("tdpipe-scaling", "molink-tables") else s for s in STUDIES]


def run_quick(study: str, tmp_path: Path, capsys, *extra: str) -> tuple[Path, str]:
    fresh_mlflow_db(tmp_path)
    code = main(["reproduce", study, "--quick", f"output.dir={tmp_path}", "output.progress=false", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    report = Path(out.out.strip().splitlines()[-1])
    assert report == (tmp_path / "reproduce" / f"{study}-quick" / "report.md").resolve()
    return report, out.err


@pytest.mark.parametrize("study", QUICK_SET)
def test_every_study_runs_quick_and_writes_its_report(study, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    report, _ = run_quick(study, tmp_path, capsys)
    text = report.read_text()
    spec = R.load_study(study)
    # the claim table: published claim beside the testbed's number, and a verdict per claim
    assert "| claim | published (paper) | claimed | testbed | verdict |" in text
    table = text.split("## Claims: published vs testbed", 1)[1].split("### Verdicts", 1)[0]
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| claim |")]
    assert len(rows) == len(spec.claims)
    for claim, row in zip(spec.claims, rows):
        assert claim.published in row
        assert row.rstrip(" |").rsplit("| ", 1)[-1] in VERDICT_LABELS
    verdicts = re.findall(r"^- \*\*([^*]+)\*\*: ([^:]+):", text, flags=re.M)
    assert [v[0] for v in verdicts] == [c.id for c in spec.claims]
    assert all(label in VERDICT_LABELS for _, label in verdicts)
    claims = json.loads((report.parent / "claims.json").read_text())
    assert [c["id"] for c in claims] == [c.id for c in spec.claims]
    measured = [c for c in claims if c["verdict"] != "n/a"]
    assert measured, "no claim could be assessed in quick mode"
    # figures: every embedded image exists
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert images and all((report.parent / p).stat().st_size > 0 for p in images)
    assert (report.parent / "table.csv").is_file() and "## Results" in text
    # MLflow: one parent run for the study, one nested run per distinct point, under its own experiment
    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    exp = client.get_experiment_by_name(f"reproduce-{study}-quick")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.data.tags.get("testbed.reproduce") == study]
    assert len(parents) == 1
    info = json.loads((report.parent / "reproduce.json").read_text())
    assert info["state"] == "done" and len(runs) == 1 + info["runs"]
    assert info["overrides"] == [] and info["commit"]  # output.* keys move no result: not recorded as overrides
    assert all(r.data.tags.get("testbed.parent_run") == parents[0].info.run_id
               and "mlflow.parentRunId" not in r.data.tags for r in runs if r not in parents)
    assert {a.path for a in client.list_artifacts(parents[0].info.run_id)} >= {"report.md", "table.csv", "figures"}
    if study == "tdpipe-scaling":  # 1 GPU: neither model fits; a row "does not fit", like the paper, not a crash
        import pandas as pd

        table = pd.read_csv(report.parent / "table.csv")
        assert set(table[table["gpus"] == 1]["status"]) == {"does not fit"}
        assert set(table[table["gpus"] > 1]["status"]) == {"finished"}
        assert "| does not fit |" in text


def test_list_names_every_study(capsys):
    assert main(["reproduce", "--list"]) == 0
    out = capsys.readouterr().out
    for name in ("tdpipe-scaling", "tdpipe-ablation", "gllm-rates", "gllm-sensitivity", "sipipe-ablation",
                 "molink-tables"):
        assert re.search(rf"^{name}\s", out, flags=re.M), name
    assert set(R.list_studies()) >= {"tdpipe-scaling", "molink-tables"}
    assert (R.studies_dir() / "gllm-rates.yaml").is_file()  # packaged next to the module


@pytest.mark.parametrize("args, needle", [
    (["nope"], "unknown study 'nope'; valid choices: chunked-pp, gllm-capacity, gllm-rates"),
    ([], "name a study"),
    (["gllm-rates", "policy.TT=3"], "no policy of study gllm-rates has parameter 'TT'"),
    (["gllm-rates", "policy.T=3,4"], "a comma list is allowed only for a key that is already an axis"),
    (["gllm-rates", "policy=vllm"], "would replace every system of study gllm-rates"),
    (["gllm-rates", "hardware=tpu"], "unknown hardware 'tpu'"),
    (["gllm-rates", "workload.ratee=3"], "unknown config key 'workload.ratee'"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(args, needle, tmp_path, capsys):
    code = main(["reproduce", *args, f"output.dir={tmp_path}"] if args else ["reproduce"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert needle in err
    assert not (tmp_path / "reproduce").exists()


# --- where user overrides go ------------------------------------------------------------------------

def _plan(study: str, *user: str, quick: bool = False):
    planned, notes = R.plan(R.load_study(study), quick, list(user))
    return {(p.part.name, p.grid.system): p.overrides for p in planned}, notes


def test_policy_parameters_go_only_to_the_policies_that_have_them():
    plan, notes = _plan("gllm-rates", "policy.T=16", "hardware=h100-80g")
    for (part, system), ovs in plan.items():
        assert "hardware=h100-80g" in ovs and "hardware=l20-48g" not in ovs
        assert ("policy.T=16" in ovs) == (system == "gLLM")
    assert any("policy.T=16 applied to the runs of gllm only" in n for n in notes)


def test_user_value_replaces_the_studys_and_a_comma_list_replaces_an_axis():
    plan, _ = _plan("gllm-rates", "workload.rate=3,5", "workload.num_requests=200")
    for ovs in plan.values():
        assert "workload.rate=3,5" in ovs and "workload.num_requests=200" in ovs
        assert not any(o.startswith("workload.rate=1") or o == "workload.num_requests=1000" for o in ovs)
    quick, _ = _plan("gllm-rates", quick=True)
    assert all("workload.num_requests=60" in ovs for ovs in quick.values())
    assert "workload.rate=2,8" in quick[("azure", "gLLM")]


def test_sipipe_study_uses_the_first_registered_policy():
    plan, notes = _plan("sipipe-ablation")
    wanted = "sipipe" if "sipipe" in POLICIES else "sarathi"
    assert all(f"policy={wanted}" in ovs for ovs in plan.values())
    # 512 sequences per micro-batch: 512 x P running (the part's count replaces the policy line's 512)
    assert all(f"policy.max_num_seqs={512 * (2 if part == 'p2-tp4' else 4)}" in ovs
               and "policy.max_num_seqs=512" not in ovs for (part, _), ovs in plan.items())
    if wanted == "sarathi":
        assert any("policy sipipe is not registered" in n for n in notes)
    plan, _ = _plan("sipipe-ablation", "policy=sarathi")  # one policy in the study: the switch is allowed
    assert all("policy=sarathi" in ovs for ovs in plan.values())


# --- verdicts on hand-made numbers -------------------------------------------------------------------

@pytest.mark.parametrize("measured, claimed, kw, category", [
    (1.90, 1.91, {}, "size"),  # "up to 1.91x": band 1.68..2.14
    (1.70, 1.91, {}, "size"),
    (1.60, 1.91, {}, "direction"),  # right direction, too small
    (2.20, 1.91, {}, "direction"),  # too big is not the published size either
    (0.95, 1.91, {}, "none"),  # wrong direction
    (1.005, 1.91, {}, "none"),  # a tie (< 1% effect) is no reproduction
    (1.10, (1.07, 1.14), {}, "size"),  # range claim
    (1.055, (1.07, 1.14), {}, "size"),  # inside the band widened by max(25% x 0.07, 0.02) = 0.02
    (1.03, (1.07, 1.14), {}, "direction"),
    (0.60, 0.573, {}, "size"),  # "42.7% lower": band 0.466..0.680
    (0.90, 0.573, {}, "direction"),
    (1.05, 0.573, {}, "none"),
    (2.90, 2.97, {"baseline": 2.0}, "size"),  # super-linear scaling: effect over linear (2.0)
    (2.30, 2.97, {"baseline": 2.0}, "direction"),
    (1.90, 2.97, {"baseline": 2.0}, "none"),  # scaling, but sub-linear
    (0.80, None, {"direction": "lower"}, "direction"),  # no number published
    (1.20, None, {"direction": "lower"}, "none"),
    (0.015, None, {"at_most": 0.02}, "size"),  # "within 2%"
    (0.024, None, {"at_most": 0.02}, "size"),  # within the bound + 25%
    (0.04, None, {"at_most": 0.02}, "none"),
    (0.9, (0.85, 0.95), {"baseline": 0.7}, "size"),  # a value claim, judged against a reference value
    (0.8, (0.85, 0.95), {"baseline": 0.7}, "direction"),
    (None, 1.91, {}, "n/a"),
    (1.2, None, {}, "info"),
])
def test_verdict_rules(measured, claimed, kw, category):
    v = R.verdict(measured, claimed, **kw)
    assert v.category == category, v
    assert v.label in VERDICT_LABELS


def test_claims_are_computed_from_rows_pairing_reducing_and_missing_points():
    rows = [
        {"part": "a", "system": "new", "gpus": 4, "status": "finished", "tput": 300.0},
        {"part": "a", "system": "old", "gpus": 4, "status": "finished", "tput": 100.0},
        {"part": "b", "system": "new", "gpus": 4, "status": "finished", "tput": 150.0},
        {"part": "b", "system": "old", "gpus": 4, "status": "finished", "tput": 100.0},
        {"part": "b", "system": "new", "gpus": 1, "status": "does not fit", "error": "model x does not fit"},
        {"part": "b", "system": "old", "gpus": 1, "status": "does not fit", "error": "model x does not fit"},
    ]
    up_to = R.Claim(id="c", text="", published="up to 3x", metric="tput", a={"system": "new", "gpus": 4},
                    b={"system": "old", "gpus": 4}, aggregate="max", claimed=3.0)
    res = R.evaluate_claim(up_to, rows)
    assert res.measured == pytest.approx(3.0) and res.verdict.category == "size"
    assert [(g, v) for g, v, _ in res.groups] == [("a", pytest.approx(3.0)), ("b", pytest.approx(1.5))]
    mean = R.evaluate_claim(R.Claim(id="m", text="", published="", metric="tput", a={"system": "new", "gpus": 4},
                                    b={"system": "old", "gpus": 4}, aggregate="mean", claimed=(1.5, 3.0)), rows)
    assert mean.measured == pytest.approx((3.0 * 1.5) ** 0.5)  # geometric mean of the ratios
    one_gpu = R.evaluate_claim(R.Claim(id="g", text="", published="", metric="tput", a={"system": "new", "gpus": 1},
                                       b={"system": "old", "gpus": 1}, where={"part": "b"}, claimed=2.0), rows)
    assert one_gpu.measured is None and one_gpu.verdict.category == "n/a" and "does not fit" in one_gpu.verdict.text
    best = R.evaluate_claim(R.Claim(id="b", text="", published="", metric="tput", a={"system": "new"},
                                    b={"system": "old"}, pair_by=(), a_reduce="max", b_reduce="max",
                                    direction="higher"), rows)
    assert best.measured == pytest.approx(3.0) and best.verdict.label == "reproduced in direction (no size published)"
    spread = R.evaluate_claim(R.Claim(id="s", text="", published="", metric="tput", kind="spread",
                                      a={"system": "new"}, pair_by=(), at_most=0.02), rows)
    assert spread.measured == pytest.approx(1.0) and spread.verdict.category == "none"


SEED_STUDIES_WITH_A_VLLM_BASELINE = ("tdpipe-scaling", "gllm-rates", "gllm-capacity", "sipipe-ablation",
                                     "molink-tables", "microbatch-count")


@pytest.mark.parametrize("name", SEED_STUDIES_WITH_A_VLLM_BASELINE)
def test_each_study_names_its_vllm_baseline_version_and_cites_vllms_source(name):
    """Issue 46: a study whose baseline is vLLM's runtime says which version (or that the paper names
    none) and cites the file and function of vLLM's source the baseline models."""
    import re

    from testbed.reproduce.studies import load_study

    setup = load_study(name).setup
    assert re.search(r"0\.5\.3|0\.7\.2|0\.8\.1|names no version", setup), name
    assert re.search(r"vllm/[\w/]+\.py", setup) and re.search(r"`\w+\.\w+`", setup), name
