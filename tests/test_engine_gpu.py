"""The torch engine's CUDA set-up: bf16 by default, the KV pool sized from measured memory, random
table models built on the GPU, P > 1 sharing one GPU (gloo through host memory) and NCCL between
stages that each have their own GPU. Marked `gpu`: skipped where CUDA is absent (tests/conftest.py);
the CPU logic behind them is in tests/test_kv_sizing.py and tests/test_checkpoint_device.py."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from conftest import small_config  # noqa: E402

pytestmark = pytest.mark.gpu


def _run(tmp_path, *overrides: str):
    """One run on CUDA (integrity checks off: a measured pool of a tiny model holds ~10^6 blocks)."""
    import engine.torch_exec  # noqa: F401
    import policies  # noqa: F401
    from testbed.run.runner import prepare_experiment

    cfg = small_config("executor=torch", "executor.device=cuda", "policy=sarathi", "workload.num_requests=12",
                       "workload.arrival=offline", "model=tiny-llama", "check_integrity=false", *overrides,
                       out_dir=tmp_path)
    prep = prepare_experiment(cfg)
    res = prep.run()
    assert res.error is None, res.error
    tokens = {rid: list(seq.output_token_ids) for rid, seq in prep.controller.sequences.items()}
    return res, prep, tokens


def test_measured_pool_and_bf16_by_default_with_two_stages_on_one_gpu(tmp_path):
    # small_config names a pool (kv.num_blocks=4096); unset, the stages measure one
    res, prep, tokens = _run(tmp_path, "parallel.pp=2", "kv.num_blocks=null")
    ex = prep.controller.executor
    assert ex.settings.resolved_dtype == "bfloat16"
    assert ex.kv_pool is not None and ex.kv_pool.num_blocks == res.info["kv_num_blocks"] > 1000
    if torch.cuda.device_count() == 1:
        assert ex.kv_pool.stages_per_device == {next(iter(ex.kv_pool.stages_per_device)): 2}
    assert res.summary["num_finished"] == 12
    assert all(len(t) == seq.output_len for t, seq in zip(tokens.values(), prep.controller.sequences.values()))


def test_two_stages_sharing_a_gpu_give_the_tokens_of_one_stage(tmp_path):
    """P=2 on one GPU moves hidden states through host memory (gloo): float32 tokens equal P=1's."""
    _, _, one = _run(tmp_path / "p1", "parallel.pp=1", "executor.dtype=float32", "kv.num_blocks=2048")
    _, prep, two = _run(tmp_path / "p2", "parallel.pp=2", "executor.dtype=float32", "kv.num_blocks=2048",
                        "executor.backend=gloo")
    assert prep.controller.executor.stage_info[1]["device"].startswith("cuda")
    assert one == two


def test_same_greedy_tokens_on_one_gpu_as_on_own_gpus(tmp_path):
    """Stages sharing cuda:0 (gloo via host memory) and each on its own GPU (NCCL) compute the same
    float32 tokens: the transfer path moves the hidden states unchanged."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs for the NCCL path")
    _, prep_nccl, nccl = _run(tmp_path / "nccl", "parallel.pp=2", "executor.dtype=float32", "kv.num_blocks=2048")
    assert prep_nccl.controller.executor._backend() == "nccl"
    _, _, gloo = _run(tmp_path / "gloo", "parallel.pp=2", "executor.dtype=float32", "kv.num_blocks=2048",
                      "executor.backend=gloo")
    assert nccl == gloo


@pytest.mark.slow
def test_a_7b_shape_random_model_builds_on_the_gpu(tmp_path):
    """No checkpoint on disk: each stage draws its bf16 weights on its GPU (over the 2B CPU limit)."""
    res, prep, _ = _run(tmp_path, "model=qwen2.5-7b", "parallel.pp=1", "workload.num_requests=4")
    assert prep.controller.executor.model_path == ""
    assert res.info["kv_num_blocks"] > 0
