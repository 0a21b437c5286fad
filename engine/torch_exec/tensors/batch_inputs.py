"""`BatchInputs`: the tensors one micro-batch gives every layer of a stage (`StageModel.prepare`).

A module of its own because two modules build it: the model (engine/torch_exec/model.py) from
each micro-batch, and the CUDA-graph runner (engine/torch_exec/graphs/cuda_graphs.py) over its static
buffers. The model imports the runner, so the runner cannot import the model back: that would be
an import cycle (tests/test_architecture.py refuses any).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchInputs:
    """Per-micro-batch tensors a stage builds once and every layer reuses."""

    num_tokens: int  # rows of this micro-batch (the hidden states a stage > 0 receives)
    token_ids: torch.Tensor | None  # [T] (stage 0)
    cos: torch.Tensor  # [T, head_dim] float32
    sin: torch.Tensor
    slots: torch.Tensor  # [T] where each new token's K/V goes
    sample_rows: torch.Tensor  # [S] rows whose logits are sampled
    # torch attention path
    chunks: list[tuple[int, int, int, torch.Tensor, torch.Tensor | None]]  # (row0, n, ctx, blocks, mask|None=causal)
    decode_row0: int
    decode_blocks: torch.Tensor | None  # [D * max_blocks]
    decode_mask: torch.Tensor | None  # [1, D, 1, max_blocks * block_size] bool (True = attend)
    new_blocks: torch.Tensor | None = None  # blocks named for the first time: zero them
    # triton attention path (paged_attention's arguments)
    block_tables: torch.Tensor | None = None  # [S, max_blocks]
    query_start: torch.Tensor | None = None  # [S + 1]
    context_lens: torch.Tensor | None = None  # [S]
    max_query_len: int = 0
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # (sequence, tile index) per kernel program
    graph_rows: int = 0  # > 0: a decode-only batch padded to this CUDA-graph bucket (rows past num_tokens)
