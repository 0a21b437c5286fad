"""Checkpoints for the real engine: find or build one, read its config.json, name its tensors.

Two sources, one format. A local Hugging Face checkpoint (config.json + model.safetensors, or
sharded with model.safetensors.index.json) is used as it is. A table model (`model=tiny-llama`,
`tiny-qwen2`, any `ModelSpec`) is built once with transformers (`LlamaForCausalLM` /
`Qwen2ForCausalLM` from the spec's `hf_config()`, float32, weights from `torch.manual_seed(seed)`)
and saved with `save_pretrained` (safetensors) into `<cache>/<name>-seed<seed>/`, with a
`tokenizer.json` whose token t is the numeral t (engine/torch_exec/weights/random_tokenizer.py); the
stages then load it like any other checkpoint, reading only their own tensors with `safe_open`.

Random weights use `initializer_range=0.1`, not transformers' 0.02: with 0.02 a tiny random
model's greedy output collapses into one repeated token after a few steps (measured on
tiny-llama: 2-8 distinct tokens in 24), which would let a broken attention or position bug pass
the correctness anchor unnoticed; with 0.1 every one of 24 greedy tokens differed.

Prompt ids: a request without `prompt_token_ids` gets `prompt_len` ids drawn uniformly from
[3, vocab_size) by `numpy.random.default_rng([prompt_seed, request_id])` (ids 0-2 are the usual
special tokens), so the same request has the same prompt under every policy and depth.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from engine.base.errors import ConfigError
from engine.pricing.models import ModelSpec

RANDOM_INIT_STD = 0.1
MAX_RANDOM_PARAMS = 2_000_000_000  # building a random 70B model on the fly is never what was meant
FIRST_PROMPT_ID = 3


ROPE_TYPES = ("default", "linear", "llama3")  # what the stage's `inv_freq` implements (stage/model.py)


def read_arch(path: str | os.PathLike) -> ModelSpec:
    """Parse `<path>/config.json` (transformers 4.x and 5.x layouts)."""
    path = Path(path)
    cfg_file = path / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model checkpoint {str(path)!r} has no config.json") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {cfg_file}: {exc}") from None
    return arch_from_config(str(path), cfg)


def arch_from_config(name: str, cfg: dict) -> ModelSpec:
    """The spec of a config.json dict (a checkpoint's, or a table model's `hf_config()`), parsed by
    `ModelSpec.from_hf_config` (the one parser), refused when a stage's forward cannot run it."""
    spec = ModelSpec.from_hf_config(name, cfg)
    check_forward(spec)
    return spec


