"""MoLink's micro-batch extension by emulation: short simulations for k in [P, 2P], keep the best.

Policies cannot run the simulator, so the testbed does it before the run when a policy asks
(`policy.extension=search`): the same config (executor forced to `sim`, the first
`policy.search_requests` requests of the workload, no outputs) is simulated once per k, and the
k with the lowest `policy.search_metric` (default mean end-to-end latency) replaces `search`.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def wants_search(cfg: Mapping[str, Any]) -> bool:
    pol = cfg.get("policy") or {}
    return isinstance(pol, Mapping) and pol.get("extension") == "search" and \
        getattr(_policy_class(pol.get("name")), "supports_extension_search", False)


def _policy_class(name):
    from engine.policy import POLICIES

    try:
        return POLICIES.get(name)
    except Exception:
        return None


def search_extension(cfg: Mapping[str, Any]) -> tuple[int, dict[int, float]]:
    """Return (best k, {k: metric}) for `cfg` whose policy.extension is `search`."""
    from testbed.runner import run_experiment

    pol = dict(cfg["policy"])
    cls = _policy_class(pol.get("name"))
    defaults = cls.Params()
    n_req = int(pol.get("search_requests", defaults.search_requests))
    metric = pol.get("search_metric", defaults.search_metric)
    P = int((cfg.get("parallel") or {}).get("pp", 1))
    scores: dict[int, float] = {}
    for k in range(P, 2 * P + 1):
        c = copy.deepcopy(dict(cfg))
        c["policy"] = dict(pol, extension=k)
        c["executor"] = {"name": "sim"}
        wl = dict(c.get("workload") or {})
        if wl.get("num_requests") is None or wl["num_requests"] > n_req:
            wl["num_requests"] = n_req
        c["workload"] = wl
        c["output"] = dict(c.get("output") or {}, mlflow=False, plots=False, progress=False)
        res = run_experiment(c)
        value = res.summary.get(metric)
        scores[k] = float("inf") if res.failed or value is None else float(value)
    best = min(scores, key=lambda k: (scores[k], k))
    return best, scores


def resolve_extension(cfg: Mapping[str, Any]) -> tuple[dict, dict | None]:
    """The config with `policy.extension=search` replaced by the chosen k (and the scores)."""
    if not wants_search(cfg):
        return dict(cfg), None
    k, scores = search_extension(cfg)
    out = dict(cfg)
    out["policy"] = dict(cfg["policy"], extension=k)
    return out, {"extension_k": k, "extension_scores": scores}
