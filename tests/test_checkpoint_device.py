"""Random table models built in memory (the CUDA path of engine/torch_exec/weights/checkpoint.py), checked
on CPU with tiny models: the disk checkpoint's names and shapes, deterministic values, one value
per tensor whatever the stage split, and a split pipeline computing what the whole model does."""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine.base.errors import ConfigError  # noqa: E402
from engine.pricing.models import get_model  # noqa: E402
from engine.torch_exec.weights.checkpoint import (EMBED, LM_HEAD, check_device_fit, random_checkpoint,  # noqa: E402
                                          random_tensors, read_arch, spec_arch, stage_tensor_names, tensor_files)
from engine.torch_exec.wire.messages import DecodeRow, PrefillChunk  # noqa: E402


@pytest.fixture(scope="module")
def disk(model_cache):
    return {name: random_checkpoint(get_model(name), 0, model_cache) for name in ("tiny-llama", "tiny-qwen2")}


def _all_names(arch):
    return stage_tensor_names(arch, 0, arch.num_layers, True, True)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_same_architecture_names_and_shapes_as_the_disk_checkpoint(disk, name):
    from safetensors import safe_open

    arch = spec_arch(get_model(name))
    assert dataclasses.replace(read_arch(disk[name]), name=arch.name) == arch
    files = tensor_files(disk[name])
    mem = random_tensors(arch, _all_names(arch), 0, torch.float32, "cpu")
    for n, t in mem.items():
        src = EMBED if n == LM_HEAD and LM_HEAD not in files else n
        with safe_open(files[src], framework="pt") as fh:
            assert tuple(fh.get_slice(src).get_shape()) == tuple(t.shape), n
    assert set(mem) == set(_all_names(arch))


def test_values_are_deterministic_per_seed_and_tensor():
    arch = spec_arch(get_model("tiny-qwen2"))
    names = _all_names(arch)
    a = random_tensors(arch, names, 3, torch.float32, "cpu")
    b = random_tensors(arch, names, 3, torch.float32, "cpu")
    c = random_tensors(arch, names, 4, torch.float32, "cpu")
    assert all(torch.equal(a[n], b[n]) for n in names)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(a[w], c[w])
    assert not torch.equal(a[w], a["model.layers.1.self_attn.q_proj.weight"])
    assert 0.08 < float(a[w].std()) < 0.12  # normal(0, 0.1), transformers' init at initializer_range 0.1
    assert torch.equal(a["model.layers.0.input_layernorm.weight"], torch.ones(arch.hidden_size))
    assert torch.equal(a["model.layers.0.self_attn.k_proj.bias"], torch.zeros(arch.num_kv_heads * arch.head_dim))
    assert torch.equal(a[LM_HEAD], a[EMBED])  # tied: the last stage draws the embedding's values
    bf = random_tensors(arch, [w], 3, torch.bfloat16, "cpu")[w]
    assert bf.dtype == torch.bfloat16


def test_a_stage_split_draws_the_same_tensors():
    arch = spec_arch(get_model("tiny-llama"))
    whole = random_tensors(arch, _all_names(arch), 0, torch.float32, "cpu")
    half = arch.num_layers // 2
    s0 = random_tensors(arch, stage_tensor_names(arch, 0, half, True, False), 0, torch.float32, "cpu")
    s1 = random_tensors(arch, stage_tensor_names(arch, half, arch.num_layers - half, False, True), 0,
                        torch.float32, "cpu")
    assert not set(s0) & set(s1)
    for n, t in {**s0, **s1}.items():
        assert torch.equal(t, whole[n]), n


def test_in_memory_pipeline_of_two_stages_equals_one_stage():
    from engine.torch_exec.stage.model import StageModel

    arch = spec_arch(get_model("tiny-llama"))
    L = arch.num_layers

    def stage(first, n, is_first, is_last):
        m = StageModel(arch, first, n, is_first, is_last, 16, 4, "float32", "cpu")
        m.set_weights(random_tensors(arch, stage_tensor_names(arch, first, n, is_first, is_last), 0,
                                     torch.float32, "cpu"))
        return m

    prefills = [PrefillChunk(0, 0, 9, True, [0, 1, 2], list(range(5, 14)))]
    decodes = [DecodeRow(1, 3, [3], 42)]
    whole = stage(0, L, True, True)
    logits = whole.forward(whole.prepare(prefills, decodes), None)
    a, b = stage(0, L // 2, True, False), stage(L // 2, L - L // 2, False, True)
    h = a.forward(a.prepare(prefills, decodes), None)
    split = b.forward(b.prepare(prefills, decodes), h)
    assert logits.shape == (2, arch.vocab_size)
    torch.testing.assert_close(split, logits, rtol=1e-5, atol=1e-5)


def test_a_model_larger_than_the_gpus_is_refused_in_one_line():
    spec = get_model("qwen2.5-7b")
    check_device_fit(spec, [80 << 30], 2, 0.9)  # ~15 GiB of bf16 weights on an 80 GB GPU
    with pytest.raises(ConfigError, match="does not fit") as exc:
        check_device_fit(spec, [12 << 30], 2, 0.9)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("gib, fits", [(80, True), (12, False)])
def test_driver_builds_table_models_in_memory_on_cuda(monkeypatch, tmp_path, gib, fits):
    """executor.device=cuda without a checkpoint: no file is written, the stages get path "" and
    the table model's arch; a model larger than the (faked) GPUs is one error line."""
    from types import SimpleNamespace

    pytest.importorskip("zmq")
    from engine.core.kv import BlockManager
    from engine.torch_exec.driver.executor import TorchExecutor
    from engine.torch_exec.settings import TorchSettings
    from testbed.config.composer import compose, run_config, to_container

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=gib << 30))
    rc = run_config(to_container(compose(["executor=torch", "model=qwen2.5-7b", f"output.dir={tmp_path}"])))
    ex = TorchExecutor(TorchSettings(device="cuda"), pp=1, run_config=rc)
    ex.kv = BlockManager(1, 16)
    try:
        if fits:
            ex._load_model()
            assert ex.model_path == "" and ex.arch == spec_arch(get_model("qwen2.5-7b"))
            assert not (tmp_path / "models").exists()
        else:
            with pytest.raises(ConfigError, match="does not fit"):
                ex._load_model()
    finally:
        ex.shutdown()


def test_read_arch_is_the_model_description_and_refuses_what_the_forward_lacks(disk, tmp_path):
    """The engine reads a checkpoint into the cost model's own `ModelSpec` (one description), and
    refuses a rope type or an activation its forward does not implement (the simulator does not)."""
    import json
    import shutil
    from pathlib import Path

    from engine.pricing.models import ModelSpec

    assert type(read_arch(disk["tiny-llama"])) is ModelSpec
    cfg = json.loads((Path(disk["tiny-llama"]) / "config.json").read_text())
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0},  # transformers 4.x and 5.x layouts
            "rope_parameters": {**(cfg.get("rope_parameters") or {}), "rope_type": "yarn", "factor": 4.0}}
    for change, said in ((yarn, "rope type 'yarn'"), ({"hidden_act": "gelu"}, "hidden_act 'gelu'")):
        path = tmp_path / said.split()[0]
        shutil.copytree(disk["tiny-llama"], path)
        (path / "config.json").write_text(json.dumps({**cfg, **change}))
        spec = ModelSpec.from_hf_config("x", {**cfg, **change})  # the simulator still reads its shapes
        assert spec.hidden_act != "silu" or spec.rope_scaling["rope_type"] == "yarn"
        with pytest.raises(ConfigError, match=said):
            read_arch(path)