def check_forward(spec: ModelSpec) -> None:
    """Refuse what the description may say but the stage's forward does not implement (the
    simulator costs such a model all the same: it reads shapes only)."""
    kind = (spec.rope_scaling or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ConfigError(f"model checkpoint {spec.name!r}: rope type {kind!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    if not spec.gated_mlp:
        raise ConfigError(f"model checkpoint {spec.name!r}: a non-gated MLP is not supported (SwiGLU only)")
    if spec.hidden_act != "silu":
        raise ConfigError(f"model checkpoint {spec.name!r}: hidden_act {spec.hidden_act!r} is not supported "
                          f"(silu only)")


# --- tensors ------------------------------------------------------------------------------------
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)
ATTN_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
MLP_BIASES = ("mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias")
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def stage_tensor_names(arch: ModelSpec, first_layer: int, num_layers: int, first: bool, last: bool) -> list[str]:
    """The checkpoint tensors one stage loads (and nothing else)."""
    names: list[str] = []
    if first:
        names.append(EMBED)
    for i in range(first_layer, first_layer + num_layers):
        per = list(LAYER_TENSORS)
        if arch.qkv_bias:
            per += ATTN_BIASES
        if arch.mlp_bias:
            per += MLP_BIASES
        names += [f"model.layers.{i}.{n}" for n in per]
    if last:
        names.append(NORM)
        names.append(LM_HEAD)  # falls back to the embedding when tied (see `tensor_files`)
    return names


def tensor_files(path: str | os.PathLike) -> dict[str, str]:
    """Tensor name -> safetensors file, for single-file and sharded checkpoints."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: str(path / v) for k, v in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model checkpoint {str(path)!r} has no *.safetensors files")
    from safetensors import safe_open

    out: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                out[k] = str(f)
    return out


# --- random weights in memory (CUDA) --------------------------------------------------------------
def spec_arch(spec: ModelSpec) -> ModelSpec:
    """A table model's spec exactly as `read_arch` parses the checkpoint `random_checkpoint` would
    write for it (the same config.json dict: `dtype_bytes` back at its default, the name kept)."""
    return arch_from_config(spec.name, _hf_config(spec))


def tensor_shape(arch: ModelSpec, name: str) -> tuple[int, ...]:
    """The shape of checkpoint tensor `name` (Hugging Face's Llama/Qwen2 layout, [out, in])."""
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    if name in (EMBED, LM_HEAD):
        return (arch.vocab_size, h)
    if name == NORM or name.endswith("layernorm.weight"):
        return (h,)
    part = name.split(".", 3)[-1]
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter), "self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,),
              "self_attn.v_proj.bias": (kv,), "mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,),
              "mlp.down_proj.bias": (h,)}
    return shapes[part]


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of one tensor: a hash of (model seed, tensor name), so every stage, in
    any split and any run, draws the same values for the same tensor (Python's `hash` is salted
    per process; blake2b is not)."""
    digest = hashlib.blake2b(f"{int(seed)}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def random_tensors(arch: ModelSpec, names: list[str], seed: int, dtype, device) -> dict:
    """This stage's random weights, built where they will live (no checkpoint on disk).

    As transformers initialises a fresh model: norms 1, biases 0, matrices and the embedding
    normal(0, RANDOM_INIT_STD) -- drawn in `dtype` on `device` by one generator per tensor seeded
    by `tensor_seed`. A tied lm_head draws the embedding's values (the same seed and shape).
    Values depend on the device type (CPU and CUDA generators differ), never on the stage split.
    On CUDA this is bandwidth-bound: about 2 bytes per parameter written, seconds for 15B."""
    import torch

    out: dict = {}
    for name in names:
        src = EMBED if name == LM_HEAD and arch.tie_word_embeddings else name
        if src in out:
            out[name] = out[src]
            continue
        shape = tensor_shape(arch, src)
        if src == NORM or src.endswith("layernorm.weight"):
            t = torch.ones(shape, dtype=dtype, device=device)
        elif src.endswith(".bias"):
            t = torch.zeros(shape, dtype=dtype, device=device)
        else:
            gen = torch.Generator(device=device)
            gen.manual_seed(tensor_seed(seed, src))
            t = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, RANDOM_INIT_STD, generator=gen)
        out[name] = t
    return out


def check_device_fit(spec: ModelSpec, device_bytes: list[int], elem_bytes: int, utilization: float) -> None:
    """Refuse a random model whose weights alone exceed the GPUs' utilisation share (one line)."""
    need = spec.total_params * elem_bytes
    have = sum(device_bytes) * utilization
    if need > have:
        raise ConfigError(
            f"model {spec.name!r} has {spec.total_params / 1e9:.1f}B parameters ({need / 2**30:.1f} GiB at "
            f"{elem_bytes} bytes each): it does not fit kv.gpu_memory_utilization={utilization:g} of the "
            f"{len(device_bytes)} visible GPU(s) ({sum(device_bytes) / 2**30:.1f} GiB); choose a smaller model "
            f"or give a checkpoint")


def check_random_fits(spec: ModelSpec, pp: int, dtype: str, utilization: float) -> None:
    """`check_device_fit` over the GPUs the P spawned stages use (cuda:0 .. cuda:min(P, count)-1)."""
    import torch

    used = min(pp, torch.cuda.device_count())
    totals = [torch.cuda.get_device_properties(i).total_memory for i in range(used)]
    check_device_fit(spec, totals, 4 if dtype == "float32" else 2, utilization)


# --- resolving the run's model -------------------------------------------------------------------
def model_source(settings: Any, model: ModelSpec | None) -> tuple[str | None, ModelSpec | None]:
    """(checkpoint path, None) for a checkpoint on disk (`executor.model_path`, or `model=<dir>`),
    or (None, spec) for a table model, built with random weights."""
    if settings.model_path:
        return _existing_dir(settings.model_path, "executor.model_path"), None
    if model is None:
        raise ConfigError("executor=torch needs a model: model=<table name> or model=<checkpoint dir>, "
                          "or executor.model_path=<checkpoint dir>")
    name = str(model.name)
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "config.json")):
        return name, None
    return None, model


