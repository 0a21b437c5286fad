"""Fuzzing the user-input surface: every override list and every malformed data-file row either
builds a run (exit 0) or is exactly one `error: ...` line with exit 2, never a traceback.

The property is checked in-process on the layer that decides it (compose, validate, build the
workload, policy, cost model and executor: `testbed run` minus the simulation) with a small
`max_examples`, and end to end on a handful of real `testbed run` subprocesses.
"""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from engine.base.errors import TestbedError  # noqa: E402
from testbed.config.composer import compose, flatten, group_nodes, to_container  # noqa: E402
from testbed.config.spec import compose_spec
from testbed.run.runner import prepare_experiment  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = ["workload.num_requests=5", "output.mlflow=false", "output.plots=false", "output.progress=false"]
FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def _config_keys() -> list[str]:
    keys = set(flatten(to_container(compose([]))))
    for group, choices in group_nodes().items():
        keys.add(group)
        for node in choices.values():
            keys.update(f"{group}.{k}" for k in node if k != "name")
    return sorted(keys)


KEYS = _config_keys()
GROUPS = group_nodes()
CHOICES = sorted({f"{g}={c}" for g, cs in GROUPS.items() if g != "executor" for c in cs})
# Values a user might type: numbers of every shape, words, and the override grammar's special characters.
VALUES = st.one_of(
    st.integers(-3, 3000).map(str),
    st.sampled_from(["0", "1", "-1", "1e12", "9223372036854775808", "1.5", "0.5", "-0.0", "nan", "inf",
                     "-inf", "1e308", "null", "true", "false", "[]", "[1,2]", "[8,8,8,8]", "[1,[2]]", "a,b",
                     "'quoted'", "\"x\"", "${seed}", "${nope}", "${oops", "${oc.env:NOPE}", "=", "==", "é",
                     "1Gbps", "30ms", "fast", "{a: 1}", "  ", "paper", "code", "poisson", "offline"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=8),
)


def _typo(key: str, data: st.DataObject) -> str:
    kind = data.draw(st.sampled_from(["none", "none", "none", "drop", "insert", "prefix", "blank", "nest"]))
    if kind == "drop" and len(key) > 1:
        i = data.draw(st.integers(0, len(key) - 1))
        return key[:i] + key[i + 1:]
    if kind == "insert":
        i = data.draw(st.integers(0, len(key)))
        return key[:i] + data.draw(st.sampled_from(["x", "é", ".", "_", " ", "="])) + key[i:]
    if kind == "prefix":
        return data.draw(st.sampled_from(["+", "++", "~"])) + key
    if kind == "blank":
        return data.draw(st.sampled_from(["", ".", key + ".", "." + key]))
    if kind == "nest":
        return key + ".sub"
    return key


@st.composite
def override_lists(draw) -> list[str]:
    out = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            out.append(draw(st.sampled_from(CHOICES)))
        else:
            key = _typo(draw(st.sampled_from(KEYS)), draw(st.data()))
            out.append(key if draw(st.integers(0, 9)) == 0 else f"{key}={draw(VALUES)}")
    return out


def _outcome(build) -> tuple[int, str]:
    """(exit code, stderr) as `testbed run` would give them, for the parse/validate/build layer."""
    try:
        build()
    except TestbedError as exc:
        return 2, f"error: {exc}"
    return 0, ""


def _assert_clean(code: int, err: str) -> None:
    assert code in (0, 2)
    if code == 2:
        assert err.startswith("error: ") and "\n" not in err.strip() and len(err) > len("error: "), err


def _prepare(overrides: list[str]) -> None:
    prepare_experiment(compose_spec(overrides)).controller.executor.shutdown()


@FUZZ
@given(override_lists())
def test_fuzzed_overrides_build_or_fail_in_one_line(overrides):
    _assert_clean(*_outcome(lambda: _prepare([*TINY, *overrides])))


def _azure_file(tmp: Path, cells: list[str]) -> Path:
    path = tmp / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                    + ",".join(cells) + "\n2023-11-16 18:15:52.0000000,10,5\n", encoding="utf-8")
    return path


CELL = st.one_of(st.integers(-5, 10**20).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
                 st.sampled_from(["", " ", "null", "NaN", "1e3", "0x10", "\"7\"", "2023-11-16 18:15:50.9951690"]),
                 st.text(max_size=6))


@FUZZ
@given(ts=st.one_of(st.just("2023-11-16 18:15:50.9951690"), CELL), ctx=CELL, gen=CELL,
       extra=st.lists(CELL, max_size=1))
def test_fuzzed_azure_rows_build_or_fail_in_one_line(tmp_path, ts, ctx, gen, extra):
    from workloads.base import build_workload

    path = _azure_file(tmp_path, [ts, ctx, gen, *extra])
    _assert_clean(*_outcome(lambda: build_workload({"name": "azure", "path": str(path), "num_requests": None})))


JSON_VALUE = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**20) | st.floats() | st.text(max_size=5),
                          lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner,
                                                                                       max_size=2), max_leaves=4)
FIELDS = ("id", "prompt", "input_tokens", "output_tokens", "input_tokens_qwen3", "output_tokens_qwen3")
GOOD = {"id": "a", "prompt": "hi", "input_tokens": 5, "output_tokens": 6, "input_tokens_qwen3": 5,
        "output_tokens_qwen3": 6}


@FUZZ
@given(line=st.one_of(
    st.builds(lambda k, v: json.dumps({**GOOD, k: v}), st.sampled_from(FIELDS), JSON_VALUE),
    st.builds(lambda k: json.dumps({f: v for f, v in GOOD.items() if f != k}), st.sampled_from(FIELDS)),
    st.text(max_size=12).filter(lambda t: "\n" not in t and "\r" not in t)),
    damage=st.sampled_from(["none", "none", "flip", "truncate"]), where=st.integers(0, 10**6))
def test_fuzzed_sharegpt_lines_build_or_fail_in_one_line(tmp_path, line, damage, where):
    from workloads.base import build_workload

    raw = gzip.compress(("\n".join([json.dumps(GOOD), line, *[json.dumps(GOOD)] * 50]) + "\n").encode())
    if damage == "flip":
        i = 10 + where % (len(raw) - 10)
        raw = raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1:]
    elif damage == "truncate":
        raw = raw[:10 + where % (len(raw) - 10)]
    path = tmp_path / f"pairs-{where}.jsonl.gz"
    path.write_bytes(raw)
    _assert_clean(*_outcome(lambda: build_workload({"name": "sharegpt", "path": str(path), "num_requests": 2,
                                                    "arrival": "offline"})))


# ---------------------------------------------------------------- end to end, a handful of real runs

@pytest.mark.parametrize("overrides, code", [
    ([], 0),
    (["seed=abc"], 2),
    (["+foo=1"], 2),
    (["policy=gllm", "policy=sarathi"], 2),
    (["workload.rate=${nope}"], 2),
    (["policy.T=null"], 2),
])
def test_testbed_run_exits_0_or_one_error_line(overrides, code, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    keys = {o.partition("=")[0] for o in overrides}  # the run's own keys, kept given twice where they are
    base = [t for t in TINY if t.partition("=")[0] not in keys]
    proc = subprocess.run([sys.executable, "-m", "testbed.cli", "run", f"output.dir={tmp_path}", *base, *overrides],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if code == 2:
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
