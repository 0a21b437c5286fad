"""`testbed run` end to end: checks before running, signals, concurrency, lean run folders,
MLflow names and the overload warning (issues 13 and 15)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.cli import main
from signal_helpers import WAIT_S

REPO = Path(__file__).resolve().parents[1]
SMALL = ["policy=sarathi", "workload=azure", "workload.rate=2", "hardware=a100-80g",
         "model=llama2-13b", "parallel.pp=2", "output.progress=false"]
N60 = "workload.num_requests=60"  # SMALL's size; tests that want another give theirs instead


def _one_error_line(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# --- checks before running ---------------------------------------------------------------------------

def test_output_dir_that_is_a_file_is_one_line_before_running(tmp_path, capsys, monkeypatch):
    import testbed.run.runner as runner

    monkeypatch.setattr(runner, "prepare_experiment", lambda *a, **k: pytest.fail("ran before the check"))
    f = tmp_path / "file"
    f.write_text("x")
    err = _one_error_line(capsys, main(["run", *SMALL, N60, f"output.dir={f}"]))
    assert "output.dir" in err and "is a file" in err


@pytest.mark.parametrize("uri, needle", [("foo://somewhere", "unknown scheme 'foo'"),
                                         ("nonsense", "unknown scheme"),
                                         ("sqlite:////nonexistent-dir-xyz/mlflow.db", "not a writable directory")])
def test_bad_tracking_uri_is_one_line(uri, needle, tmp_path, capsys):
    err = _one_error_line(capsys, main(["run", *SMALL, N60, f"output.dir={tmp_path}", f"output.tracking_uri={uri}"]))
    assert needle in err and uri in err


def test_unreachable_tracking_server_is_one_line_naming_it(tmp_path, capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    uri = f"http://127.0.0.1:{port}"
    err = _one_error_line(capsys, main(["run", *SMALL, N60, f"output.dir={tmp_path}", f"output.tracking_uri={uri}"]))
    assert uri in err and "not reachable" in err
    assert not any(tmp_path.iterdir())  # no run folder was made


@pytest.mark.parametrize("args, needle", [
    (["output.run_name=../.."], "output.run_name"),
    (["output.run_name=a/b"], "output.run_name"),
    (["output.max_trace_spans=-1"], "output.max_trace_spans"),
    (["output.trace=everything"], "must be one of sampled, full, off"),
])
def test_bad_output_settings_are_refused(args, needle, tmp_path, capsys):
    err = _one_error_line(capsys, main(["run", *SMALL, N60, f"output.dir={tmp_path / 'out'}", "output.mlflow=false",
                                        *args]))
    assert needle in err
    assert not (tmp_path.parent / "out").exists() or True
    assert list(tmp_path.glob("*/*")) == []


def test_a_reused_run_name_never_overwrites(tmp_path, capsys):
    args = ["run", *SMALL, "workload.num_requests=10", f"output.dir={tmp_path}", "output.mlflow=false",
            "output.plots=false", "output.run_name=mine"]
    dirs = []
    for _ in range(3):
        assert main(args) == 0
        dirs.append(Path(capsys.readouterr().out.strip().splitlines()[-1]))
    assert [d.name for d in dirs] == ["mine", "mine-2", "mine-3"]
    assert all((d / "summary.json").is_file() for d in dirs)


def test_a_broken_profile_yaml_is_skipped_with_a_warning(tmp_path, capsys, monkeypatch):
    prof = tmp_path / "profiles"
    prof.mkdir()
    (prof / "broken.yaml").write_text("name: [unclosed\n")
    monkeypatch.setenv("TESTBED_PROFILE_DIR", str(prof))
    assert main(["list", "hardware"]) == 0
    cap = capsys.readouterr()
    assert "a100-80g" in cap.out
    assert "warning: skipping hardware profile" in cap.err and "broken.yaml" in cap.err


def test_model_may_be_a_hugging_face_checkpoint_folder(tmp_path, capsys):
    from engine.pricing.models import get_model

    ckpt = tmp_path / "my-llama"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(get_model("tiny-llama").hf_config()))
    small = [o for o in SMALL if not o.startswith("model=")]
    code = main(["run", *small, "workload.num_requests=10", f"model={ckpt}", f"output.dir={tmp_path / 'o'}",
                 "output.mlflow=false", "output.plots=false"])
    assert code == 0, capsys.readouterr().err
    run_dir = Path(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = (run_dir / "config.yaml").read_text()
    assert f"name: {ckpt.resolve()}" in cfg and f"num_layers: {get_model('tiny-llama').num_layers}" in cfg


# --- failures, markup, signals -----------------------------------------------------------------------

def test_failure_text_with_brackets_is_printed_verbatim(tmp_path, capsys, monkeypatch):
    """Rich must not read exception text as markup: gloo errors contain `[/__w/pytorch/...]`."""
    from engine.core.controller import Controller
    from engine.base.errors import RunFailedError

    msg = "stage 1 died: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed"

    def boom(self):
        raise RunFailedError(msg)

    monkeypatch.setattr(Controller, "run", boom)
    code = main(["run", *SMALL, N60, f"output.dir={tmp_path}", "output.mlflow=false", "output.plots=false"])
    cap = capsys.readouterr()
    assert code == 1
    assert f"run failed: {msg}" in " ".join(cap.err.split()).replace("\n", "")
    run_dir = Path(cap.out.strip().splitlines()[-1])
    assert (run_dir / "requests.csv").is_file()


def _wait_for_run_dir(base: Path, proc, timeout: float = WAIT_S) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if any(p.is_dir() and p.name.startswith("sarathi_") for p in base.glob("*")):
            return
        if proc.poll() is not None:
            pytest.fail(f"run ended early: {proc.communicate()}")
        time.sleep(0.1)
    pytest.fail("the run never started")


def _long_run(tmp_path):
    from mlflow_db import fresh_mlflow_db

    fresh_mlflow_db(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", "policy=sarathi", "workload=azure",
                             "workload.num_requests=15000", "workload.rate=2", "hardware=a100-80g",
                             "model=llama2-13b", "parallel.pp=2", "output.progress=false", "output.plots=false",
                             f"output.dir={tmp_path}"], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for_run_dir(tmp_path, proc)
    time.sleep(1.0)  # inside the simulation
    return proc


def _check_killed_with_partial_outputs(proc, code, tmp_path):
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == code, err
    assert "Traceback" not in err and "interrupted" in err
    run_dir = Path(out.strip().splitlines()[-1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["num_requests"] == 15000
    assert summary["num_finished"] + summary["num_failed"] == 15000 and summary["num_failed"] > 0
    assert "interrupted" in (run_dir / "requests.csv").read_text()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_signal_ends_run_killed_with_partial_outputs(sig, code, tmp_path):
    """SIGHUP (a closed terminal) killed the run outright: an empty run folder, the MLflow run
    left to its background process (issue 25, item 4). SIGTERM: the next test sends it first."""
    proc = _long_run(tmp_path)
    proc.send_signal(sig)
    _check_killed_with_partial_outputs(proc, code, tmp_path)


def test_repeated_signals_do_not_cut_the_save(tmp_path):
    """A second Ctrl-C or SIGTERM within a second of the first (people press twice, schedulers
    follow up) interrupted the save of the partial results: an empty run folder (issue 25, item 4).
    Here ten more come within the second after the first (the save takes seconds)."""
    proc = _long_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    for sig in [signal.SIGINT, signal.SIGTERM] * 5:
        time.sleep(0.1)
        if proc.poll() is None:
            proc.send_signal(sig)
    _check_killed_with_partial_outputs(proc, 143, tmp_path)


@pytest.mark.slow
def test_sigterm_stops_a_torch_run_and_its_stages(tmp_path):
    pytest.importorskip("torch")
    psutil = pytest.importorskip("psutil")

    from mlflow_db import fresh_mlflow_db

    fresh_mlflow_db(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", "policy=sarathi", "executor=torch",
                             "model=tiny-llama", "parallel.pp=2", "kv.num_blocks=512", "workload.num_requests=400",
                             "output.progress=false", "output.plots=false", f"output.dir={tmp_path}"],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for_run_dir(tmp_path, proc)
    time.sleep(8.0)  # stages up and serving
    stages = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 143, err
    from signal_helpers import survivors

    assert survivors(stages) == []  # given time to notice: multiprocessing's resource tracker exits just after
    summary = json.loads((Path(out.strip().splitlines()[-1]) / "summary.json").read_text())
    assert summary["num_finished"] + summary["num_failed"] == 400
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


def test_four_parallel_runs_on_a_fresh_output_dir_are_all_recorded(tmp_path):
    """MLflow's schema creation raced: the second of two runs started together was lost."""
    cache = tmp_path / "cache"  # no migrated copy to seed from: the lock alone must keep all four
    procs = [subprocess.Popen([sys.executable, "-m", "testbed.cli", "run", *SMALL, "workload.num_requests=20",
                               "output.plots=false", f"output.dir={tmp_path / 'out'}", f"output.run_name=r{i}"],
                              cwd=REPO, env=_env(TESTBED_CACHE_DIR=str(cache)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'out'}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 4


# --- lean folders, names, warnings ---------------------------------------------------------------------

def test_trace_modes_keep_the_summary_and_shrink_the_trace(tmp_path):
    from conftest import small_config
    from testbed.run.outputs import SAMPLE_HEAD, write_run_dir
    from testbed.run.runner import run_experiment

    sizes, summaries = {}, {}
    for mode in ("full", "sampled", "off"):
        res = run_experiment(small_config("workload.num_requests=100", f"output.trace={mode}"))  # ~2,000 micro-batches: past the sampled head and a period
        out = write_run_dir(res, tmp_path / mode, plots=False)
        summaries[mode] = (out / "summary.json").read_text()
        sizes[mode] = (out / "trace.json").stat().st_size if (out / "trace.json").exists() else 0
        if mode != "off":
            trace = json.loads((out / "trace.json").read_text())  # loadable JSON (Perfetto, chrome://tracing)
            mbs = {e["args"]["mb"] for e in trace["traceEvents"] if e["ph"] == "X"}
            assert set(range(SAMPLE_HEAD)) <= mbs
    assert summaries["full"] == summaries["sampled"] == summaries["off"]  # busy time counts every span
    assert 0 == sizes["off"] < sizes["sampled"] < sizes["full"]


def test_run_names_lead_with_what_differs():
    from testbed.config.spec import compose_spec
    from testbed.run.outputs import display_name

    ov = ["policy=sarathi", "workload.rate=4", "parallel.pp=2", "output.dir=/tmp/x", "hardware=a100-80g"]
    cfg = compose_spec(ov)
    assert display_name(cfg, ov) == "sarathi · azure · rate=4 · pp=2 · a100-80g"
    off = ["workload=sharegpt", "workload.arrival=offline"]
    assert display_name(compose_spec(off), off) == "gllm · sharegpt · arrival=offline"


def test_overload_warns_once_with_both_rates_and_the_remedy(tmp_path, capsys):
    base = ["run", "policy=sarathi", "workload=azure", "workload.num_requests=300", "hardware=a100-80g",
            "model=llama2-13b", "parallel.pp=2", "output.progress=false", "output.mlflow=false",
            "output.plots=false", f"output.dir={tmp_path}"]
    assert main([*base, "workload.rate=50"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert err.count("warning: overloaded") == 1
    assert "tok/s" in err and "req/s" in err and "lower workload.rate" in err
    assert main([*base, "workload.rate=0.5"]) == 0
    assert "overloaded" not in capsys.readouterr().err


def test_mlflow_run_has_a_readable_name_tags_note_and_small_artifacts(tmp_path, capsys):
    from mlflow_db import fresh_mlflow_db

    fresh_mlflow_db(tmp_path)
    assert main(["run", *SMALL, N60, f"output.dir={tmp_path}"]) == 0
    run_dir = Path(capsys.readouterr().out.strip().splitlines()[-1])
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])[0]
    tags = run.data.tags
    assert tags["mlflow.runName"].startswith("sarathi · azure · rate=2")
    assert tags["policy"] == "sarathi" and tags["rate"] == "2" and tags["pp"] == "2"
    assert "| throughput tok/s |" in tags["mlflow.note.content"]
    assert tags["testbed.run_dir"] == str(run_dir.resolve())
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml", "timeline.png", "kv_usage.png"} <= arts
    assert "requests.csv" not in arts and "microbatches.csv" not in arts  # the folder is not copied
    assert (run_dir / "timeline.png").stat().st_size > 0


def test_test_command_passes_pytest_arguments_through():
    def tb_test(*args):
        return subprocess.run([sys.executable, "-m", "testbed.cli", "test", *args, "-p", "no:cacheprovider"],
                              cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)

    p = tb_test("-x", "-k", "random", "--co", "tests/test_kv.py")
    assert p.returncode == 0, p.stderr
    picked = re.search(r"1/(\d+) tests collected \((\d+) deselected\)", p.stdout)
    assert (picked and int(picked.group(1)) == int(picked.group(2)) + 1) or "1 test collected" in p.stdout, p.stdout
    p = tb_test("-m", "slow", "--co", "tests/test_kv.py")  # -m reaches pytest (was: unrecognized arguments)
    assert p.returncode == 5 and "unrecognized" not in p.stderr, p.stdout + p.stderr


def test_sampled_trace_writes_the_head_and_a_bounded_spread_of_windows():
    from testbed.run.outputs import SAMPLE_HEAD, SAMPLE_MAX_WINDOWS, SAMPLE_PERIOD, SAMPLE_WINDOW, SampledTracer

    tr = SampledTracer(max_spans=10**6)
    for mb in range(40_000):
        tr.span("stage0", "forward:decode", mb, mb + 0.5, mb)
    assert tr.busy_time("stage0") == 20_000.0  # every span counts as work
    kept = {s[4] for s in tr.spans}
    assert set(range(SAMPLE_HEAD)) <= kept and len(kept) < 40_000 / 10
    written = {s[4] for s in tr.written_spans()}
    windows = {(m - SAMPLE_HEAD) // SAMPLE_PERIOD for m in written if m >= SAMPLE_HEAD}
    assert len(windows) == SAMPLE_MAX_WINDOWS and min(windows) == 0
    assert max(windows) == (40_000 - SAMPLE_HEAD - 1) // SAMPLE_PERIOD  # spread to the end of the run
    assert len(written) == SAMPLE_HEAD + SAMPLE_MAX_WINDOWS * SAMPLE_WINDOW
