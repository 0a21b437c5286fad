"""Sizing the KV pool from measured GPU memory (engine/torch_exec/shared/kv_sizing.py), the stages'
device assignment and data-plane backend (engine/torch_exec/stage/transfer.py), the dtype default,
and the handshake messages -- all pure logic, checked on CPU with fake memory figures."""
from __future__ import annotations

import pytest

from engine.base.errors import ConfigError
from engine.core.kv import BlockManager
from engine.torch_exec.wire import messages as wire
from engine.torch_exec.shared.kv_sizing import (DEFAULT_PROFILE_TOKENS, StageMemory, block_bytes, pool_size,
                                         profile_tokens, warmup_shape)
from engine.torch_exec.settings import TorchSettings

GIB = 1 << 30


def probe(stage, key="h:gpu0", free=60 * GIB, peak=10 * GIB, resident=8 * GIB, per_block=1 << 20,
          total=80 * GIB) -> StageMemory:
    return StageMemory(stage, key, total, free, peak, resident, per_block)


def test_one_stage_gets_utilisation_of_free_minus_its_activations():
    size = pool_size([probe(0)], 0.9)
    assert size.num_blocks == int((0.9 * 60 * GIB - 2 * GIB) // (1 << 20))
    assert size.stages_per_device == {"h:gpu0": 1}


def test_stages_on_one_gpu_split_it_instead_of_each_claiming_it():
    one = pool_size([probe(0)], 0.9).num_blocks
    four = [probe(s) for s in range(4)]
    size = pool_size(four, 0.9)
    assert size.stages_per_device == {"h:gpu0": 4}
    # all four pools (one size, each stage its own layers) and activations fit the one device
    used = size.num_blocks * 4 * (1 << 20) + 4 * 2 * GIB
    assert used <= 0.9 * 60 * GIB < used + 4 * (1 << 20)
    assert size.num_blocks < one // 3


def test_stages_with_more_layers_weigh_more_in_the_split():
    small, big = probe(0, per_block=1 << 20), probe(1, per_block=3 << 20)
    n = pool_size([small, big], 0.5).num_blocks
    assert n == int((0.5 * 60 * GIB - 4 * GIB) // (4 << 20))


def test_own_gpus_each_fit_and_the_tightest_device_decides():
    a = probe(0, key="h:gpu0", free=60 * GIB)
    b = probe(1, key="h:gpu1", free=20 * GIB)
    size = pool_size([a, b], 0.9)
    assert size.per_device["h:gpu0"] > size.per_device["h:gpu1"] == size.num_blocks
    assert size.stages_per_device == {"h:gpu0": 1, "h:gpu1": 1}


def test_the_lowest_reading_of_a_shared_device_counts():
    n_low = pool_size([probe(0, free=30 * GIB), probe(1, free=60 * GIB)], 0.9).num_blocks
    n_both_low = pool_size([probe(0, free=30 * GIB), probe(1, free=30 * GIB)], 0.9).num_blocks
    assert n_low == n_both_low


def test_a_cap_applies_and_no_room_is_one_error_naming_the_device():
    assert pool_size([probe(0)], 0.9, max_blocks=100).num_blocks == 100
    with pytest.raises(ConfigError, match="does not fit on h:gpu1"):
        pool_size([probe(0), probe(1, key="h:gpu1", free=GIB, peak=9 * GIB)], 0.9)


def test_profile_tokens_from_setting_policy_budget_or_default():
    assert profile_tokens(512, {"token_budget": 2048}) == 512
    assert profile_tokens(None, {"token_budget": 2048, "max_num_seqs": 128}) == 2048
    assert profile_tokens(None, {"max_num_batched_tokens": 16384}) == 16384
    assert profile_tokens(None, {"max_p": 4096, "min_p": 32}) == 4096
    assert profile_tokens(None, {"kv_thresh": 0.1, "flag": True}) == DEFAULT_PROFILE_TOKENS
    assert profile_tokens(None, None) == DEFAULT_PROFILE_TOKENS


def test_warmup_batch_shape_covers_the_tokens():
    prefill, decodes, blocks = warmup_shape(2048, 16)
    assert prefill + decodes == 2048 and decodes == 256
    assert blocks == 1792 // 16 + 256
    assert warmup_shape(8, 16) == (4, 4, 5)
    assert block_bytes(28, 16, 4, 128, 2) == 2 * 28 * 16 * 4 * 128 * 2


def test_block_manager_takes_the_measured_size_before_use_only():
    kv = BlockManager(1, 16)
    kv.resize(500)
    assert kv.num_blocks == kv.num_free == 500
    kv.allocate(7, 40)
    with pytest.raises(RuntimeError):
        kv.resize(10)


def test_dtype_defaults_to_bf16_on_cuda_float32_on_cpu_explicit_wins():
    assert TorchSettings().resolved_dtype == "float32"
    assert TorchSettings(device="cuda").resolved_dtype == "bfloat16"
    assert TorchSettings(device="cuda", dtype="float32").resolved_dtype == "float32"
    assert TorchSettings(dtype="float16").resolved_dtype == "float16"
    with pytest.raises(ConfigError, match="executor.profile_tokens"):
        TorchSettings(profile_tokens=0)


def test_handshake_messages_round_trip():
    codec = wire.Codec(bytes(range(32)))
    for msg in (wire.KvProbe(1, "host:GPU-abc", 80 * GIB, 70 * GIB, 9 * GIB, 8 * GIB, 1 << 20), wire.KvPool(0),
                wire.KvPool(1234)):
        assert codec.decode(codec.encode(msg)) == msg


def test_stage_devices_and_backend():
    pytest.importorskip("torch")
    from engine.torch_exec.shared.placement import data_backend, stage_device

    assert [stage_device(s, 4) for s in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [stage_device(s, 2) for s in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [stage_device(s, 1) for s in range(3)] == ["cuda:0"] * 3
    assert data_backend("auto", "cpu", 2, 0) == "gloo"
    assert data_backend("auto", "cuda", 2, 2) == "nccl"  # each stage its own GPU
    assert data_backend("auto", "cuda", 4, 8) == "nccl"
    assert data_backend("auto", "cuda", 2, 1) == "gloo"  # sharing: through host memory
    assert data_backend("auto", "cuda", 2, 1, launch="external") == "nccl"
    assert data_backend("gloo", "cuda", 2, 2) == "gloo"
    with pytest.raises(ConfigError, match="executor.backend=nccl"):
        data_backend("nccl", "cuda", 2, 1)


def test_the_warmup_batch_runs_on_a_stage_with_its_pool():
    torch = pytest.importorskip("torch")
    from engine.pricing.models import get_model
    from engine.torch_exec.weights.checkpoint import random_tensors, spec_arch, stage_tensor_names
    from engine.torch_exec.shared.kv_sizing import warmup_batch
    from engine.torch_exec.stage.model import StageModel

    arch = spec_arch(get_model("tiny-llama"))
    prefill, decodes, blocks = warmup_shape(96, 16)
    m = StageModel(arch, 0, 2, False, True, blocks, 16, "float32", "cpu")
    m.set_weights(random_tensors(arch, stage_tensor_names(arch, 0, 2, False, True), 0, torch.float32, "cpu"))
    chunk, rows = warmup_batch(96, 16)
    assert sum(c.num_tokens for c in chunk) + len(rows) == 96
    used = [b for c in chunk for b in c.block_table] + [b for r in rows for b in r.block_table]
    assert sorted(used) == list(range(blocks))  # every block of the pool, none twice
    b = m.prepare(chunk, rows)
    logits = m.forward(b, torch.zeros((b.num_tokens, arch.hidden_size)))
    assert logits.shape == (1 + decodes, arch.vocab_size) and torch.isfinite(logits).all()
    m.allocate_kv(3)
    assert m.num_blocks == 3


def test_driver_sizes_the_pool_from_the_second_round_of_probes():
    """The driver's side of the handshake with fake stages: a first round (everyone loaded), a
    re-measure request, a second round read on a quiescent device, the block manager resized, the
    size sent to every stage."""
    pytest.importorskip("zmq")
    from engine.torch_exec.driver.executor import TorchExecutor

    ex = TorchExecutor(TorchSettings(device="cuda"), pp=2)
    assert ex.measure_kv
    ex.kv = BlockManager(1, 16)
    rounds = [
        [wire.KvProbe(s, "h:gpu0", 80 * GIB, 70 * GIB, 9 * GIB, 8 * GIB, 1 << 20) for s in range(2)],
        [wire.KvProbe(s, "h:gpu0", 80 * GIB, 40 * GIB, 9 * GIB, 8 * GIB, 1 << 20) for s in range(2)],
    ]
    sent = []
    ex._gather = lambda kind, deadline: (kind is wire.KvProbe and rounds.pop(0))
    ex._send = lambda s, msg: sent.append((s, msg))
    ex._size_pool(deadline=0.0)
    want = pool_size([StageMemory(**vars(p)) for p in
                      [wire.KvProbe(s, "h:gpu0", 80 * GIB, 40 * GIB, 9 * GIB, 8 * GIB, 1 << 20) for s in range(2)]],
                     0.9).num_blocks
    assert ex.kv.num_blocks == ex.kv_pool.num_blocks == want
    assert sent == [(0, wire.KvPool(0)), (1, wire.KvPool(0)), (0, wire.KvPool(want)), (1, wire.KvPool(want))]
    ex.shutdown()


def test_an_explicit_pool_is_kept_on_cuda():
    """kv.num_blocks set: a CUDA executor measures nothing (the block manager keeps its size); unset,
    it measures. The engine tests' helper names its pool in the run's settings (issue 34: on the H100
    it did not, the executor resized its 24-block manager and no preemption happened)."""
    pytest.importorskip("zmq")
    from engine.torch_exec.driver.executor import TorchExecutor
    from test_torch_engine import pipeline_spec

    spec = pipeline_spec("tiny-llama", 2, 24, 4)
    assert spec.settings.kv.num_blocks == 24 and spec.settings.kv.block_size == 4
    kept = TorchExecutor(TorchSettings(device="cuda"), pp=2, run_config=spec.settings)
    measured = TorchExecutor(TorchSettings(device="cuda"), pp=2)
    assert not kept.measure_kv and measured.measure_kv
    kept.shutdown()
    measured.shutdown()


def test_profile_run_warms_up_probes_and_releases_the_warmup_pool(monkeypatch):
    """The stage side on CPU tensors with torch.cuda's memory calls faked: one warm-up forward on
    a pool sized by warmup_shape, the pool released, a probe with this stage's block bytes."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from engine.pricing.models import get_model
    from engine.torch_exec.stage import profile_run
    from engine.torch_exec.weights.checkpoint import random_tensors, spec_arch, stage_tensor_names
    from engine.torch_exec.stage.model import StageModel

    calls = []
    fake = {"synchronize": lambda *a, **k: calls.append("sync"),
            "reset_peak_memory_stats": lambda *a, **k: calls.append("reset"),
            "max_memory_allocated": lambda *a, **k: 9 * GIB, "memory_allocated": lambda *a, **k: 8 * GIB,
            "empty_cache": lambda: calls.append("empty"), "mem_get_info": lambda *a: (50 * GIB, 80 * GIB),
            "get_device_properties": lambda d: SimpleNamespace(uuid="GPU-1234")}
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    arch = spec_arch(get_model("tiny-llama"))
    blocks = warmup_shape(64, 16)[2]
    m = StageModel(arch, 2, 2, False, True, blocks, 16, "float32", "cpu")
    m.set_weights(random_tensors(arch, stage_tensor_names(arch, 2, 2, False, True), 0, torch.float32, "cpu"))
    peak = profile_run.warm_up(m, 64, first=False)
    assert peak == 9 * GIB and m.num_blocks == 1 and calls[:2] == ["sync", "reset"] and "empty" in calls
    p = profile_run.probe(m, 1, peak)
    assert p.stage == 1 and p.device_key.endswith(":GPU-1234")
    assert (p.total_bytes, p.free_bytes, p.peak_bytes, p.resident_bytes) == (80 * GIB, 50 * GIB, 9 * GIB, 8 * GIB)
    assert p.block_bytes == block_bytes(2, 16, arch.num_kv_heads, arch.head_dim, 4)
