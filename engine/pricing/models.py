"""Decoder-only model shapes (Llama / Qwen2 family): the one description of a model
architecture, read by the cost model and by the real engine (engine/torch_exec/: its stages build
their layers from it, `checkpoint.read_arch` parses a checkpoint's config.json into it).

Shapes are copied from each model's published Hugging Face `config.json` (hidden_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size, vocab_size,
tie_word_embeddings; Qwen2 has q/k/v biases). Parameter counts are derived structurally and
checked in tests against the published totals (Llama2-70B ~69.0B, Llama2-13B ~13.0B,
Qwen2.5-32B ~32.8B, Qwen2.5-7B ~7.6B).

`rope_theta`, `rope_scaling`, `rms_norm_eps`, `max_position_embeddings`, `mlp_bias` and
`hidden_act` only matter to the real engine's forward; for a real checkpoint it builds the spec
from the checkpoint's own config.json (`ModelSpec.from_hf_config`, the one parser of it), and the
tiny models carry what `hf_config()` needs to build a randomly initialised transformers model.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.base.errors import ConfigError, unknown_choice

__all__ = ["ModelSpec", "MODELS", "get_model", "register_model", "ARCHITECTURES"]

ARCHITECTURES = ("llama", "qwen2")
_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama/Qwen2-style decoder: RMSNorm, rotary attention with GQA, a SwiGLU MLP (or,
    for the cost model only, a non-gated one: `gated_mlp`).

    All counts are parameters (not bytes) unless the name says bytes; `dtype_bytes` is the weight
    and KV-cache element size (2 for fp16/bf16).
    """

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    dtype_bytes: int = 2
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    mlp_bias: bool = False
    # None (default rope), or {"rope_type": ..., ...} as config.json gives it; left out of the hash
    # (a dict has none) so that a spec stays hashable
    rope_scaling: dict | None = field(default=None, hash=False)
    hidden_act: str = "silu"
    # Gate and up projections multiplied (SwiGLU, every Llama / Qwen2 checkpoint) or one up
    # projection then the activation (phi-2's GELU MLP, GPT-style): the cost model prices the MLP's
    # GEMM widths and activation traffic from it; the real engine implements gated MLPs only.
    gated_mlp: bool = True
    # What a spec may say is what config.json says; which rope types and activations the real
    # engine's forward implements is its own check (engine/torch_exec/weights/checkpoint.py,
    # `check_forward`), so that the simulator still costs any checkpoint's shapes.

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise unknown_choice(f"architecture of model {self.name!r}", self.architecture, ARCHITECTURES)
        for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size", "dtype_bytes", "max_position_embeddings"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"invalid model {self.name}.{key}={value!r}: must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"invalid model {self.name}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    # --- per-layer parameter counts -------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_params_per_layer(self) -> int:
        """q, k, v, o projections (+ q/k/v biases for Qwen2)."""
        h = self.hidden_size
        params = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.qkv_bias:
            params += self.q_size + 2 * self.kv_size
        return params

    @property
    def mlp_params_per_layer(self) -> int:
        """SwiGLU: gate, up (hidden -> intermediate) and down (intermediate -> hidden); a non-gated
        MLP has no gate."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.intermediate_size

    @property
    def linear_params_per_layer(self) -> int:
        """The GEMM weights of one layer (what a token multiplies through): attention + MLP."""
        return self.attention_params_per_layer + self.mlp_params_per_layer

    @property
    def norm_params_per_layer(self) -> int:
        return 2 * self.hidden_size  # input and post-attention RMSNorm

    @property
    def params_per_layer(self) -> int:
        return self.linear_params_per_layer + self.norm_params_per_layer

    # --- whole model ---------------------------------------------------------------------
    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """The output projection's size (the same tensor as the embedding when tied)."""
        return self.vocab_size * self.hidden_size

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size

    @property
    def total_params(self) -> int:
        """Unique parameters: a tied lm_head is counted once (with the embedding)."""
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.embedding_params + head + self.num_layers * self.params_per_layer + self.final_norm_params

    @property
    def weight_bytes(self) -> int:
        return self.total_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V for one token in one layer: 2 * num_kv_heads * head_dim * dtype_bytes."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_token_per_layer * self.num_layers

    # --- Hugging Face interop (for the real engine) ---------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field: what the real engine's driver sends its stages (`ModelSpec(**d)` rebuilds it)."""
        return asdict(self)

    def hf_config(self) -> dict[str, Any]:
        """A config.json-style dict for transformers' LlamaConfig / Qwen2Config."""
        cfg: dict[str, Any] = {
            "architectures": [_HF_CLASS[self.architecture]],
            "model_type": self.architecture,
            "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": {2: "bfloat16", 4: "float32"}.get(self.dtype_bytes, "bfloat16"),
        }
        if self.architecture == "llama":
            cfg["attention_bias"] = self.qkv_bias
            cfg["mlp_bias"] = self.mlp_bias
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg

    @classmethod
    def from_hf_config(cls, name: str, cfg: Mapping[str, Any], dtype_bytes: int = 2) -> ModelSpec:
        """Build a spec from a checkpoint's config.json (model_type llama or qwen2; the layouts of
        transformers 4.x and 5.x, which keeps rope_theta in `rope_parameters`)."""
        arch = cfg.get("model_type")
        if arch not in ARCHITECTURES:
            raise unknown_choice(f"model_type in the config.json of {name!r}", arch, ARCHITECTURES)
        theta, scaling = _rope(cfg)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(
                name=name,
                architecture=arch,
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
                dtype_bytes=dtype_bytes,
                rope_theta=theta,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6 if arch == "qwen2" else 1e-5)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                rope_scaling=scaling,
                hidden_act=cfg.get("hidden_act", "silu"),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json of model {name!r} lacks {exc.args[0]!r}") from None


