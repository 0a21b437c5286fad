"""What one HTTP client can do to `testbed serve` (issue 25, item 8, and the error shape of item 14):
text that JSON allows but no tokenizer can take is a 400, not a 500; a body over
`serve.max_body_bytes` is a 413 before it is read whole; a client that sends its headers or its
body too slowly loses its connection (408 for the body); every error body has OpenAI's shape with
a string `code`. The paced simulator serves (no torch)."""
from __future__ import annotations

import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_serve_sim import _server  # noqa: E402

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = _server(tmp_path_factory.mktemp("serve"), "serve.time_scale=50", "serve.max_body_bytes=8192",
                  "serve.header_timeout_s=0.5", "serve.body_timeout_s=0.5")
    yield srv
    srv.shutdown()


def _post(server, raw: bytes, route="/v1/completions", headers=JSON):
    return httpx.post(server.base_url + route, content=raw, headers=headers, timeout=30)


def _assert_openai_error(r, status: int, words: str):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["code"], str) and words in err["message"]
    assert "Traceback" not in r.text and ".py" not in r.text


@pytest.mark.parametrize("route, raw, words", [
    ("/v1/completions", rb'{"prompt": "\ud800 hi", "max_tokens": 2}', "surrogate"),
    ("/v1/completions", rb'{"prompt": ["\udfff"], "max_tokens": 2}', "surrogate"),
    ("/v1/completions", rb'{"prompt": [1, 2], "stop": "\ud83d", "max_tokens": 2}', "surrogate"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\udc00"}], "max_tokens": 2}', "surrogate"),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
     "surrogate"),
    ("/v1/completions", b'{"prompt": [1], "max_tokens": ' + b"9" * 5000 + b"}", "pars"),
    ("/v1/completions", b'{"prompt": [' + b"1" * 4400 + b'], "max_tokens": 2}', "pars"),
])
def test_text_json_allows_but_no_tokenizer_takes_is_a_400(server, route, raw, words):
    _assert_openai_error(_post(server, raw, route), 400, words)


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", "max_tokens": \xc2\xb2}', b'{"prompt": "hi",}', b"{"])
def test_a_body_that_is_not_json_says_so_and_where(server, raw):
    r = _post(server, raw)
    _assert_openai_error(r, 400, "the request body is not valid JSON")
    assert r.json()["error"]["param"] is None and " at character " in r.json()["error"]["message"]


def test_unicode_digits_are_text_not_token_ids(server):
    """"²" and "٣" are digits to str.isdigit() but not ids: the fallback codec encodes them as bytes."""
    r = _post(server, '{"prompt": "1 2 \u00b2 \u0663", "max_tokens": 2}'.encode())
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("1 2 \u00b2 \u0663".encode())


def test_body_over_the_limit_is_413_declared_or_streamed(server):
    big = b'{"prompt": [' + b"1, " * 3000 + b'1], "max_tokens": 2}'
    _assert_openai_error(_post(server, big), 413, "serve.max_body_bytes=8,192")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(10):
            yield b" " * 1000
    _assert_openai_error(_post(server, chunks()), 413, "serve.max_body_bytes")
    ok = _post(server, b'{"prompt": [1, 2], "max_tokens": 2}')
    assert ok.status_code == 200, ok.text  # still serving


def _raw(server, data: bytes) -> bytes:
    """Send `data` on a fresh connection, then read until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_slow_headers_lose_the_connection(server):
    assert _raw(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") == b""  # closed, never answered
    assert _raw(server, b"") == b""  # a connection that sends nothing


def test_stalled_body_is_408(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    reply = _raw(server, head + b'{"prompt": [1')
    assert reply.startswith(b"HTTP/1.1 408") and b"serve.body_timeout_s" in reply and b'"code":' in reply


def test_unknown_route_and_method_use_the_same_error_shape(server):
    _assert_openai_error(httpx.get(server.base_url + "/v1/nothing"), 404, "Not Found")
    _assert_openai_error(httpx.get(server.base_url + "/v1/completions"), 405, "Method Not Allowed")
    _assert_openai_error(_post(server, b"{not json"), 400, "JSON")


def test_limits_are_validated():
    from engine.base.errors import ConfigError
    from testbed.config.serve import ServeSettings

    with pytest.raises(ConfigError, match="serve.max_body_bytes"):
        ServeSettings(max_body_bytes=10)
    with pytest.raises(ConfigError, match="serve.header_timeout_s"):
        ServeSettings(header_timeout_s=0)


def _stream_through_shutdown(srv) -> list[str]:
    """Stream a long reply, shut the server down once it flows; the stream's non-empty lines
    (a transport error is an entry of its own)."""
    import threading

    lines: list[str] = []
    first = threading.Event()

    def stream():
        body = {"prompt": [1] * 16, "max_tokens": 5000, "stream": True}
        try:
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()
        except httpx.HTTPError as exc:
            lines.append(f"transport error: {exc!r}")
        first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    from signal_helpers import WAIT_S

    assert first.wait(WAIT_S)
    srv.shutdown()
    reader.join(WAIT_S)  # 60 s once: a reader still running returned a partial list
    assert not reader.is_alive()
    return lines


def test_requests_cut_at_shutdown_make_the_mlflow_run_killed(tmp_path):
    """docs/serving.md: KILLED when requests had to be aborted at shutdown (they were recorded
    FINISHED: uvicorn cancels the open handlers first, so none looked open any more)."""
    from mlflow.tracking import MlflowClient

    srv = _server(tmp_path, "serve.time_scale=1", "serve.drain_timeout_s=0.5", mlflow=True)
    _stream_through_shutdown(srv)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name("testbed").experiment_id])[0]
    assert run.info.status == "KILLED"
    assert run.data.metrics["num_finished"] == 0


# ---- issue 38, items 8 to 10 --------------------------------------------------------------------
@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "' + b"7" * 4301 + b'", "max_tokens": 2}', "4301 digits"),
    (b'{"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [18446744073709551616]}', "stop_token_ids"),
    (b'{"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [-1]}', "stop_token_ids"),
    (b'{"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [40000000]}', "stop token id 40000000"),
    (b'{"prompt": [1, 2], "max_tokens": 2, "stream": "yes"}', "stream"),
    (b'{"prompt": [1, 2], "max_tokens": 2, "ignore_eos": "no"}', "ignore_eos"),
    (b'{"prompt": [true, false], "max_tokens": 2}', "prompt"),
    (b'{"prompt": true, "max_tokens": 2}', "prompt"),
])
def test_values_that_were_a_500_or_silently_coerced_are_a_400(server, raw, words):
    _assert_openai_error(_post(server, raw), 400, words)


def test_a_body_drip_fed_within_the_gap_limit_is_still_cut(server):
    """serve.body_timeout_s bounds the whole body: one byte every 0.2 s never tripped a 0.5 s gap limit."""
    body = b'{"prompt": [1, 2], "max_tokens": 2}'
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head)
        try:
            for i in range(len(body)):
                s.sendall(body[i:i + 1])
                time.sleep(0.2)
        except OSError:
            pass  # closed by the server after its 408
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
    assert got.startswith(b"HTTP/1.1 408") and b"serve.body_timeout_s" in got, got[:200]


def test_one_address_holds_at_most_max_connections_per_client(tmp_path):
    srv = _server(tmp_path, "serve.time_scale=50", "serve.max_connections_per_client=2")
    try:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=30) for _ in range(2)]
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as third:
            reply = b""
            while chunk := third.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 429") and b"serve.max_connections_per_client=2" in reply, reply
        held.pop().close()
        from signal_helpers import WAIT_S

        deadline = time.monotonic() + WAIT_S  # bounded, not a speed assertion (10 s once)
        while True:  # the server sees the close a moment later
            r = _post(srv, b'{"prompt": [1, 2], "max_tokens": 2}')
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200, r.text
        for s in held:
            s.close()
    finally:
        srv.shutdown()


def test_streams_cut_at_shutdown_end_with_an_error_event_and_done(tmp_path, capfd):
    """After serve.drain_timeout_s the open streams get an error event and `[DONE]`; uvicorn
    cancelled them mid-body before (no event, no [DONE], one console traceback each)."""
    srv = _server(tmp_path, "serve.time_scale=1", "serve.drain_timeout_s=0.5")
    lines = _stream_through_shutdown(srv)
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert '"code":"service_unavailable"' in lines[-2] and "shutting down" in lines[-2], lines[-3:]
    assert "Traceback" not in capfd.readouterr().err
