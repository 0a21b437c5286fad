"""`executor=torch` settings (the `executor.*` config keys of the real engine).

Kept free of torch imports: the config layer builds this dataclass for every run, including
simulated ones, and must not pay torch's import time for it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.base.errors import bad_value
from engine.base.sampling import SamplerSettings
from engine.base.typed import setting

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
SAMPLING = ("greedy", "random")
LAUNCH = ("spawn", "external")
START_METHODS = ("forkserver", "spawn")  # engine/torch_exec/driver/stage_processes.py
BACKENDS = ("auto", "gloo", "nccl")
ATTENTION = ("auto", "torch", "triton")


@dataclass(frozen=True)
class TorchSettings:
    """Settings of the real multi-process pipeline engine.

    Model: `model_path` names a local Hugging Face checkpoint (config.json + *.safetensors, a
    Llama or Qwen2 decoder). When it is None the run's `model` decides: a `model.path` key (or a
    model name that is an existing directory) is loaded the same way, and a table model
    (`model=tiny-llama`) is built once with random weights from `model_seed` and written as a real
    checkpoint to `<model_cache_dir>/<name>-seed<k>/` (default cache: `<output.dir>/models`).
    """

    model_path: str | None = None
    model_seed: int = 0  # random weights of a table model (not the run's seed: sweeping seeds reuses one model)
    model_cache_dir: str | None = None
    dtype: str | None = None  # weights, activations and KV cache; None = bfloat16 on cuda, float32 on cpu
    device: str = "cpu"  # cpu | cuda (stage s uses GPU s % device_count)
    threads_per_stage: int = 1  # torch intra-op threads per stage process (CPU)
    backend: str = "auto"  # data plane: auto = gloo on CPU, nccl on CUDA when every stage has its own GPU
    # attention over the paged KV cache (docs/real-engine.md): auto = the Triton kernel on CUDA when triton
    # imports, torch elsewhere; triton on CPU runs under Triton's interpreter (tests only: slow)
    attention: str = setting("auto", choices=ATTENTION)
    cuda_graphs: bool = True  # decode-only micro-batches replay CUDA graphs (CUDA + Triton attention; else ignored)
    # sampling (on the last stage)
    sampling: str = "greedy"  # greedy | random
    temperature: float = 1.0  # random only; 0 means greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # vLLM's definitions; 1.0 / 0.0 = off (apply inline and on CPU samplers alike)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_cpu_samplers: int = 2  # CPU sampler processes of runtime.cpu_sampling (rows split by sequence id)
    link_chunk_bytes: int = 1 << 20  # a paced link sends each transfer the policy schedules in sends of at most this
    sample_seed: int = 0  # each (request, position) draws from its own stream: batching-independent
    prompt_seed: int | None = None  # seed of derived prompt ids (requests without ids); None = run seed
    # failure handling: every wait is bounded
    stage_timeout_s: float = 60.0  # no progress for this long while work is in flight = hung stage
    start_timeout_s: float = 180.0  # spawning, importing torch and loading weights
    # rendezvous (multi-machine: see engine/torch_exec/__init__.py)
    launch: str = "spawn"  # spawn: the driver starts every stage here; external: stages are started by hand
    start_method: str = "forkserver"  # how launch=spawn starts them: forked from a server with torch imported, or spawn
    master_addr: str = "127.0.0.1"  # torch.distributed rendezvous (stage 0's host)
    master_port: int = 0  # 0 = pick a free port (spawn only)
    zmq_host: str = "127.0.0.1"  # where the driver's control socket binds (0.0.0.0 for remote stages)
    zmq_port: int = 0  # 0 = pick a free port (spawn only)
    # network interface(s) gloo and NCCL bind between stage hosts (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME,
    # e.g. "eth0"); null = "lo" on loopback, else their own choice; the variables set on a stage host win
    socket_ifname: str | None = None
    # testing only: "<kind>:<stage>:<n>" makes stage <stage> fail at its n-th micro-batch,
    # kind = raise (an exception), hang (sleeps), exit (dies without a word)
    fault: str = ""
    # the KV pool on CUDA when kv.num_blocks is unset: profiled at this many tokens per micro-batch
    # (None = the policy's token budget, see engine/torch_exec/shared/kv_sizing.py); also the largest
    # piecewise CUDA graph's tokens, plus 256 decode rows (engine/torch_exec/graphs/piecewise.py)
    profile_tokens: int | None = None

    @property
    def resolved_dtype(self) -> str:
        """The dtype the stages run in: `dtype`, or bfloat16 on CUDA (the tensor cores' format; the
        issue's H100 floor is measured in bf16) and float32 on CPU (exact greedy parity with HF)."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPES:
            raise bad_value("executor.dtype", self.dtype, f"must be one of {', '.join(DTYPES)} or null")
        if self.device not in DEVICES:
            raise bad_value("executor.device", self.device, f"must be one of {', '.join(DEVICES)}")
        if self.sampling not in SAMPLING:
            raise bad_value("executor.sampling", self.sampling, f"must be one of {', '.join(SAMPLING)}")
        if self.launch not in LAUNCH:
            raise bad_value("executor.launch", self.launch, f"must be one of {', '.join(LAUNCH)}")
        if self.start_method not in START_METHODS:
            raise bad_value("executor.start_method", self.start_method, f"must be one of {', '.join(START_METHODS)}")
        if self.backend not in BACKENDS:
            raise bad_value("executor.backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        if self.backend == "nccl" and self.device != "cuda":
            raise bad_value("executor.backend", self.backend, "nccl needs executor.device=cuda")
        if isinstance(self.threads_per_stage, bool) or not isinstance(self.threads_per_stage, int) \
                or self.threads_per_stage < 1:
            raise bad_value("executor.threads_per_stage", self.threads_per_stage, "must be an integer >= 1")
        SamplerSettings(self.temperature, self.top_k, self.top_p, self.repetition_penalty,
                        self.presence_penalty, self.frequency_penalty)  # validates the sampling keys
        if isinstance(self.num_cpu_samplers, bool) or not isinstance(self.num_cpu_samplers, int) \
                or self.num_cpu_samplers < 1:
            raise bad_value("executor.num_cpu_samplers", self.num_cpu_samplers, "must be an integer >= 1")
        if self.link_chunk_bytes < 1:
            raise bad_value("executor.link_chunk_bytes", self.link_chunk_bytes, "must be >= 1")
        for key in ("stage_timeout_s", "start_timeout_s"):
            if not getattr(self, key) > 0:
                raise bad_value(f"executor.{key}", getattr(self, key), "must be > 0")
        for key in ("master_port", "zmq_port"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 65536:
                raise bad_value(f"executor.{key}", v, "must be a port number (0 = pick a free one)")
        if self.launch == "external" and (self.zmq_port == 0 or self.master_port == 0):
            raise bad_value("executor.launch", self.launch,
                            "external stages need fixed executor.zmq_port and executor.master_port")
        if self.prompt_seed is not None and (isinstance(self.prompt_seed, bool) or not isinstance(self.prompt_seed, int)):
            raise bad_value("executor.prompt_seed", self.prompt_seed, "must be an integer or null")
        if self.socket_ifname is not None and (not isinstance(self.socket_ifname, str)
                                               or not re.fullmatch(r"[\w.:@-]+(,[\w.:@-]+)*", self.socket_ifname)):
            raise bad_value("executor.socket_ifname", self.socket_ifname,
                            "must be an interface name such as eth0 (a comma list for several) or null")
        if self.model_path is not None and not isinstance(self.model_path, str):
            raise bad_value("executor.model_path", self.model_path, "must be a directory path or null")
        if self.fault:
            parse_fault(self.fault)
        if self.profile_tokens is not None and (isinstance(self.profile_tokens, bool)
                                                or not isinstance(self.profile_tokens, int) or self.profile_tokens < 1):
            raise bad_value("executor.profile_tokens", self.profile_tokens, "must be an integer >= 1 or null")


FAULT_KINDS = ("raise", "hang", "exit")


def parse_fault(spec: str) -> tuple[str, int, int]:
    """'hang:1:3' -> ('hang', 1, 3): stage 1 misbehaves on its 3rd micro-batch."""
    parts = spec.split(":")
    try:
        kind, stage, n = parts[0], int(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        raise bad_value("executor.fault", spec, "must be '<raise|hang|exit>:<stage>:<n>'") from None
    if kind not in FAULT_KINDS or len(parts) != 3 or stage < 0 or n < 1:
        raise bad_value("executor.fault", spec, "must be '<raise|hang|exit>:<stage>:<n>' with n >= 1")
    return kind, stage, n