def _existing_dir(p: str, key: str) -> str:
    p = os.path.expanduser(str(p))
    if not os.path.isdir(p):
        raise ConfigError(f"invalid {key}={p!r}: no such directory")
    if not os.path.exists(os.path.join(p, "config.json")):
        raise ConfigError(f"invalid {key}={p!r}: no config.json in it (not a Hugging Face checkpoint)")
    return p


def random_checkpoint(spec: ModelSpec, seed: int, cache_dir: str | os.PathLike) -> str:
    """Build (once) and return the checkpoint dir of `spec` with random weights from `seed`.

    Safe against concurrent builders: each writes a temporary dir and renames it into place; the
    loser of a race discards its copy. A cached dir whose config no longer matches the spec is
    rebuilt, so editing a table model never silently reuses stale weights.
    """
    if spec.total_params > MAX_RANDOM_PARAMS:
        raise ConfigError(f"model {spec.name!r} has {spec.total_params / 1e9:.1f}B parameters: too large to build "
                          f"with random weights; give a checkpoint (model.path or executor.model_path)")
    from engine.torch_exec.weights.random_tokenizer import has_tokenizer, write_random_tokenizer

    cache_dir = Path(cache_dir)
    target = cache_dir / f"{spec.name}-seed{seed}"
    want = _hf_config(spec)
    if _matches(target, want):
        if not has_tokenizer(target):  # built before checkpoints shipped one
            write_random_tokenizer(target, spec.vocab_size, spec.max_position_embeddings)
        return str(target)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-seed{seed}-", dir=cache_dir))
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

        cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM),
                              "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[spec.architecture]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(cfg_cls(**want))
        model.save_pretrained(str(tmp), safe_serialization=True)
        write_random_tokenizer(tmp, spec.vocab_size, spec.max_position_embeddings)
        (tmp / "testbed_model.json").write_text(json.dumps({"spec": asdict(spec), "seed": seed,
                                                            "initializer_range": RANDOM_INIT_STD}, indent=1))
        if target.exists() and not _matches(target, want):
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _matches(target, want):  # a concurrent builder won; anything else is an error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _hf_config(spec: ModelSpec) -> dict:
    cfg = spec.hf_config()
    cfg["torch_dtype"] = "float32"
    cfg["initializer_range"] = RANDOM_INIT_STD
    return cfg


def _matches(target: Path, want: dict) -> bool:
    meta = target / "testbed_model.json"
    if not (meta.exists() and (target / "config.json").exists() and any(target.glob("*.safetensors"))):
        return False
    try:
        stored = json.loads(meta.read_text())
    except (OSError, ValueError):
        return False
    return stored.get("initializer_range") == RANDOM_INIT_STD and _hf_config(ModelSpec(**stored["spec"])) == want


# --- prompts ----------------------------------------------------------------------------------
def prompt_ids(request: Any, vocab_size: int, seed: int) -> list[int]:
    """The request's own ids, or `prompt_len` deterministic ids from (seed, request_id)."""
    ids = request.prompt_token_ids
    if ids is not None:
        if len(ids) != request.prompt_len:
            raise ConfigError(f"request {request.request_id}: {len(ids)} prompt_token_ids for prompt_len="
                              f"{request.prompt_len}")
        bad = [t for t in ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ConfigError(f"request {request.request_id}: token id {bad[0]} outside the vocabulary "
                              f"[0, {vocab_size})")
        return [int(t) for t in ids]
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(request.request_id)])
    low = FIRST_PROMPT_ID if vocab_size > FIRST_PROMPT_ID + 1 else 0
    return rng.integers(low, vocab_size, size=request.prompt_len).tolist()


def check_kv_memory(settings, arch: ModelSpec, num_blocks: int, block_size: int) -> None:
    """Refuse a CPU pool that cannot fit this machine (the cost model sizes KV for GPUs)."""
    if settings.device != "cpu":
        return
    elem = 4 if settings.resolved_dtype == "float32" else 2
    per_layer = 2 * num_blocks * block_size * arch.num_kv_heads * arch.head_dim * elem
    total = per_layer * arch.num_layers  # all stages share this machine when spawned
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    if settings.launch == "spawn" and total > 0.5 * mem:
        raise ConfigError(
            f"the KV cache of {num_blocks} blocks x {block_size} tokens needs {total / 2**30:.1f} GiB on this "
            f"machine ({mem / 2**30:.1f} GiB RAM): set kv.num_blocks (e.g. kv.num_blocks="
            f"{max(1, int(0.25 * mem / (per_layer / num_blocks * arch.num_layers)))})")
