"""Bad input that used to end in a traceback or, worse, in silently wrong results (issue 25,
items 9 and 10): each is now one `error:` line naming the value and what is valid, exit 2."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import main

REPO = Path(__file__).resolve().parents[1]
QUICK = ["output.mlflow=false", "output.plots=false", "output.progress=false", "workload=synthetic",
         "workload.num_requests=20"]


def _run(tmp_path, *args: str) -> int:
    from testbed.config.overrides import merge

    return main(["run", f"output.dir={tmp_path}", *merge(QUICK, list(args))])


def _one_error_line(capsys, code: int, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _pairs(path: Path, line: str) -> Path:
    with gzip.open(path, "wt") as fh:
        fh.write(line + "\n")
    return path


@pytest.mark.parametrize("line, needle", [
    ('{"id": 1, "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "not JSON"),
    (json.dumps({"id": 1, "prompt": "x", "input_tokens": 2**63, "output_tokens": 3, "input_tokens_qwen3": 3,
                 "output_tokens_qwen3": 3}), "input_tokens=9223372036854775808"),
    (json.dumps({"id": 1, "prompt": "x", "input_tokens": 1e300, "output_tokens": 3, "input_tokens_qwen3": 3,
                 "output_tokens_qwen3": 3}), "must be a whole number in [0, 2147483647]"),
])
def test_sharegpt_file_nested_too_deep_or_counts_too_large(tmp_path, capsys, line, needle):
    path = _pairs(tmp_path / "pairs.jsonl.gz", line)
    code = _run(tmp_path, "workload=sharegpt", f"workload.path={path}", "workload.num_requests=1")
    _one_error_line(capsys, code, "line 1", needle)


@pytest.mark.parametrize("args, needles", [
    (["output.run_name=" + "a" * 300], ("output.run_name", "300 bytes", "at most 200")),
    (["workload.arrival=gamma", "workload.cv=1e-300"], ("workload.cv=1e-300", "[0.001, 100]")),
    (["workload.rate=1e-300"], ("workload.rate=1e-300", "[1e-06, 1e+06]")),
    (["link.latency=1e308"], ("link.latency=1e+308", "<= 3600")),
    (["link.latency=2h"], ("link.latency='2h'", "<= 3600")),
    (["link.bandwidth=1e-300"], ("link.bandwidth=1e-300", ">= 1000")),
])
def test_values_that_broke_the_run_or_its_numbers(tmp_path, capsys, args, needles):
    code = _run(tmp_path, *args)
    _one_error_line(capsys, code, *needles)


def test_a_long_link_latency_still_gives_finite_latencies(tmp_path):
    """The bound is where results stop being numbers, not a taste: 1 hour per hop still runs."""
    from testbed.run.runner import run_experiment

    from conftest import small_config

    s = run_experiment(small_config("link.latency=3600", "workload.num_requests=5", out_dir=tmp_path)).summary
    assert s["num_finished"] == 5 and 3600 < s["ttft_mean_s"] < float("inf")


def test_azure_timestamps_outside_the_nanosecond_range_are_refused(tmp_path, capsys):
    trace = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.6805900,100,10\n"
                     "2300-01-01 00:00:00.0000000,100,10\n")
    code = _run(tmp_path, "workload=azure", f"workload.path={trace}", "workload.num_requests=2")
    _one_error_line(capsys, code, "line 3", "2300-01-01", "1678-2261")


def test_unbindable_or_unresolvable_hosts_name_the_setting():
    from engine.base.errors import ConfigError
    from engine.torch_exec.wire.addresses import check_host

    for key, host, words in [("executor.zmq_host", "192.0.2.1", "cannot be bound"),
                             ("executor.zmq_host", "::1", "IPv6"),
                             ("executor.master_addr", "no-such-host.invalid", "cannot be resolved")]:
        with pytest.raises(ConfigError, match=words) as info:
            check_host(key, host)
        assert f"{key}={host!r}" in str(info.value) and "127.0.0.1" in str(info.value)
    check_host("executor.zmq_host", "127.0.0.1")


def test_torch_run_with_an_unbindable_control_host_is_one_line(tmp_path, capsys):
    pytest.importorskip("torch")
    code = _run(tmp_path, "executor=torch", "model=tiny-llama", "parallel.pp=2", "kv.num_blocks=64",
                "workload.num_requests=2", "executor.zmq_host=192.0.2.1")
    _one_error_line(capsys, code, "executor.zmq_host='192.0.2.1'")


def test_report_with_an_unknown_tracking_scheme(tmp_path, capsys):
    code = main(["report", "testbed", "--tracking-uri", "garbage://x", "--out", str(tmp_path)])
    _one_error_line(capsys, code, "--tracking-uri='garbage://x'", "valid schemes: sqlite")


def test_profile_with_zero_repeats_is_refused(tmp_path, capsys):
    code = main(["profile", "--repeats", "0", "--quick", "--out", str(tmp_path)])
    _one_error_line(capsys, code, "--repeats=0", ">= 1")
    assert not list(tmp_path.iterdir())  # no empty profile saved


def test_compare_asks_for_yes_above_the_threshold(tmp_path, capsys):
    rates = ",".join(str(r) for r in range(1, 201))
    lens = ",".join(str(n) for n in range(10, 1010))
    code = main(["compare", f"output.dir={tmp_path}", *QUICK, f"workload.rate={rates}", f"workload.input_max={lens}"])
    _one_error_line(capsys, code, "200,000 points", "workload.rate (200) x workload.input_max (1,000)", "--yes")
    assert not (tmp_path / "compare").exists()


def _run_on_a_full_disk(tmp_path: Path) -> subprocess.CompletedProcess:
    """`testbed run` with output.dir on a 64 kB tmpfs (a private mount namespace, no root
    needed where user namespaces are enabled) and the MLflow store on the real disk."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("needs `unshare -rm` (user and mount namespaces) to mount a small tmpfs")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = (f"mount -t tmpfs -o size=64k tmpfs {out} && exec {sys.executable} -m testbed.cli run "
           f"output.dir={out} output.tracking_uri=sqlite:///{tmp_path}/mlflow.db output.plots=false "
           f"output.progress=false workload=synthetic workload.num_requests=300")
    return subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, env=env, timeout=300)


