"""The KV pool's size when `kv.num_blocks` is not set: on CUDA from measured memory (below); on a
CPU machine from the memory available at start (`cpu_pool_blocks`, at the end).

vLLM sizes its cache with a profile run: load the weights, run one forward at the largest batch
the scheduler may form, read the peak, and give the KV cache what is left of the utilisation
share (vLLM's `Worker.determine_num_available_blocks`). The torch engine does the same per stage,
with two differences that pipeline parallelism on shared GPUs forces:

- One pool size for all stages: the controller's single block manager (engine/core/kv.py) names the
  same block ids on every stage, so the driver takes the minimum over devices.
- Stages that share a GPU split its free memory instead of each claiming 90% of it: the driver
  groups the stages' probes by the device they report, and on each device requires
  `num_blocks * sum(block bytes of its stages) <= utilisation * free - sum(activation peaks)`.
  Every stage then holds `num_blocks` blocks of its own layers (more layers, more bytes), which is
  the fair split of one pool size.

`free` is read when every stage has loaded its weights and finished its warm-up (the driver asks
for a second probe after all first probes arrived: a quiescent device), so it already excludes
all weights, CUDA contexts and other processes; what a stage will need again at run time is its
activation peak above its resident weights (`peak - resident`, from
`torch.cuda.max_memory_allocated` around the warm-up). The arithmetic below is pure (no torch):
tests/test_kv_sizing.py drives it with fake numbers.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

from engine.base.errors import ConfigError

GIB = 1 << 30
DEFAULT_PROFILE_TOKENS = 8192  # vLLM's default max_num_batched_tokens
# policy parameters that bound the tokens of one micro-batch (policies/*.py)
TOKEN_BUDGET_PARAMS = ("max_num_batched_tokens", "token_budget", "max_p", "prefill_tokens")
PROFILE_DECODES = 256  # decode rows added to the warm-up batch (the largest decode batch we bench)


@dataclass(frozen=True)
class StageMemory:
    """One stage's measurements (wire.KvProbe carries them to the driver)."""

    stage: int
    device_key: str  # which physical GPU (host + UUID): stages with equal keys share it
    total_bytes: int
    free_bytes: int  # torch.cuda.mem_get_info()[0] on a quiescent device
    peak_bytes: int  # max_memory_allocated over the warm-up forward (weights + activations)
    resident_bytes: int  # memory_allocated after the warm-up (weights, no KV pool)
    block_bytes: int  # KV bytes of one block over this stage's layers (K and V)


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int
    per_device: dict[str, int]  # device key -> blocks that device alone would allow
    stages_per_device: dict[str, int]


def profile_tokens(explicit: int | None, policy_params: object) -> int:
    """Tokens of the warm-up micro-batch: `executor.profile_tokens`, else the policy's own token
    budget (the largest of its budget parameters; `policy_params` a mapping or the policy's params
    dataclass), else vLLM's default of 8192."""
    if explicit is not None:
        return int(explicit)
    if dataclasses.is_dataclass(policy_params):
        policy_params = {f.name: getattr(policy_params, f.name) for f in dataclasses.fields(policy_params)}
    if not isinstance(policy_params, Mapping):
        policy_params = {}
    values = [v for k, v in policy_params.items()
              if k in TOKEN_BUDGET_PARAMS and isinstance(v, int) and not isinstance(v, bool) and v > 0]
    return max(values) if values else DEFAULT_PROFILE_TOKENS


