"""`testbed serve executor=torch` on a CPU machine as a newcomer starts it (issue 25, item 13):
no `kv.num_blocks`, so the pool is sized from the memory available, not from a GPU's."""
from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("fastapi")

from engine.torch_exec.wire.addresses import free_port  # noqa: E402
from testbed.config.spec import compose_spec  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from testbed.serve.main import build_server

    out = tmp_path_factory.mktemp("serve")
    cfg = compose_spec(["executor=torch", "model=tiny-llama", "parallel.pp=2", f"serve.port={free_port()}",
                                f"output.dir={out}", "output.mlflow=false", f"executor.model_cache_dir={out}/models"])
    srv = build_server(cfg)
    srv.start_background()
    yield srv
    srv.shutdown()


def test_the_server_warms_up_before_it_listens_then_forgets_the_warm_up(server):
    """Issue 25, item 12: /health answers once the engine has served its warm-up requests
    (serve.warmup_requests=4), which the run's results do not count."""
    from engine.core.metrics import microbatch_rows, request_rows

    ctrl = server.ctrl
    assert ctrl.executor.num_launched >= 4  # prefill and decode micro-batches ran before any client
    assert request_rows(ctrl) == [] and microbatch_rows(ctrl) == []
    assert ctrl.num_finished == 0 and ctrl.executor.tracer.busy == {} and ctrl.kv.num_used == 0
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_cpu_pool_is_sized_from_available_memory(server):
    from engine.base.settings import MAX_KV_BLOCKS
    from engine.torch_exec.shared.kv_sizing import CPU_KV_CAP_BYTES, block_bytes, cpu_pool_for

    arch = server.ctrl.executor.arch
    n = server.info["kv_num_blocks"]
    assert n == server.ctrl.kv.num_blocks == cpu_pool_for(arch, server.ctrl.kv.block_size, "float32", MAX_KV_BLOCKS)
    per_block = block_bytes(arch.num_layers, server.ctrl.kv.block_size, arch.num_kv_heads, arch.head_dim, 4)
    assert 1 <= n and n * per_block <= CPU_KV_CAP_BYTES
    r = httpx.post(server.base_url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4,
                                                              "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_cpu_pool_arithmetic():
    from engine.base.errors import ConfigError
    from engine.torch_exec.shared.kv_sizing import GIB, cpu_pool_blocks

    assert cpu_pool_blocks(1 << 20, 8 * GIB) == 2048  # a quarter of 8 GiB in 1 MiB blocks
    assert cpu_pool_blocks(1 << 20, 64 * GIB) == 4096  # capped at 4 GiB on a big machine
    assert cpu_pool_blocks(1 << 20, 64 * GIB, max_blocks=100) == 100
    with pytest.raises(ConfigError, match="kv.num_blocks"):
        cpu_pool_blocks(1 << 30, 1 * GIB)


def test_an_outside_client_with_the_checkpoints_tokenizer_counts_the_servers_tokens(server):
    """Issue 25, item 12: the random checkpoint ships tokenizer.json; a client that loads it (as
    aiperf and guidellm do) counts exactly the prompt and completion tokens the server reports."""
    from pathlib import Path

    from tokenizers import Tokenizer

    folder = Path(server.ctrl.executor.model_path)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))  # the client's own copy, not the server's codec
    assert server.info["codec"] == "random-tokenizer"
    prompts = ["The quick brown fox jumps over 17 lazy dogs", "  ünïcødé ² text\twith 30512 tabs  ", "5 6 7 8 9"]
    for i, prompt in enumerate(prompts):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": i, "ignore_eos": True}
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120).json()
        assert r["usage"]["prompt_tokens"] == len(tok.encode(prompt).ids), prompt
        text = r["choices"][0]["text"]
        assert len(tok.encode(text).ids) == r["usage"]["completion_tokens"] == 12, text
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=chat, timeout=120) as r:
        import json

        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    usage = events[-1]["usage"]
    assert len(tok.encode(text).ids) == usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] == len(tok.encode("user: Hello there\nassistant:").ids) == 4