def test_full_disk_is_a_failed_run_with_one_clear_line(tmp_path):
    from mlflow.tracking import MlflowClient

    proc = _run_on_a_full_disk(tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "No space left on device" in errors[0] and "output.dir" in errors[0], proc.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])[0]
    assert run.info.status == "FAILED" and "No space left on device" in run.data.tags["error"]


def test_run_files_are_whole_or_absent(tmp_path):
    """A write that fails midway leaves no truncated file (and no `.part`) behind."""
    from testbed.run.outputs import OutputWriteError, write_run_dir
    from testbed.run.runner import run_experiment

    from conftest import small_config

    result = run_experiment(small_config("workload.num_requests=50", "output.microbatches=true", out_dir=tmp_path))
    target = tmp_path / "run"
    target.mkdir()
    (target / "microbatches.csv").mkdir()  # the one file that cannot be written
    with pytest.raises(OutputWriteError, match="microbatches.csv"):
        write_run_dir(result, target, plots=False)
    names = sorted(p.name for p in target.iterdir())
    assert names == ["config.yaml", "microbatches.csv", "requests.csv", "run_info.json", "summary.json"]
    assert (target / "requests.csv").read_text().count("\n") == 51


def test_uri_passwords_are_redacted_in_params_and_config_yaml(tmp_path):
    from testbed.run.outputs import write_run_dir
    from testbed.config.redact import redact
    from testbed.run.runner import run_experiment

    from conftest import small_config

    cfg = small_config("workload.num_requests=5", "output.tracking_uri=postgresql://bob:hunter2@db.example/mlflow",
                       out_dir=tmp_path)
    params = cfg.params()
    assert params["output.tracking_uri"] == "postgresql://bob:***@db.example/mlflow"
    run_dir = write_run_dir(run_experiment(cfg), tmp_path / "run", plots=False)
    text = "".join(p.read_text() for p in run_dir.iterdir())
    assert "hunter2" not in text and "bob:***@db.example" in text
    assert redact("https://tok123@mlflow.example") == "https://***@mlflow.example"
    assert redact("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


# ---- issue 38, items 7 and 9: the last tracebacks and silent accepts of the command line ----------
@pytest.mark.parametrize("args, needles", [
    (["tune.heartbeat=1e12"], ("tune.heartbeat=", "[0, 86400]")),
    (["tune.grace_period=1e15"], ("tune.grace_period=", "[1, 604800]")),
    (["tune.space.policy.T=a,b"], ("tune.space.policy.T=", "policy.T='a'", "must be an integer")),
    (["tune.space.policy.T=1.5:8"], ("tune.space.policy.T=1.5:8", "policy.T=1.5", "must be an integer")),
    (["tune.storage=journal:/nonexistent-38/dir/j.log"], ("tune.storage=journal:/nonexistent-38/dir/j.log",
                                                          "/nonexistent-38/dir does not exist")),
])
def test_tune_settings_that_crashed_or_were_taken(tmp_path, capsys, args, needles):
    code = main(["tune", f"output.dir={tmp_path}", *QUICK, "tune.trials=1", *args])
    _one_error_line(capsys, code, *needles)
    assert not Path("/nonexistent-38").exists()
    assert not (tmp_path / "optuna.db").exists()  # refused before any study was made


@pytest.mark.parametrize("uri", ["postgresql://lab:pw@127.0.0.1:1/optuna", "postgresql://lab@no-such-host.invalid/db",
                                 "postgresql://"])
def test_tune_with_an_unreachable_postgres_is_one_line(tmp_path, capsys, uri):
    pytest.importorskip("psycopg")
    code = main(["tune", f"output.dir={tmp_path}", *QUICK, "tune.trials=1", f"tune.storage={uri}"])
    err = _one_error_line(capsys, code, "cannot reach tune.storage=postgresql://", "is the server running")
    assert "pw" not in err


@pytest.mark.parametrize("args, needles", [
    (["workload.input_mean=9e18"], ("workload.input_mean=9e+18", "<= 2147483647")),
    (["workload.output_dist=uniform", "workload.output_max=1e10"], ("workload.output_max=", "<= 2147483647")),
])
def test_synthetic_lengths_that_are_no_token_counts(tmp_path, capsys, args, needles):
    _one_error_line(capsys, _run(tmp_path, *args), *needles)


def test_a_run_whose_requests_all_failed_says_so(tmp_path, capsys):
    code = _run(tmp_path, "workload.input_mean=1000000000", "workload.num_requests=3")
    cap = capsys.readouterr()
    out = cap.out + cap.err
    assert code == 0
    assert "warning: 3 of 3 requests failed: needs" in " ".join(out.split()), out


def test_azure_token_counts_past_the_token_range_are_refused(tmp_path, capsys):
    trace = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     f"2023-11-16 18:15:46.6805900,{2**62},10\n")
    code = _run(tmp_path, "workload=azure", f"workload.path={trace}", "workload.num_requests=1")
    _one_error_line(capsys, code, "line 2", f"ContextTokens='{2**62}'", "[0, 2147483647]")


