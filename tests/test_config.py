"""The typed run config: one coercion system (engine/base/typed.py), typed sections (engine/base/settings.py),
`seed` as the root of the unpinned random streams, and one `error:` line for every bad input."""
from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest

from engine.base.errors import ConfigError
from engine.core.executor import ExecutorBuild
from engine.pricing.hardware import get_hardware
from engine.core.policy import RuntimeFeatures
from engine.base.settings import SECTIONS, KVSettings, Link, LinkSettings, ParallelSettings, RunConfig
from engine.core.trace import Tracer
from engine.base.typed import build, coerce, setting
from testbed.cli import main
from testbed.config.composer import BASE, compose, run_config, to_container
from testbed.config.spec import compose_spec
from conftest import small_config

TINY = ["workload.num_requests=5", "output.mlflow=false", "output.plots=false", "output.progress=false"]


# ---------------------------------------------------------------- engine/base/typed.py

@dataclasses.dataclass(frozen=True)
class _Demo:
    n: int = setting(1, min=1)
    share: float = setting(0.5, gt=0, max=1)
    mode: str = setting("a", choices=("a", "b"))
    cap: int | None = None
    sizes: tuple[int, ...] = (1, 2)
    flag: bool = False


@pytest.mark.parametrize("values, expected", [
    ({"n": 3.0}, {"n": 3}),  # an integral float is an int (1e3 on the command line)
    ({"share": 1}, {"share": 1.0}),  # an int is a float (OmegaConf reads 1 as int)
    ({"sizes": [4, 5.0]}, {"sizes": (4, 5)}),
    ({"cap": None}, {"cap": None}),
])
def test_lossless_conversions(values, expected):
    out = build(_Demo, values, "demo")
    for k, v in expected.items():
        assert getattr(out, k) == v and type(getattr(out, k)) is type(v)


@pytest.mark.parametrize("values, message", [
    ({"n": None}, "invalid demo.n=None: must be an integer >= 1"),
    ({"n": 0}, "invalid demo.n=0: must be an integer >= 1"),
    ({"n": 1.5}, "invalid demo.n=1.5: must be an integer >= 1"),
    ({"n": True}, "invalid demo.n=True: must be an integer >= 1"),
    ({"share": 0}, "invalid demo.share=0: must be a number in (0, 1]"),
    ({"share": float("nan")}, "invalid demo.share=nan: must be a number in (0, 1] (finite)"),
    ({"mode": "c"}, "invalid demo.mode='c': must be one of a, b"),
    ({"cap": "x"}, "invalid demo.cap='x': must be an integer or null"),
    ({"sizes": "12"}, "invalid demo.sizes='12': must be a list of integers"),
    ({"flag": 1}, "invalid demo.flag=1: must be true or false"),
    ({"nope": 1}, "unknown key demo.nope; valid keys: cap, flag, mode, n, share, sizes"),
])
def test_every_bad_value_is_one_line_naming_key_value_and_range(values, message):
    with pytest.raises(ConfigError) as info:
        build(_Demo, values, "demo")
    assert str(info.value) == message


def test_parse_metadata_reads_units():
    assert coerce("link.bandwidth", "1Gbps", float | None, {"parse": LinkSettings.__dataclass_fields__[
        "bandwidth"].metadata["parse"]}) == 125e6
    assert build(LinkSettings, {"latency": "30us"}, "link").latency == pytest.approx(30e-6)


def test_direct_construction_is_checked_like_build():
    with pytest.raises(ConfigError, match=r"kv.block_size=0: must be an integer >= 1"):
        KVSettings(block_size=0)
    with pytest.raises(ConfigError, match=r"parallel.num_microbatches=9: must be in \[1, 2\*pp\] = \[1, 8\]"):
        ParallelSettings(pp=4, num_microbatches=9)
    assert ParallelSettings(layer_split=[8, 8]).layer_split == (8, 8)


# ---------------------------------------------------------------- sections and RunConfig

def test_base_sections_come_from_the_dataclasses():
    rc = RunConfig()
    for name, cls in SECTIONS.items():
        assert set(BASE[name]) == {f.name for f in dataclasses.fields(cls)}, name
    assert BASE["parallel"]["num_microbatches"] is None
    assert run_config(to_container(compose([]))).parallel == rc.parallel


def test_a_compose_never_changes_the_defaults_of_the_next():
    """Composes share Hydra's ConfigStore instead of deep-copying it (composer.py:
    `_share_config_store`): what one compose overrides in a stored node must not reach the next."""
    base = ["model=llama2-13b", "hardware=a100-80g"]
    first = compose(base)
    changed = compose([*base, "model.num_layers=3", "hardware.mem_gib=7"])
    assert (changed.model.num_layers, changed.hardware.mem_gib) == (3, 7)
    again = compose(base)
    assert again == first and (again.model.num_layers, again.hardware.mem_gib) != (3, 7)


