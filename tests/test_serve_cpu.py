"""`testbed serve executor=torch` on a CPU machine as a newcomer starts it (issue 25, item 13):
no `kv.num_blocks`, so the pool is sized from the memory available, not from a GPU's."""
from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("torch")
pytest.importorskip("fastapi")

from engine.torch_exec.driver import free_port  # noqa: E402
from testbed.config import compose, to_container  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from testbed.serve.main import build_server

    out = tmp_path_factory.mktemp("serve")
    cfg = to_container(compose(["executor=torch", "model=tiny-llama", "parallel.pp=2", f"serve.port={free_port()}",
                                f"output.dir={out}", "output.mlflow=false", f"executor.model_cache_dir={out}/models"]))
    srv = build_server(cfg)
    srv.start_background()
    yield srv
    srv.shutdown()


def test_cpu_pool_is_sized_from_available_memory(server):
    from engine.settings import MAX_KV_BLOCKS
    from engine.torch_exec.kv_sizing import CPU_KV_CAP_BYTES, block_bytes, cpu_pool_for

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
    from engine.errors import ConfigError
    from engine.torch_exec.kv_sizing import GIB, cpu_pool_blocks

    assert cpu_pool_blocks(1 << 20, 8 * GIB) == 2048  # a quarter of 8 GiB in 1 MiB blocks
    assert cpu_pool_blocks(1 << 20, 64 * GIB) == 4096  # capped at 4 GiB on a big machine
    assert cpu_pool_blocks(1 << 20, 64 * GIB, max_blocks=100) == 100
    with pytest.raises(ConfigError, match="kv.num_blocks"):
        cpu_pool_blocks(1 << 30, 1 * GIB)