@pytest.mark.parametrize("command", [["capacity", "--base-url", "http://127.0.0.1:9"],
                                     ["bench", "serve", "--base-url", "http://127.0.0.1:9"]])
def test_a_vocabulary_of_zero_is_refused(tmp_path, capsys, command):
    code = main([*command, "--vocab-size", "0", f"output.dir={tmp_path}"])
    _one_error_line(capsys, code, "--vocab-size 0", ">= 1")


def test_tune_against_an_mlflow_server_that_refuses_the_host_name_stops_before_the_study(tmp_path, capsys):
    """MLflow 3's server answers 403 "Invalid Host header" outside `--allowed-hosts`: tune found out
    from a 46-line traceback after its study was created (issue 38 item 7). A stand-in server answers
    as MLflow's does."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class RefusesHost(BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"Invalid Host header - possible DNS rebinding attack detected"
            self.send_response(403)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), RefusesHost)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        code = main(["tune", f"output.dir={tmp_path}", "workload=synthetic", "workload.num_requests=20",
                     "output.plots=false", "output.progress=false", "tune.trials=1",
                     f"output.tracking_uri=http://127.0.0.1:{port}"])
    finally:
        server.shutdown()
    _one_error_line(capsys, code, "403 Invalid Host header", f"--allowed-hosts 127.0.0.1:{port}")
    assert not (tmp_path / "optuna.db").exists()
