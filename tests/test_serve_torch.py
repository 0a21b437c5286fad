"""`testbed serve executor=torch` (tiny-llama, P=2, CPU) driven by the official `openai` client:
streaming and not, 16 concurrent clients, stop handling, seeds, disconnects, bad requests, 429.
After every test the server is idle with every KV block free and the block manager consistent."""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import multiprocessing
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("fastapi")

from engine.torch_exec.wire.addresses import free_port  # noqa: E402
from testbed.config.spec import compose_spec  # noqa: E402

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from testbed.serve.main import build_server

    out = tmp_path_factory.mktemp("serve")
    cfg = compose_spec([
        "executor=torch", f"model={MODEL}", "parallel.pp=2", "policy=gllm", "kv.num_blocks=96", "kv.block_size=8",
        f"serve.port={free_port()}", f"output.dir={out}", "output.mlflow=false", "check_integrity=true",
        f"executor.model_cache_dir={out}/models"])
    srv = build_server(cfg)
    srv.start_background()
    yield srv
    srv.shutdown()
    assert srv.ctrl.kv.num_used == 0
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("pp-stage")]  # stages stopped


@pytest.fixture(autouse=True)
def idle_and_intact(server):
    yield
    ctrl, engine = server.ctrl, server.engine
    from signal_helpers import WAIT_S

    deadline = time.monotonic() + WAIT_S  # bounded, not a speed assertion (30 s once)
    while engine.num_open or ctrl.waiting or ctrl.running or ctrl.inflight or not engine.inbox.empty():
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.05)
    time.sleep(0.1)
    ctrl.kv.check_integrity()
    assert ctrl.kv.num_used == 0 and server.app.state.serve.open == 0
    assert engine.dead is None


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def _last_request_done(server, timeout_s=20.0):
    """The latest request, once it is done (an in-flight abort completes with its micro-batch)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seq = max(server.ctrl.sequences.values(), key=lambda s: s.seq_id)
        if seq.is_done and not server.engine.num_open:
            return seq
        assert time.monotonic() < deadline, "the abandoned request did not end"
        time.sleep(0.02)


def _greedy(client, prompt, n=8, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw)


def test_models_health_and_greedy_text_or_ids(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    a = _greedy(client, [5, 6, 7, 8, 9])
    b = _greedy(client, "5 6 7 8 9")  # the fallback codec reads whitespace-separated ids
    assert a.choices[0].text == b.choices[0].text and a.choices[0].finish_reason == "length"
    assert a.usage.prompt_tokens == 5 and a.usage.completion_tokens == 8
    assert len(a.choices[0].text.split()) == 8


def test_stream_equals_non_stream_and_chat_streams(client):
    ref = _greedy(client, [11, 12, 13], 6).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=[11, 12, 13], max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert len("".join(c.choices[0].delta.content or "" for c in chat).split()) == 4
    assert chat[-1].choices[0].finish_reason == "length"
    full = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens == 3


def test_sixteen_concurrent_clients_get_their_own_greedy_tokens(client):
    prompts = [[20 + i] * (3 + 2 * i) for i in range(16)]
    alone = [_greedy(client, p, 5).choices[0].text for p in prompts[:3]]

    def one(i):
        if i % 2:
            chunks = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=5, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return _greedy(client, prompts[i], 5).choices[0].text

    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(one, range(16)))
    assert all(len(o.split()) == 5 for o in outs)
    assert outs[:3] == alone  # batching with 15 others does not change a request's greedy tokens


def test_stop_strings_stop_token_ids_and_seeds(client):
    ids = [int(t) for t in _greedy(client, [40, 41, 42], 8).choices[0].text.split()]
    k = next(i for i in range(2, 8) if ids[i] not in ids[:i])
    r = _greedy(client, [40, 41, 42], 8, extra_body={"stop_token_ids": [ids[k]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
    assert r.choices[0].text.split() == [str(t) for t in ids[:k]]
    full = " ".join(str(t) for t in ids)  # the random checkpoint's tokenizer: "17 30512 8"
    stop = f" {ids[k]} {ids[k + 1]}" if k + 1 < 8 else f" {ids[k]}"
    r = _greedy(client, [40, 41, 42], 8, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.find(stop)]
    kw = dict(model=MODEL, prompt=[7, 8, 9], max_tokens=6, temperature=1.0, top_p=0.9, seed=11,
              presence_penalty=0.5, frequency_penalty=0.2, extra_body={"top_k": 40, "repetition_penalty": 1.3})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # same seed, same prompt: same tokens


def test_stream_disconnect_aborts_and_frees_kv(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as h:
        with h.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": [3] * 40, "max_tokens": 600,
                                                        "stream": True}) as resp:
            lines = 0
            for line in resp.iter_lines():
                lines += line.startswith("data:")
                if lines >= 3:
                    break  # leaving the block closes the connection mid-stream
    seq = _last_request_done(server)
    assert seq.fail_reason.startswith("aborted") and seq.num_generated < 600


def test_non_stream_disconnect_aborts(server):
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": [4] * 30, "max_tokens": 700},
                   timeout=0.5)
    seq = _last_request_done(server)
    assert seq.fail_reason.startswith("aborted") and seq.num_generated < 700


@pytest.mark.parametrize("body, words", [
    ({"prompt": [1, 2], "n": 2}, "n=2"),
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 99999]}, "outside the vocabulary"),
    ({"prompt": [1, 2], "max_tokens": 5000}, "exceeds"),
    ({"prompt": [1] * 700, "max_tokens": 100}, "KV blocks"),
    ({"prompt": [[1, 2], [3, 4]]}, "2 prompts"),
    ({"prompt": [1, 2], "logprobs": 2}, "logprobs"),
    ({"prompt": [1, 2], "stop": [""]}, "stop"),
    ({"prompt": "", "max_tokens": 2}, "empty"),
    ({"prompt": [1, 2], "stream_options": {"include_usage": True}}, "stream_options"),
    # issue 25 item 1: each of these stopped the engine for every client (the field and its range named)
    ({"prompt": [1, 2], "seed": 2 ** 64}, "seed: Input should be less than or equal to 9223372036854775807"),
    ({"prompt": [1, 2], "seed": -2 ** 63 - 1}, "seed: Input should be greater than or equal to -9223372036854775808"),
    ({"prompt": [1, 2], "top_k": 2 ** 64}, "top_k: Input should be less than or equal to 2147483647"),
    ({"prompt": [1, 2], "temperature": 1e-45}, "0 (greedy) or [0.01, 2]"),
    ({"prompt": [1, 2], "repetition_penalty": 1e-300}, "repetition_penalty: Input should be greater than or equal to 0.01"),
])
def test_bad_requests_get_openai_400(server, body, words):
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"]


@pytest.mark.parametrize("sampling, outcome", [
    (dict(seed=2 ** 64), "error"),  # the stages cannot pack it: this request fails, alone
    (dict(temperature=1e-45, seed=3), "length"),  # inf/NaN probabilities: now sampled safely
    (dict(temperature=1.0, repetition_penalty=1e-300, seed=3), "length"),
])
def test_a_request_past_the_api_checks_cannot_stop_the_engine(server, client, sampling, outcome):
    """Past the HTTP checks (any other caller of the engine loop), one request's sampling made the
    stage's sampler raise or the control plane fail to pack it: the engine thread died, every
    later request got 503 and the stage's traceback reached the client (issue 25, item 1)."""
    import asyncio

    from engine.core.request import SamplingParams
    from testbed.serve.protocol import GenerateSpec

    loop = asyncio.new_event_loop()
    try:
        gen = server.engine.submit(GenerateSpec((5, 6, 7), 4, SamplingParams(**sampling)), loop)

        async def end():
            while (ev := await gen.queue.get())[0] != "end":
                pass
            return ev

        ev = loop.run_until_complete(asyncio.wait_for(end(), 120))
    finally:
        loop.close()
    assert ev[1] == outcome, ev
    assert "Traceback" not in str(ev[4])
    assert server.engine.dead is None
    assert _greedy(client, [1, 2], 2).usage.completion_tokens == 2  # still serving