def test_run_config_is_typed():
    cfg = to_container(compose(["link.bandwidth=1Gbps", "kv.num_blocks=64", "executor.blocking_send=true"]))
    rc = run_config(cfg)
    assert rc.link.bandwidth == 125e6 and rc.link.latency is None and rc.link.explicit
    assert rc.kv.num_blocks == 64
    assert rc.executor.name == "sim" and rc.executor.settings.blocking_send is True
    assert rc.model.name == cfg["model"]["name"] and rc.hardware.name == cfg["hardware"]["name"]


def test_unset_link_is_the_hardware_link_in_both_executors():
    hw = get_hardware("l20-48g")
    unset = LinkSettings().resolve(hw)
    assert unset == Link(hw.p2p_bw_gbs * 1e9, hw.p2p_latency_s, explicit=False)
    half = LinkSettings(latency=0.001).resolve(hw)
    assert half == Link(hw.p2p_bw_gbs * 1e9, 0.001, explicit=True)


@pytest.mark.parametrize("link, paced", [(Link(2e9, 1e-5, explicit=False), False),
                                         (Link(1e6, 1e-3, explicit=True), True)])
def test_torch_factory_paces_only_an_explicit_link(link, paced):
    from engine.torch_exec.driver.executor import make_torch_executor
    from engine.torch_exec.settings import TorchSettings
    from testbed.run.runner import build_cost_model

    spec = compose_spec(["model=tiny-llama", "parallel.pp=2", "seed=7"])
    rc = spec.settings
    ex = make_torch_executor(TorchSettings(), ExecutorBuild(build_cost_model(spec), RuntimeFeatures(), link,
                                                            None, Tracer(), rc))
    try:
        assert (ex.link_bandwidth_Bps == link.bandwidth_Bps) is paced
        assert (ex.link_bandwidth_Bps is None) is not paced
        assert ex.run_config is rc and ex.run_config.seed == 7
    finally:
        ex.shutdown()


def test_prepared_run_hands_the_executor_typed_settings(monkeypatch):
    import engine.simulator.sim as sim
    from engine.core.executor import EXECUTORS, ExecutorSpec
    from testbed.run.runner import prepare_experiment

    seen = {}
    spec = EXECUTORS.get("sim")

    def spy(settings, build_):
        seen["build"] = build_
        return spec.factory(settings, build_)

    monkeypatch.setitem(EXECUTORS._items, "sim", ExecutorSpec(sim.SimSettings, spy))
    prepare_experiment(small_config("policy=sarathi", "link.latency=1ms"))
    b = seen["build"]
    assert isinstance(b.run_config, RunConfig) and isinstance(b.link, Link)
    assert b.link.latency_s == pytest.approx(1e-3) and b.link.explicit


# ---------------------------------------------------------------- seeds

def test_seed_is_the_default_of_workload_and_policy_seeds():
    cfg = to_container(compose([]))
    assert cfg["seed"] == cfg["workload"]["seed"] == cfg["policy"]["seed"] == 0
    cfg = to_container(compose(["seed=5", "workload=synthetic"]))
    assert cfg["workload"]["seed"] == 5 and cfg["policy"]["seed"] == 5
    cfg = to_container(compose(["seed=5", "workload=synthetic", "workload.seed=2"]))
    assert cfg["workload"]["seed"] == 2 and cfg["policy"]["seed"] == 5


def _requests_csv(seed: int) -> list[dict]:
    from testbed.run.runner import run_experiment

    res = run_experiment(small_config("policy=sarathi", "workload.num_requests=40", "workload.input_dist=uniform",
                                      "workload.input_max=400", f"seed={seed}"))
    return res.requests


