"""CPU sampling priced by the sampling parameters (issue 46 item 2): each setting takes its sampler
path (engine/pricing/cpu_sampling_paths.py), priced from one committed measurement of all eight."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.base.sampling import SamplerSettings
from engine.pricing.cpu_sampling_paths import MEASURED, REFERENCE_PATH, cpu_path
from testbed.run.runner import run_experiment
from conftest import small_config

ROOT = Path(__file__).resolve().parents[1]
SIPIPE_SETTINGS = SamplerSettings(0.8, 50, 0.95, 1.1, 0.1, 0.1)  # testbed/studies/sipipe-ablation.yaml


@pytest.mark.parametrize("settings, path", [
    (SamplerSettings(temperature=0.0), "greedy"),
    (SamplerSettings(temperature=0.0, top_k=50, repetition_penalty=1.2), "greedy_penalties"),
    (SamplerSettings(), "random"),
    (SamplerSettings(frequency_penalty=0.1), "random_penalties"),
    (SamplerSettings(top_k=50), "top_k"),
    (SIPIPE_SETTINGS, "top_k_penalties"),
    (SamplerSettings(top_p=0.9), "top_p"),
    (SamplerSettings(top_k=64000, top_p=0.9, presence_penalty=0.5), "top_p_penalties"),  # k above the vocabulary
])
def test_each_setting_takes_the_samplers_path(settings, path):
    assert cpu_path(settings, vocab=32000) == path


def test_the_measurement_has_every_path_its_provenance_and_refits_exactly(tmp_path):
    rec = json.loads(MEASURED.read_text())
    assert {"date", "commit", "cpu", "torch", "command", "points", "loadavg_before"} <= set(rec)
    paths = {cpu_path(s, 32000) for s in (SamplerSettings(t, k, p, r) for t in (0.0, 0.8) for k in (0, 50)
                                          for p in (1.0, 0.9) for r in (1.0, 1.1))}
    assert paths == set(rec["fit"]) and REFERENCE_PATH in paths
    copy = tmp_path / "paths.json"
    copy.write_text(json.dumps(rec))
    subprocess.run([sys.executable, str(ROOT / "scripts/measure_cpu_sampler.py"), "--refit", str(copy)],
                   check=True, capture_output=True)
    again = json.loads(copy.read_text())["fit"]
    for name, f in rec["fit"].items():
        assert again[name]["cpu_sample_per_token_vocab_s"] == pytest.approx(f["cpu_sample_per_token_vocab_s"], rel=1e-6)
        assert f["median_error"] < 0.1, name
    per = {n: f["cpu_sample_per_token_vocab_s"] for n, f in rec["fit"].items()}
    # greedy's argmax < top-k < the plain draw over the vocabulary < top-p's full sort
    assert per["greedy"] < per["top_k"] < per["random"] < per["top_p"]


def _cost():
    from testbed.run.runner import build_cost_model

    return build_cost_model(small_config("model=qwen2.5-7b", "hardware=a100-80g"))


def test_the_defaults_and_sipipes_settings_price_the_shipped_terms_alone():
    from engine.pricing.batch_shape import BatchShape

    cost = _cost()
    shape = BatchShape.decode(64, 512)
    shipped = cost.cpu_sample_s(shape, workers=4)
    assert cost.cpu_sample_s(shape, 4, SamplerSettings()) == shipped  # a replay's defaults: the terms' own path
    assert cost.cpu_sample_s(shape, 4, SIPIPE_SETTINGS) == shipped  # the reference path: no difference
    greedy = cost.cpu_sample_s(shape, 4, SamplerSettings(temperature=0.0))
    top_p = cost.cpu_sample_s(shape, 4, SamplerSettings(top_p=0.9))
    assert greedy < 0.5 * shipped < shipped < 10 * shipped < top_p


def test_a_sipipe_run_samples_longer_on_the_sort_path_than_greedy():
    """The simulator's sampler processes are busy for the path the run's settings take."""
    base = ["policy=sipipe", "workload=synthetic", "workload.num_requests=40", "workload.arrival=offline",
            "model=qwen2.5-7b", "hardware=a100-80g", "parallel.pp=2", "output.trace=full"]

    def sampler_busy(*extra):
        res = run_experiment(small_config(*base, *extra))
        assert res.error is None
        rows = res.tracer.rows() if hasattr(res.tracer, "rows") else res.tracer.spans
        return sum(r[3] - r[2] for r in rows if r[0] == "sampler0")

    greedy, top_p = sampler_busy("executor.temperature=0"), sampler_busy("executor.top_p=0.9")
    assert top_p > 20 * greedy > 0
