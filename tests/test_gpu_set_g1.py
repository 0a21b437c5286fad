"""GPU set G1 (measurements/gpu-h200-qwen2.5-7b-2026-11-28: qwen2.5-7b on an H200, issue 47): the runs
are in the repository and read as a declared split, and a replay infers the KV pool each run measured."""
from __future__ import annotations

import json

import pytest

from testbed.calibrate.manifest import MEASUREMENTS_DIR, load_manifest

G1 = MEASUREMENTS_DIR / "gpu-h200-qwen2.5-7b-2026-11-28"


@pytest.fixture(scope="module")
def manifest():
    return load_manifest(G1 / "manifest-g1.yaml")


def test_every_policy_ran_at_both_depths(manifest):
    for P in (1, 2):
        split = manifest.split(f"gpu-h200-q7-g1-pp{P}-runs")
        policies = {n.split("-")[2] for n in split.test if n.startswith(f"pp{P}-sharegpt-")}
        assert policies == {"gllm", "sarathi", "vllm", "molink", "sipipe", "tdpipe"}
        assert split.fit == (f"pp{P}-sharegpt-gllm-r1",) and split.validation == (f"pp{P}-sharegpt-sarathi-r1",)


@pytest.mark.parametrize("name", ["pp1-sharegpt-molink-r2", "pp2-sharegpt-molink-r2", "pp1-sharegpt-gllm-r1"])
def test_the_inferred_kv_pool_is_the_one_the_run_measured(manifest, name):
    """MoLink counts its micro-batches in flight from the link; the inference replays the first
    micro-batch, so it must give the policy the run's link (it formed 10,530 prefill tokens instead
    of the run's 3,402 without it, and the replay stopped)."""
    from testbed.calibrate.runs import infer_kv_blocks, load_run

    recorded = json.loads((manifest.run_dir(name) / "run_info.json").read_text())["kv_num_blocks"]
    assert infer_kv_blocks(load_run(manifest.run_dir(name))) == recorded


def test_stages_recorded_their_cuda_graph_capture(manifest):
    for P in (1, 2):
        info = json.loads((manifest.run_dir(f"pp{P}-sharegpt-gllm-r1") / "run_info.json").read_text())
        assert len(info["stages"]) == P
        assert all(s["runtime_s"] > 0.5 and s["runtime_mib"] > 100 and s["device"].startswith("cuda")
                   for s in info["stages"])


@pytest.mark.parametrize("depth,option", [(1, "1"), (2, "0")])
def test_the_frozen_profiles_refit_exactly_from_the_repository(tmp_path, depth, option):
    """The options choose-g1.txt chose on the validation run: P=1 without the serving table."""
    import yaml

    from testbed.cli import main

    name = f"gpu-h200-q7-g1-pp{depth}-runs"
    assert main(["calibrate", "runs", str(G1 / "manifest-g1.yaml"), "--profile", name, "--table-option", option,
                 "--own-attention", "--hop", "receive", "--name", name, "--out", str(tmp_path)]) == 0
    fitted = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())
    frozen = yaml.safe_load((G1 / "profiles" / f"{name}.yaml").read_text())
    for key in set(frozen) - {"profile", "version"}:
        assert fitted[key] == frozen[key], key
    assert fitted["profile"]["errors"] == frozen["profile"]["errors"]
