"""Profile the real engine: designed micro-batches, one at a time, through `TorchExecutor`.

What is measured and how (`profile_engine`):
- `inflight` (default P) copies of each designed batch are launched back to back, so that the
  stages run concurrently as in a loaded pipeline: on a CPU host the stage processes share cores
  and memory bandwidth, and isolated timings underestimate a pipelined run badly (docs/calibration.md).
- The executor is built exactly as `testbed run executor=torch ...` builds it (same stage
  processes, model, threads, transport), then driven by hand: no policy, no workload. Each
  designed batch is a `MicroBatch` of synthetic sequences (prefill chunks of `tokens` after a
  `prefix`, or decodes at a `context`), launched alone and awaited, `repeats` times after
  `warmup` untimed launches; the per-stage spans the stages report are reduced to medians.
- forward: the `forward:<kind>` span on every stage (lm_head included on the last stage).
- prepare: the `prepare` span (index tensors for the batch), every stage.
- sample: the `sample` span on the last stage.
- transfer: per hop s -> s+1, from the start of stage s's `send` to the end of stage s+1's `recv`
  (or from the later of that send and the recv's start, when the receiver was still preparing);
  all processes share CLOCK_MONOTONIC, so the spans are comparable.
KV contents do not matter for timing, but cache locality does: every sequence gets its own blocks,
round robin over the pool (`kv.num_blocks`; `testbed profile` sizes it for the largest batch).

Also `measure_peaks()`: a quick single-thread GEMM and copy measurement that gives the nominal
peak FLOP/s and memory bandwidth of a calibrated CPU `HardwareSpec`.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.batch import MicroBatch, PrefillChunk
from engine.calibration import ProfileRow, ProfileTable
from engine.request import Request, Sequence as Seq

DEFAULT_GRID = {
    "prefill_tokens": (8, 32, 128, 256, 512),
    "prefill_batch": (1, 4),
    "prefill_prefix": (0, 512),
    "decode_batch": (1, 4, 16, 64, 128),
    "decode_context": (16, 256, 1024),
}
QUICK_GRID = {
    "prefill_tokens": (16, 128, 384),
    "prefill_batch": (1,),
    "prefill_prefix": (0, 256),
    "decode_batch": (1, 16, 64),
    "decode_context": (32, 512),
}


def design(grid: Mapping[str, Sequence[int]]) -> list[tuple[str, int, int, int, int]]:
    """(kind, batch, tokens, prefix, context) of every designed batch."""
    out = []
    for b in grid["prefill_batch"]:
        for x in grid["prefill_tokens"]:
            for L in grid["prefill_prefix"]:
                if b * x <= 2048:
                    out.append(("prefill", b, x, L, 0))
    for b in grid["decode_batch"]:
        for c in grid["decode_context"]:
            out.append(("decode", b, 0, 0, c))
    return out


def max_context(grid: Mapping[str, Sequence[int]]) -> int:
    return max(max(grid["prefill_tokens"]) + max(grid["prefill_prefix"]), max(grid["decode_context"]))


class _Designer:
    def __init__(self) -> None:
        self.next_id = 10_000_000
        self.mb_id = 1_000_000

    def batch(self, kind: str, b: int, x: int, L: int, c: int) -> MicroBatch:
        self.mb_id += 1
        prefills, decodes = [], []
        for _ in range(b):
            self.next_id += 1
            if kind == "prefill":
                seq = Seq(Request(self.next_id, 0.0, L + x, 1))
                prefills.append(PrefillChunk(seq, L, x, True))
            else:
                seq = Seq(Request(self.next_id, 0.0, c, 1))
                seq.num_computed = c - 1  # the new token is at position c-1, attending c tokens
                decodes.append(seq)
        mb = MicroBatch(self.mb_id, tuple(prefills), tuple(decodes))
        return mb


def profile_engine(executor, grid: Mapping[str, Sequence[int]], *, block_size: int, repeats: int = 3,
                   warmup: int = 2, inflight: int | None = None, bytes_of: Callable[[ProfileRow], int] | None = None, progress: Callable[[int, int], None] | None = None) -> ProfileTable:
    """Run the designed batches through a started-or-not `TorchExecutor`; returns the median table."""
    executor.block_table = _round_robin_tables(executor, max_context(grid), block_size)
    executor.start()
    des = _Designer()
    P = executor.pipeline_depth
    points = design(grid)
    # warm-up (first-touch allocations, lazy inits)
    for kind, b, x, L, c in points[:1] + points[-1:]:
        for _ in range(warmup):
            executor.launch(des.batch(kind, b, x, L, c))
            executor.next_completion()
    samples: dict[tuple, list[float]] = defaultdict(list)
    done = 0
    total = len(points) * repeats
    k = inflight or P  # copies in flight at once: stages overlap as in a loaded pipeline (CPU contention)
    for rep in range(repeats):
        for point in points:
            mbs = [des.batch(*point) for _ in range(k)]
            for mb in mbs:
                executor.launch(mb)
            for _ in mbs:
                comp = executor.next_completion()
                assert comp is not None
            _collect(executor.tracer.spans, mbs, P, point, samples)
            done += 1
            if progress:
                progress(done, total)
    return _table(samples, executor_activation_bytes(executor), bytes_of)


def _round_robin_tables(executor, ctx: int, block_size: int) -> Callable[[int], list[int]]:
    per_seq = (ctx + block_size - 1) // block_size + 1
    pool = int(getattr(getattr(executor, "kv", None), "num_blocks", 0) or per_seq)
    if pool < per_seq:
        raise ValueError(f"the KV pool ({pool} blocks) cannot hold one context of {ctx} tokens")
    tables: dict[int, list[int]] = {}
    cursor = [0]

    def table(seq_id: int) -> list[int]:
        # distinct blocks per sequence (round robin over the pool), as in serving: sequences sharing
        # blocks would read a cache-hot KV and make attention look cheaper than it is
        got = tables.get(seq_id)
        if got is None:
            if cursor[0] + per_seq > pool:
                cursor[0] = 0
            got = tables[seq_id] = list(range(cursor[0], cursor[0] + per_seq))
            cursor[0] += per_seq
        return got

    return table


def _collect(spans, mbs, P: int, point: tuple, samples: dict) -> None:
    """The durations of each micro-batch's forward/prepare/sample/transfer spans, per stage."""
    ids = {mb.mb_id for mb in mbs}
    per: dict[int, dict] = defaultdict(dict)
    for s in spans:
        if s[4] in ids:
            per[s[4]][(s[0], s[1].split(":")[0])] = (s[2], s[3])
    for mb in mbs:
        by = per[mb.mb_id]
        for st in range(P):
            tr = f"stage{st}"
            for op in ("forward", "prepare") + (("sample",) if st == P - 1 else ()):
                if (tr, op) in by:
                    a, e = by[(tr, op)]
                    samples[(op, st, point)].append(e - a)
            if st < P - 1 and (tr, "send") in by and (f"stage{st + 1}", "recv") in by:
                s0, _ = by[(tr, "send")]
                r0, r1 = by[(f"stage{st + 1}", "recv")]
                samples[("transfer", st, point)].append(max(1e-7, r1 - max(s0, r0)))


