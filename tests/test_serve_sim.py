"""`testbed serve executor=sim` (the simulator paced by the wall clock) driven by the `openai`
package and by `testbed bench serve`: the consistency check against `testbed run`, 429, bad
requests, /metrics, MLflow."""
from __future__ import annotations

import math

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from engine.torch_exec.driver import free_port  # noqa: E402
from testbed.config import compose, to_container  # noqa: E402

SIM = ["executor=sim", "model=llama2-70b", "hardware=a100-80g", "parallel.pp=4", "policy=gllm",
       "output.plots=false", "output.progress=false"]
WORKLOAD = ["workload=synthetic", "workload.num_requests=16", "workload.rate=2", "workload.input_dist=uniform",
            "workload.input_min=64", "workload.input_max=512", "workload.output_dist=uniform",
            "workload.output_min=8", "workload.output_max=32", "seed=3"]


def _server(tmp_path, *extra, mlflow=False):
    from testbed.serve.main import build_server

    cfg = to_container(compose(SIM + [f"serve.port={free_port()}", f"output.dir={tmp_path}",
                                      f"output.mlflow={str(mlflow).lower()}", "check_integrity=true", *extra]))
    srv = build_server(cfg)
    srv.start_background()
    return srv


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0)


def test_bench_serve_reproduces_testbed_run(tmp_path):
    """Item 5 of the issue: served throughput and mean TTFT/TPOT within 5% of `testbed run`."""
    from testbed.bench_serve import run_bench_serve
    from testbed.runner import run_experiment

    offline = run_experiment(to_container(compose(SIM + WORKLOAD + [f"output.dir={tmp_path}",
                                                                     "output.mlflow=false"]))).summary
    srv = _server(tmp_path)
    try:
        result, run_dir = run_bench_serve(srv.base_url, WORKLOAD + [f"output.dir={tmp_path}", "output.mlflow=false"])
    finally:
        server_side = srv.shutdown().summary
    served = result.summary
    assert served["num_finished"] == offline["num_finished"] == 16
    for key in ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s"):
        assert served[key] == pytest.approx(offline[key], rel=0.05), key
        assert server_side[key] == pytest.approx(offline[key], rel=0.05), key
    assert (run_dir / "requests.csv").exists() and (run_dir / "summary.json").exists()
    assert not math.isnan(served["itl_mean_s"]) and served["goodput_req_s"] > 0
    assert srv.ctrl.kv.num_used == 0
    srv.ctrl.kv.check_integrity()


def test_full_queue_answers_429_and_metrics_count_it(tmp_path):
    import concurrent.futures as cf

    srv = _server(tmp_path, "serve.max_queue=2", "serve.time_scale=2")
    client = _client(srv)

    def one(i):
        try:
            return client.completions.create(model="llama2-70b", prompt=[5] * 64, max_tokens=20).usage.completion_tokens
        except openai.RateLimitError as exc:
            return exc

    try:
        with cf.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(one, range(6)))
        limited = [o for o in outs if isinstance(o, Exception)]
        assert limited and all(o == 20 for o in outs if not isinstance(o, Exception))
        body = limited[0].body
        assert limited[0].status_code == 429 and "serve.max_queue=2" in body["message"]
        text = httpx.get(srv.base_url + "/metrics").text
        assert 'testbed_request_rejected_total{model_name="llama2-70b",status="429"}' in text
        assert "testbed_time_to_first_token_seconds_bucket" in text and "testbed_stage_bubble_ratio" in text
        assert 'testbed_num_requests_running{model_name="llama2-70b"} 0.0' in text
    finally:
        srv.shutdown()
    assert srv.ctrl.kv.num_used == 0


def test_streamed_placeholders_and_mlflow_run(tmp_path):
    from mlflow.tracking import MlflowClient

    srv = _server(tmp_path, "serve.time_scale=4", mlflow=True)
    client = _client(srv)
    try:
        chunks = list(client.completions.create(model="llama2-70b", prompt="hello", max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == " 0 1 2 3 4 5"  # the simulator's placeholder tokens (codec.py)
        assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens == 5
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        health = httpx.get(srv.base_url + "/health")
        assert health.status_code == 200
    finally:
        srv.shutdown()
    runs = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
        [MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_experiment_by_name("testbed").experiment_id])
    assert runs[0].info.status == "FINISHED" and runs[0].data.tags["mode"] == "serve"
    assert runs[0].data.metrics["num_finished"] == 1