def warmup_shape(tokens: int, block_size: int) -> tuple[int, int, int]:
    """(prefill tokens, decode rows, blocks) of the warm-up micro-batch: one prompt chunk plus up
    to PROFILE_DECODES one-block decodes (the last stage's logits grow with sampled rows)."""
    tokens = max(int(tokens), 2)
    decodes = min(PROFILE_DECODES, tokens // 2)
    prefill = tokens - decodes
    blocks = -(-prefill // block_size) + decodes
    return prefill, decodes, blocks


def warmup_batch(tokens: int, block_size: int) -> tuple[list, list]:
    """(prefill chunks, decode rows) of the warm-up micro-batch, on blocks 0..blocks-1 of a pool
    of `warmup_shape(...)[2]` blocks: sequence 0's prompt in one chunk, then one-block decodes."""
    from engine.torch_exec.wire.messages import DecodeRow, PrefillChunk

    prefill, decodes, _ = warmup_shape(tokens, block_size)
    nb = -(-prefill // block_size)
    chunk = [PrefillChunk(0, 0, prefill, True, list(range(nb)), [3] * prefill)]
    rows = [DecodeRow(1 + i, block_size - 1, [nb + i], 3) for i in range(decodes)]
    return chunk, rows


def block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """K and V of one block over a stage's layers."""
    return 2 * num_layers * block_size * kv_heads * head_dim * elem_bytes


def pool_size(probes: Sequence[StageMemory], utilization: float, max_blocks: int | None = None) -> PoolSize:
    """The one pool size every stage can hold; raises ConfigError naming the tightest device."""
    if not probes:
        raise ValueError("no stage reported its memory")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    groups: dict[str, list[StageMemory]] = {}
    for p in probes:
        groups.setdefault(p.device_key, []).append(p)
    per_device: dict[str, int] = {}
    for key, group in groups.items():
        free = min(p.free_bytes for p in group)  # the same device read by each stage: the lowest
        activations = sum(max(p.peak_bytes - p.resident_bytes, 0) for p in group)
        budget = utilization * free - activations
        per_block = sum(p.block_bytes for p in group)
        per_device[key] = int(budget // per_block) if budget > 0 and per_block > 0 else 0
    tight = min(per_device, key=per_device.__getitem__)
    n = per_device[tight]
    if n < 1:
        g = groups[tight]
        raise ConfigError(
            f"the KV cache does not fit on {tight}: {min(p.free_bytes for p in g) / GIB:.2f} GiB free after "
            f"the weights of stage(s) {[p.stage for p in g]}, x kv.gpu_memory_utilization={utilization:g}, "
            f"minus {sum(max(p.peak_bytes - p.resident_bytes, 0) for p in g) / GIB:.2f} GiB of activations "
            f"leaves no room for one block; raise parallel.pp, lower executor.profile_tokens or use a smaller model")
    if max_blocks is not None:
        n = min(n, max_blocks)
    return PoolSize(n, per_device, {k: len(v) for k, v in groups.items()})



# --- CPU: from the machine's available memory ----------------------------------------------------------

CPU_KV_SHARE = 0.25  # of the memory available at start: the stages, the driver and the OS keep the rest
CPU_KV_CAP_BYTES = 4 * GIB  # as vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE=4): a shared machine stays usable


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable), else free pages."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return None


def cpu_pool_for(arch, block_size: int, dtype: str, max_blocks: int | None = None) -> int | None:
    """`cpu_pool_blocks` for a model's shape (None when the available memory cannot be read)."""
    available = available_memory()
    if available is None:
        return None
    elem = 4 if dtype == "float32" else 2
    per_block = block_bytes(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, elem)
    return cpu_pool_blocks(per_block, available, max_blocks)


def cpu_pool_blocks(block_bytes_all_layers: int, available: int, max_blocks: int | None = None) -> int:
    """The pool on a CPU machine when `kv.num_blocks` is unset: CPU_KV_SHARE of the available
    memory, at most CPU_KV_CAP_BYTES, for blocks that span every layer (all stages share the
    machine's memory when spawned). Raises ConfigError when not one block fits."""
    budget = min(CPU_KV_SHARE * available, CPU_KV_CAP_BYTES)
    n = int(budget // block_bytes_all_layers) if block_bytes_all_layers > 0 else 0
    if n < 1:
        raise ConfigError(f"the KV cache does not fit this machine: {available / GIB:.2f} GiB available, "
                          f"one block needs {block_bytes_all_layers / 2**20:.1f} MiB; set kv.num_blocks or use a "
                          f"smaller model")
    return min(n, max_blocks) if max_blocks is not None else n


def stage_sizes(token_budget: int) -> tuple[int, ...]:
    """A stage's piecewise-graph buckets: up to the policy's token budget (0: unknown, vLLM's 8,192)
    plus the decode rows its warm-up batch adds (gLLM's max_p counts prefill tokens only), as the
    measured KV pool's warm-up batch above is sized. Here, not in the graphs folder, so that the
    graphs import nothing from the engine above them."""
    from engine.torch_exec.graphs.piecewise import piece_sizes

    return piece_sizes((token_budget or DEFAULT_PROFILE_TOKENS) + PROFILE_DECODES)