def _table(samples: dict, act_bytes: int, bytes_of) -> ProfileTable:
    rows = []
    for (op, st, (kind, b, x, L, c)), ts in samples.items():
        t = statistics.median(ts)
        nbytes = 0
        if op == "transfer":
            nbytes = (b * x if kind == "prefill" else b) * act_bytes
            if bytes_of is not None:  # the simulator's own byte count, so the fitted bandwidth matches it
                nbytes = bytes_of(ProfileRow(op, st, kind, b, x, L, c, 0, 1.0))
        rows.append(ProfileRow(op, st, kind, b, x, L, c, nbytes, max(t, 1e-7)))
    return ProfileTable(rows)


def executor_activation_bytes(executor) -> int:
    """Bytes a stage really sends per token: hidden x element size of the running dtype."""
    arch = getattr(executor, "arch", None)
    hidden = getattr(arch, "hidden_size", None) or 0
    dtype = executor.settings.resolved_dtype
    return int(hidden) * {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]


def measure_peaks(threads: int = 1, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` single-process GEMM FLOP/s (fp32, 1024^2) and copy bandwidth (64 MiB)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 1024
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t)
        flops = 2 * n ** 3 / best
        src = torch.empty(16 * 2 ** 20, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best_c = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            dst.copy_(src)
            best_c = min(best_c, time.perf_counter() - t)
        bw = 2 * src.numel() * 4 / best_c  # read + write
    finally:
        torch.set_num_threads(old)
    return {"peak_flops": flops, "mem_bw_Bps": bw}


def host_memory_gib() -> float:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return 16.0


__all__ = ["DEFAULT_GRID", "QUICK_GRID", "design", "profile_engine", "measure_peaks", "host_memory_gib"]
_ = Any
