"""Token sampling on the last stage: greedy, or temperature / top-k / top-p with a seed.

Random sampling gives every (request, position) its own generator, seeded from
(`sample_seed`, request id, position), so a request's tokens do not depend on which other
requests shared its micro-batch, on the policy or on the pipeline depth. Filters apply in
vLLM's order: temperature, then top-k, then top-p (the smallest set of tokens whose
probability reaches p, always keeping the most likely one).
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 63) - 1


def row_seed(sample_seed: int, seq_id: int, position: int) -> int:
    return ((sample_seed * 1_000_003 + seq_id) * 1_000_033 + position) & _MASK64


def sample(logits: torch.Tensor, keys: list[tuple[int, int]], *, method: str = "greedy",
           temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> list[int]:
    """logits [S, vocab] float32; keys[i] = (seq_id, position of the sampled token)."""
    if method == "greedy" or temperature == 0:
        return logits.argmax(dim=-1).tolist()
    x = logits / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        drop = before >= top_p
        drop[:, 0] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
    probs = x.softmax(dim=-1)
    out = []
    g = torch.Generator(device=logits.device)
    for i, (seq_id, pos) in enumerate(keys):
        g.manual_seed(row_seed(seed, seq_id, pos))
        out.append(int(torch.multinomial(probs[i], 1, generator=g)))
    return out