def test_seed_changes_simulated_results_and_repeats_exactly():
    one, again, two = _requests_csv(1), _requests_csv(1), _requests_csv(2)
    assert json.dumps(one, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert json.dumps(one, sort_keys=True) != json.dumps(two, sort_keys=True)


# ---------------------------------------------------------------- one error line, exit 2

def _run(args, tmp_path, capsys) -> tuple[int, str]:
    keys = {a.partition("=")[0] for a in args}
    base = [t for t in TINY if t.partition("=")[0] not in keys]
    code = main(["run", f"output.dir={tmp_path}", *base, *args])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("args, needle", [
    (["seed=abc"], "invalid seed='abc': must be an integer >= 0"),
    (["seed=-1"], "invalid seed=-1"),
    (["policy.T=null"], "invalid policy.T=None: must be an integer"),
    (["+foo=1"], "adding (+) or deleting (~) config keys is not supported"),
    (["++seed=1"], "adding (+) or deleting (~)"),
    (["policy=gllm", "policy=sarathi"], "policy is given twice"),
    (["seed=1", "seed=2"], "seed is given twice"),
    (["=3"], "blank key"),
    (["parallel.=3"], "blank key"),
    (["workload.rate=${nope}"], "Interpolation key 'nope' not found"),
    (["output.run_name=${oops"], "invalid override 'output.run_name=${oops'"),
    (["kv.num_blocks=1000000000000"], "invalid kv.num_blocks=1000000000000: must be an integer in [1, 16777216]"),
    (["output.max_trace_spans=-1"], "invalid output.max_trace_spans=-1: must be an integer >= 0"),
    (["output.max_trace_spans=abc"], "output.max_trace_spans='abc'"),
    (["output.plots=maybe"], "invalid output.plots='maybe': must be true or false"),
    (["check_integrity=2"], "invalid check_integrity=2"),
    (["data_dir=5"], "invalid data_dir=5"),
    (["parallel.layer_split=abc"], "must be a list of integers"),
    (["parallel.num_microbatches=9"], "parallel.num_microbatches=9"),
    (["workload=synthetic", "workload.seed=-1"], "invalid workload.seed=-1"),
    (["policy.seed=-1", "policy.rules=code"], "invalid policy.seed=-1: must be an integer >= 0"),
    (["workload=synthetic", "workload.num_requests=1e12"], "workload.num_requests"),
])
def test_bad_override_is_one_error_line(args, needle, tmp_path, capsys):
    code, err = _run(args, tmp_path, capsys)
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert needle in err, err


def _azure(tmp_path: Path, bad_row: str) -> str:
    p = tmp_path / "trace.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                 f"{bad_row}\n2023-11-16 18:15:52.0000000,10,5\n")
    return str(p)


@pytest.mark.parametrize("row, needle", [
    ("2023-11-16 18:15:50.9951690,abc,109", "line 3: invalid ContextTokens='abc'"),
    ("2023-11-16 18:15:50.9951690,,109", "line 3: invalid ContextTokens=''"),
    ("2023-11-16 18:15:50.9951690,396.5,109", "line 3: invalid ContextTokens='396.5'"),
    ("2023-11-16 18:15:50.9951690,396,-2", "line 3: invalid GeneratedTokens='-2'"),
    ("2023-11-16 18:15:50.9951690,396,null", "line 3: invalid GeneratedTokens='null'"),
    ("yesterday,396,109", "line 3: invalid TIMESTAMP='yesterday'"),
    ("2023-11-16 18:15:50.9951690,396,109,7", "line 3"),
])
def test_malformed_azure_row_is_one_error_line(row, needle, tmp_path, capsys):
    path = _azure(tmp_path, row)
    code, err = _run(["workload=azure", f"workload.path={path}", "workload.num_requests=2"], tmp_path, capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert path in err and needle in err, err


GOOD = {"id": "a", "prompt": "hi", "input_tokens": 5, "output_tokens": 6, "input_tokens_qwen3": 5,
        "output_tokens_qwen3": 6}


@pytest.mark.parametrize("line, needle", [
    (json.dumps({**GOOD, "input_tokens": None}), "line 2: invalid input_tokens=None"),
    (json.dumps({**GOOD, "input_tokens": "abc"}), "line 2: invalid input_tokens='abc'"),
    (json.dumps({**GOOD, "output_tokens": 3.7}), "line 2: invalid output_tokens=3.7"),
    (json.dumps({**GOOD, "output_tokens": ""}), "line 2: invalid output_tokens=''"),
    (json.dumps({**GOOD, "output_tokens": True}), "line 2: invalid output_tokens=True"),
    (json.dumps({**GOOD, "prompt": 5}), "line 2: invalid prompt=5"),
    ('{"id": "x", ', "line 2: not JSON"),
    ("[1, 2]", "line 2: expected a JSON object"),
])
def test_malformed_sharegpt_line_is_one_error_line(line, needle, tmp_path, capsys):
    path = tmp_path / "pairs.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join([json.dumps(GOOD), line, json.dumps(GOOD)]) + "\n")
    code, err = _run(["workload=sharegpt", f"workload.path={path}", "workload.num_requests=2"], tmp_path, capsys)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert str(path) in err and needle in err, err


@pytest.mark.parametrize("damage", ["flip", "truncate", "not-gzip"])
def test_corrupted_gzip_is_one_error_line(damage, tmp_path, capsys):
    raw = gzip.compress(("\n".join([json.dumps(GOOD)] * 200) + "\n").encode())
    data = {"flip": raw[:30] + bytes(b ^ 0x55 for b in raw[30:60]) + raw[60:], "truncate": raw[:len(raw) // 2],
            "not-gzip": b"hello"}[damage]
    path = tmp_path / "pairs.jsonl.gz"
    path.write_bytes(data)
    code, err = _run(["workload=sharegpt", f"workload.path={path}", "workload.num_requests=2"], tmp_path, capsys)
    assert code == 2 and err.startswith(f"error: cannot read ShareGPT pairs {path}") and "\n" not in err, err
