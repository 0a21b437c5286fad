"""`BatchInputs`: the tensors one micro-batch gives every layer of a stage (`StageModel.prepare`).

A module of its own because two modules build it: the model (engine/torch_exec/stage/model.py) from
each micro-batch, and the CUDA-graph runner (engine/torch_exec/graphs/cuda_graphs.py) over its static
buffers. The model imports the runner, so the runner cannot import the model back: that would be
an import cycle (tests/test_architecture.py refuses any).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context attended together (torch path): padded to the group's longest."""

    rows: torch.Tensor  # [n] their rows in the micro-batch
    blocks: torch.Tensor  # [n * max_blocks] each one's blocks, padded with its first block
    mask: torch.Tensor  # [1, n, 1, max_blocks * block_size] bool (True = attend)


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
    new_blocks: torch.Tensor | None = None  # blocks named for the first time: zero them
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # triton attention path (paged_attention's arguments)
    block_tables: torch.Tensor | None = None  # [S, max_blocks]
    query_start: torch.Tensor | None = None  # [S + 1]
    context_lens: torch.Tensor | None = None  # [S]
    max_query_len: int = 0
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # (sequence, tile index) per kernel program
    graph_rows: int = 0  # > 0: a decode-only batch padded to this CUDA-graph bucket (rows past num_tokens)
