"""TD-Pipe's KV forecast (Zhang et al., "TD-Pipe: Temporally-Disaggregated Pipeline Parallelism
Architecture for High-Throughput LLM Inference", 2025; docs/policies.md): the predicted KV blocks
the admitted requests hold at future decode points, which the AI-based greedy prefill uses to
admit requests while the forecast peak stays under the pool. Split from policies/tdpipe.py
(the policy) as the one pure, array-level piece it uses.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np

from engine.base.errors import bad_value

PAPER_POINTS = tuple(range(32, 1025, 32))  # the paper: every 32 decode steps up to 1024
CODE_POINTS = (5, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)  # the public code


def parse_points(spec: str) -> tuple[int, ...]:
    if spec == "paper":
        return PAPER_POINTS
    if spec == "code":
        return CODE_POINTS
    try:
        pts = tuple(sorted({int(x) for x in spec.split(",") if x.strip()}))
    except ValueError:
        pts = ()
    if not pts or pts[0] < 1:
        raise bad_value("policy.future_points", spec, "must be paper, code or a comma list of positive integers")
    return pts


class KVForecast:
    """Predicted KV blocks held at each future decode point by the admitted requests."""

    def __init__(self, points: Seq[int], block_size: int) -> None:
        self.points = np.asarray(points, dtype=np.int64)
        self.block_size = block_size
        self.usage = np.zeros(len(self.points), dtype=np.int64)

    def contributions(self, lengths, remaining) -> np.ndarray:
        """(n, points) blocks: request i holds blocks(lengths[i] + f) at point f <= remaining[i]."""
        L = np.asarray(lengths, dtype=np.int64)[:, None]
        R = np.asarray(remaining, dtype=np.int64)[:, None]
        f = self.points[None, :]
        return np.where(f <= R, -(-(L + f) // self.block_size), 0)

    def add(self, lengths, remaining) -> None:
        if len(lengths):
            self.usage += self.summed(lengths, remaining)

    def summed(self, lengths, remaining) -> np.ndarray:
        """`contributions(...).sum(axis=0)`, the same integers. When every point is a multiple of
        the block size (the paper's points, 16-token blocks) blocks(L + f) = blocks(L) + f / bs,
        so a point's sum is over the requests with remaining >= f: a suffix of them sorted by
        remaining, read off suffix sums in O(n log n + points) instead of an (n, points) matrix
        (the plan's forecast of the running set was 11% of TD-Pipe's benchmark run, py-spy)."""
        bs = self.block_size
        if not bool((self.points % bs == 0).all()):
            return self.contributions(lengths, remaining).sum(axis=0)
        L = np.asarray(lengths, dtype=np.int64)
        R = np.asarray(remaining, dtype=np.int64)
        order = np.argsort(R, kind="stable")
        blocks = (-(-L // bs))[order]
        suffix = np.zeros(len(blocks) + 1, dtype=np.int64)
        suffix[:-1] = np.cumsum(blocks[::-1])[::-1]  # suffix[k] = blocks of the k-th smallest remaining onwards
        start = np.searchsorted(R[order], self.points, side="left")  # first request with remaining >= f
        return suffix[start] + (len(blocks) - start) * (self.points // bs)

    def reset(self) -> None:
        self.usage[:] = 0

    @property
    def peak(self) -> int:
        return int(self.usage.max()) if len(self.usage) else 0

    def admissible(self, lengths, remaining, capacity: float) -> int:
        """How many leading requests 'add while the peak is below capacity' would admit."""
        n = len(lengths)
        if n == 0:
            return 0
        cum = np.cumsum(self.contributions(lengths, remaining), axis=0)
        before = np.empty(n)
        before[0] = self.peak
        before[1:] = (self.usage[None, :] + cum[:-1]).max(axis=1)
        ok = before < capacity
        return n if ok.all() else int(np.argmin(ok))
