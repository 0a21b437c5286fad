"""A CUDA stage's profile run (vLLM's `determine_num_available_blocks`, per stage): one warm-up
forward at the run's largest micro-batch on a pool just large enough for it, then memory probes
for the driver, which derives the one pool size of all stages (engine/torch_exec/shared/kv_sizing.py)."""
from __future__ import annotations

import socket

import torch

import engine.torch_exec.wire.messages as wire
from engine.torch_exec.shared.kv_sizing import block_bytes, warmup_batch


def warm_up(model, tokens: int, first: bool) -> int:
    """Run the warm-up micro-batch; returns the peak allocated bytes (weights + activations).
    The model's pool must hold `warmup_shape(tokens, block_size)[2]` blocks."""
    chunk, rows = warmup_batch(tokens, model.block_size)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    b = model.prepare(chunk, rows)
    hidden = None if first else torch.zeros((b.num_tokens, model.arch.hidden_size), dtype=model.dtype,
                                            device=model.device)
    model.forward(b, hidden)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del b, hidden
    model.allocate_kv(1)  # the warm-up pool goes; the measured one comes with the driver's answer
    torch.cuda.empty_cache()
    return int(peak)


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