def test_error_text_for_clients_has_no_traceback():
    from testbed.serve.protocol import public_message

    stage = ('stage 1 failed: Traceback (most recent call last):\n  File "/srv/engine/torch_exec/stage/worker.py", '
             'line 9, in run\n    tok = sample(x)\n    ^^^^^^\nRuntimeError: probability tensor contains inf')
    msg = public_message(stage)
    assert msg == "stage 1 failed: RuntimeError: probability tensor contains inf"
    assert "Traceback" not in msg and "/srv/" not in msg


def test_malformed_bodies_unknown_model_and_routes(server, client):
    for raw in (b"{not json", b"[1, 2]", b'"text"'):
        r = httpx.post(server.base_url + "/v1/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=3"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=3)
    assert httpx.get(server.base_url + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert _greedy(client, [1, 2], 2).usage.completion_tokens == 2  # still serving


def test_full_queue_answers_429(server, client):
    state = server.app.state.serve
    saved = state.settings
    state.settings = dataclasses.replace(saved, max_queue=2)
    try:
        def one(i):
            try:
                return client.completions.create(model=MODEL, prompt=[9] * 20, max_tokens=40).usage.completion_tokens
            except openai.RateLimitError as exc:
                return exc
        with cf.ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(one, range(8)))
    finally:
        state.settings = saved
    limited = [o for o in outs if isinstance(o, Exception)]
    assert limited and all(o == 40 for o in outs if not isinstance(o, Exception))
    assert limited[0].status_code == 429
    metrics = httpx.get(server.base_url + "/metrics").text
    assert 'status="429"' in metrics and "testbed_kv_cache_usage_perc" in metrics
    assert json.loads(json.dumps(limited[0].body))["code"] == "rate_limit_exceeded"
