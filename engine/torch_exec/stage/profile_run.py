"""A CUDA stage's profile run (vLLM's `determine_num_available_blocks`, per stage): one warm-up
forward at the run's largest micro-batch on a pool just large enough for it, then memory probes
for the driver, which derives the one pool size of all stages (engine/torch_exec/shared/kv_sizing.py)."""
from __future__ import annotations

import socket
import time

import torch

import engine.torch_exec.wire.messages as wire
from engine.torch_exec.shared.kv_sizing import block_bytes, warmup_batch, warmup_shape


def warm_up(model, tokens: int, first: bool) -> int:
    """Run the warm-up micro-batch; returns the peak allocated bytes (weights + activations).
    The model's pool must hold `warmup_shape(tokens, block_size)[2]` blocks."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _run_warmup_batch(model, tokens, first)
    peak = torch.cuda.max_memory_allocated()
    model.allocate_kv(1)  # the warm-up pool goes; the measured one comes with the driver's answer
    torch.cuda.empty_cache()
    return int(peak)


WARM_TOKENS = 64  # the serving path's warm-up: 32 prompt tokens and 32 one-block decodes


def warm_serving_path(model, first: bool, num_blocks: int) -> float:
    """One small micro-batch through `prepare` and `forward` on the stage's own pool, where no
    profile run did (a pool the driver sized from `kv.num_blocks`, and every CPU run); returns its
    seconds. The first micro-batch of a run paid for what it warms: on the shared 2-core CPU
    (tiny-llama P=2, 2026-11-29) its `prepare` took 136 / 173 ms on stages 0 / 1 against 0.5-0.9 ms
    for the next ones, and each forward ~35 ms more. It writes K/V into blocks that a sequence
    overwrites before it reads them, and samples nothing (the samplers keep per-sequence state)."""
    if warmup_shape(WARM_TOKENS, model.block_size)[2] > num_blocks:
        return 0.0
    t0 = time.perf_counter()
    _run_warmup_batch(model, WARM_TOKENS, first)
    return time.perf_counter() - t0


def _run_warmup_batch(model, tokens: int, first: bool) -> None:
    """`warmup_batch(tokens)` through `prepare` and `forward` (stage 0 embeds its ids, a later stage
    takes zeros for the activation), waited for on a GPU."""
    chunk, rows = warmup_batch(tokens, model.block_size)
    b = model.prepare(chunk, rows)
    hidden = None if first else torch.zeros((b.num_tokens, model.arch.hidden_size), dtype=model.dtype,
                                            device=model.device)
    model.forward(b, hidden)
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def warm_sampling(vocab: int, settings: dict, device) -> float:
    """The run's sampling once on two rows of zeros, by a throwaway sampler (the stage's own keeps
    per-sequence state); returns its seconds. Sampling's first call on the H100 took 7.1 ms, 0.35 ms
    after (testbed/calibrate/run_fit.py), and no profile run samples."""
    from engine.torch_exec.stage.sampling import Sampler

    t0 = time.perf_counter()
    Sampler(vocab, **settings).sample(torch.zeros((2, vocab), device=device), [(-1, 0), (-2, 0)])
    return time.perf_counter() - t0


def device_key(device: str) -> str:
    """Host and GPU UUID: equal for stages that share a physical GPU."""
    props = torch.cuda.get_device_properties(device)
    return f"{socket.gethostname()}:{getattr(props, 'uuid', '') or device}"


def probe(model, stage: int, peak: int) -> wire.KvProbe:
    """This stage's memory now (free read while every stage idles, see the driver's two rounds)."""
    arch = model.arch
    free, total = torch.cuda.mem_get_info()
    per_block = block_bytes(model.num_layers, model.block_size, arch.num_kv_heads, arch.head_dim,
                            model.dtype.itemsize)
    return wire.KvProbe(stage, device_key(str(model.device)), int(total), int(free), peak,
                        int(torch.cuda.memory_allocated()), int(per_block))
