"""TD-Pipe's prediction cache: a hit gives the run a fit would give, without fitting; the key
moves with every input; damaged or pickled files are ignored; `prediction_cache=false` writes nothing."""
import numpy as np
import pytest
from conftest import small_config

from engine.core.request import Request
from policies import length_predictor as lp
from policies import prediction_cache, tdpipe
from testbed.run.runner import prepare_experiment


def _run(tmp_path, *extra):
    cfg = small_config("policy=tdpipe", "policy.predictor=bins", "policy.history=run", "workload.num_requests=80",
                       "kv.num_blocks=300", f"policy.predictor_dir={tmp_path}/predictors", *extra)
    run = prepare_experiment(cfg)
    result = run.run()
    return run.controller.policy, result


def _entries(tmp_path):
    return sorted((tmp_path / "predictors" / "cache" / "predictions").glob("*.npz"))


def test_a_hit_gives_the_fits_results_without_fitting(tmp_path, monkeypatch):
    tdpipe._FITTED.clear()
    first, r1 = _run(tmp_path)
    assert first.predictor_info["predictions"] == "fit" and len(_entries(tmp_path)) == 1
    tdpipe._FITTED.clear()

    def no_fit(*args, **kwargs):
        raise AssertionError("fitted although the predictions were cached")

    monkeypatch.setattr(lp.BinPredictor, "fit", no_fit)
    second, r2 = _run(tmp_path)
    assert second.predictor_info["predictions"] == "cache"
    assert second.pred == first.pred
    assert second.predictor_info["classifier"] == first.predictor_info["classifier"]
    assert r1.summary == r2.summary and r1.requests == r2.requests


def test_another_seed_is_another_entry(tmp_path):
    tdpipe._FITTED.clear()
    _run(tmp_path)
    _run(tmp_path, "policy.seed=1")
    assert len(_entries(tmp_path)) == 2


def test_disabled_cache_writes_nothing(tmp_path):
    tdpipe._FITTED.clear()
    pol, r = _run(tmp_path, "policy.prediction_cache=false")
    assert r.error is None and pol.predictor_info["predictions"] == "fit" and _entries(tmp_path) == []


def _req(i, text="a prompt", out=10):
    return Request(request_id=i, arrival_s=0.0, prompt_len=8 + i, output_len=out, prompt_text=text)


def _key(settings, hist, run):
    return prediction_cache.cache_key(settings, prediction_cache.fingerprints(hist), prediction_cache.fingerprints(run))


def test_the_key_covers_settings_history_and_run():
    hist, run = [_req(i) for i in range(5)], [_req(i) for i in range(5, 8)]
    base = _key(("bins", "auto", 0), hist, run)
    assert base == _key(("bins", "auto", 0), [_req(i) for i in range(5)], list(run))
    others = [_key(("bins", "auto", 1), hist, run),
              _key(("bins", "length", 0), hist, run),
              _key(("bins", "auto", 0), hist[:-1], run),
              _key(("bins", "auto", 0), hist, run[::-1]),
              _key(("bins", "auto", 0), hist, [*run[:-1], _req(7, out=11)]),
              _key(("bins", "auto", 0), hist, [*run[:-1], _req(7, text="other")]),
              # a request moved from the history to the run is a different input
              _key(("bins", "auto", 0), hist[:-1], [hist[-1], *run])]
    assert base not in others and len(set(others)) == len(others)


def test_store_and_load_round_trip(tmp_path):
    pred = np.array([3, 1, 4], dtype=np.int64)
    path = prediction_cache.store(tmp_path, "k", pred, {"predictor": "bins", "classifier": "sgd"})
    assert path == tmp_path / "k.npz" and not list(tmp_path.glob(".tmp-*"))
    got, info = prediction_cache.load(tmp_path, "k", 3)
    assert got.tolist() == [3, 1, 4] and info == {"predictor": "bins", "classifier": "sgd"}
    assert prediction_cache.load(tmp_path, "k", 4) is None  # another run size
    assert prediction_cache.load(tmp_path, "absent", 3) is None


@pytest.mark.parametrize("content", ["garbage", "pickled", "floats", "no-info"])
def test_damaged_or_pickled_entries_are_misses(tmp_path, content):
    path = tmp_path / "k.npz"
    if content == "garbage":
        path.write_bytes(b"not a zip")
    elif content == "pickled":  # an object array needs pickle to load; refused
        np.savez(path, predictions=np.array([1, 2], dtype=object), info=np.array("{}"))
    elif content == "floats":
        np.savez(path, predictions=np.array([1.0, 2.0]), info=np.array("{}"))
    else:
        np.savez(path, predictions=np.array([1, 2], dtype=np.int64))
    assert prediction_cache.load(tmp_path, "k", 2) is None


def test_an_unwritable_directory_costs_only_the_cache(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert prediction_cache.store(blocker / "sub", "k", np.array([1], dtype=np.int64), {}) is None
