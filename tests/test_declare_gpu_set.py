"""scripts/declare_gpu_set.py: the next GPU set's split, written before its device call from the plan's own run names."""
from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "declare_gpu_set.py"
POLICIES = {"gllm", "sarathi", "vllm", "molink", "sipipe", "tdpipe"}


def _module():
    spec = importlib.util.spec_from_file_location("declare_gpu_set", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_g2_manifest_splits_the_plans_runs_fit_on_gllm_and_sipipe_test_on_every_policy(tmp_path):
    mod = _module()
    assert mod.main(["--device", "h200", "--date", "2026-11-30", "--root", str(tmp_path)]) == 0
    path = tmp_path / "gpu-h200-qwen2.5-7b-2026-11-30" / "manifest-g2.yaml"
    text = path.read_text()
    assert text.startswith("# GPU set G2 of issue 47") and "BEFORE any of its runs was taken" in text
    body = yaml.safe_load(text)
    assert body["runs"] == ["runs-g2.tar.xz"]
    planned = mod.plan_runs("g2")
    named = [r for p in body["profiles"].values() for s in ("fit", "validation", "test") for r in p[s]]
    assert sorted(named) == sorted(planned) and len(set(named)) == len(named)  # every run once, none invented
    p1, p2 = body["profiles"]["gpu-h200-q7-g2-pp1-runs"], body["profiles"]["gpu-h200-q7-g2-pp2-runs"]
    assert {r.split("-")[1] for r in p1["fit"] if "-gllm-" in r} == {"sharegpt", "azlo", "azhi"}  # G1 fitted ShareGPT only
    assert any("-sipipe-" in r for r in p1["fit"]) and any("-sipipe-" in r for r in p2["fit"])
    for prof, settings in ((p1, {"sharegpt", "azlo"}), (p2, {"sharegpt"})):
        assert not {r.split("-")[2] for r in prof["validation"]} & {"gllm", "sipipe"}
        assert {(r.split("-")[1], r.split("-")[2]) for r in prof["test"]} == {(s, p) for s in settings for p in POLICIES}
        assert all(r.endswith("-r2") for r in prof["test"]) and all(r.endswith("-r1") for r in prof["fit"])
        assert prof["options"]["own_attention"] == [True] and prof["options"]["table"] == [None]
    assert p2["options"]["inflight_handover"] == [False, True] and p1["options"]["inflight_handover"] == [False]


def test_a_declared_split_is_never_rewritten_and_bad_input_is_one_line_exit_2(tmp_path):
    args = ["python3", str(SCRIPT), "--device", "h200", "--root", str(tmp_path)]
    assert subprocess.run([*args, "--date", "2026-11-30"], capture_output=True, text=True).returncode == 0
    for extra, needle in ((["--date", "2026-11-30"], "exists: a declared split is never rewritten"),
                          (["--date", "2026-13-01"], "--date '2026-13-01' is not a date"),
                          (["--date", "2026-12-01", "--plan", "g9"], "PLAN=g9 is not a plan; valid choices: g1, g2")):
        done = subprocess.run([*args, *extra], capture_output=True, text=True)
        err = done.stderr.strip()
        assert done.returncode == 2 and err.startswith("error: ") and "\n" not in err and needle in err, err
    assert not (tmp_path / "gpu-h200-qwen2.5-7b-2026-12-01").exists()