def _rope(cfg: Mapping[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a config.json: transformers 5 keeps both in `rope_parameters`,
    4.x has `rope_theta` and `rope_scaling` (whose type key was once `type`)."""
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if kind == "default":
        return theta, None
    return theta, {**legacy, **{k: v for k, v in rope.items() if k != "rope_theta"}, "rope_type": kind}


MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> ModelSpec:
    """Add a model shape. A name already present is refused, never overwritten."""
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"register_model expects a ModelSpec, got {type(spec).__name__}")
    if spec.name in MODELS:
        raise ConfigError(f"duplicate model name {spec.name!r}: already registered; choose a new name")
    MODELS[spec.name] = spec
    return spec


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise unknown_choice("model", name, MODELS) from None


for _spec in (
    # meta-llama/Llama-2-13b-hf config.json: 40 layers, 5120, 40 heads (MHA), 13824, vocab 32000.
    ModelSpec("llama2-13b", "llama", 40, 5120, 40, 40, 128, 13824, 32000,
              rms_norm_eps=1e-5, max_position_embeddings=4096),
    # meta-llama/Llama-2-70b-hf: 80 layers, 8192, 64 heads, 8 KV heads (GQA), 28672, vocab 32000.
    ModelSpec("llama2-70b", "llama", 80, 8192, 64, 8, 128, 28672, 32000,
              rms_norm_eps=1e-5, max_position_embeddings=4096),
    # meta-llama/Llama-3.1-70B: as Llama-2-70B but vocab 128256, rope_theta 500000 (llama3 rope
    # scaling not represented), 131072 positions.
    ModelSpec("llama-3.1-70b", "llama", 80, 8192, 64, 8, 128, 28672, 128256,
              rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072),
    # huggyllama/llama-30b (LLaMA-1 "30B", 32.5B params): 60 layers, 6656, 52 heads (MHA), 17920.
    ModelSpec("llama-30b", "llama", 60, 6656, 52, 52, 128, 17920, 32000,
              rms_norm_eps=1e-6, max_position_embeddings=2048),
    # Qwen/Qwen2.5-7B: 28 layers, 3584, 28 heads, 4 KV heads, 18944, vocab 152064, untied, qkv bias.
    ModelSpec("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True,
              rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=131072),
    # Qwen/Qwen2.5-14B: 48 layers, 5120, 40 heads, 8 KV heads, 13824, vocab 152064, untied.
    ModelSpec("qwen2.5-14b", "qwen2", 48, 5120, 40, 8, 128, 13824, 152064, qkv_bias=True,
              rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=131072),
    # Qwen/Qwen2.5-32B-Instruct, the checkpoint TD-Pipe and gLLM ran on L20s: 64 layers, 5120, 40 heads, 8 KV
    # heads, 27648, vocab 152064, untied. Its config.json sets 32,768 positions (131,072 only with YaRN added
    # by hand: huggingface.co/Qwen/Qwen2.5-32B-Instruct discussion 5); the base Qwen/Qwen2.5-32B's is 131,072.
    # vLLM's max_model_len, so its separate-batching budget (policies/vllm.py) and the no-chunked-prefill default.
    ModelSpec("qwen2.5-32b", "qwen2", 64, 5120, 40, 8, 128, 27648, 152064, qkv_bias=True,
              rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=32768),
    # Qwen/Qwen2.5-72B: 80 layers, 8192, 64 heads, 8 KV heads, 29568, vocab 152064, untied.
    ModelSpec("qwen2.5-72b", "qwen2", 80, 8192, 64, 8, 128, 29568, 152064, qkv_bias=True,
              rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=131072),
    # Qwen/Qwen-7B (Qwen1, MoLink's model): 32 layers, 4096, 32 heads (MHA), c_attn with bias,
    # SwiGLU of 11008 per projection (its config lists intermediate_size=22016 = 2 x 11008),
    # vocab 151936, untied. Structurally a Qwen2 layer with MHA, so it is modelled as "qwen2".
    ModelSpec("qwen-7b", "qwen2", 32, 4096, 32, 32, 128, 11008, 151936, qkv_bias=True,
              rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=8192),
    # Tiny random-weight models for the CPU engine: 8 layers (pp up to 8, uneven at pp=3),
    # ~22M params of which 16.4M are the untied embedding + lm_head.
    ModelSpec("tiny-llama", "llama", 8, 256, 8, 4, 32, 688, 32000,
              rms_norm_eps=1e-5, max_position_embeddings=2048),
    # Tiny Qwen2: tied embeddings, qkv bias, 6 layers (uneven at pp=4), ~22M params.
    ModelSpec("tiny-qwen2", "qwen2", 6, 384, 6, 2, 64, 1024, 32000, tie_word_embeddings=True,
              qkv_bias=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=2048),
):
    register_model(_spec)
del _spec
