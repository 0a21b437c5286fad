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

Spans are timed by the stages themselves (shared/timing.py): wall clock on CPU, CUDA events on a GPU.
Also `measure_peaks(device=...)`: the executor's device peaks, on the GPU when it is one (bf16
GEMMs at several shapes, a large device-to-device copy, CUDA events), on the host otherwise;
`device_provenance()`: GPU name, driver, torch and CUDA versions, date, for the saved profile.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine.core.batch import MicroBatch, PrefillChunk
from engine.pricing.profile_table import ProfileRow, ProfileTable
from engine.pricing.profile_grid import GRIDS, ProfileGrid, design, max_context
from engine.core.request import Request, Sequence as Seq
from engine.torch_exec.shared.timing import WallTimer, is_cuda, timer_for

DEFAULT_GRID = GRIDS["default"]
QUICK_GRID = GRIDS["quick"]


class _Designer:
    def __init__(self) -> None:
        self.next_id = 10_000_000
        self.mb_id = 1_000_000

    def batch(self, kind: str, b: int, x: int, L: int, c: int) -> MicroBatch:
        self.mb_id += 1
        prefills, decodes = [], []
        for _ in range(b if kind == "prefill" else 1 if kind == "mixed" else 0):
            self.next_id += 1
            seq = Seq(Request(self.next_id, 0.0, L + x, 1))
            prefills.append(PrefillChunk(seq, L, x, True))
        for _ in range(b if kind in ("decode", "mixed") else 0):
            self.next_id += 1
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
            nbytes = {"prefill": b * x, "decode": b, "mixed": x + b}[kind] * act_bytes
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


# bf16 GEMM shapes (M, N, K) timed on a GPU: square, an MLP-like up-projection, a small-M one
GPU_GEMM_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (4096, 14336, 4096), (256, 8192, 8192))
GPU_COPY_BYTES = 2 ** 31  # device-to-device copy for HBM bandwidth: far beyond any cache
CPU_GEMM_SHAPES = ((1024, 1024, 1024),)
CPU_COPY_BYTES = 2 ** 26


def _best_s(fn: Callable[[], Any], timer, repeats: int) -> float:
    """Best of `repeats` timed calls after one untimed call (first-touch, lazy inits)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        mark = timer.start()
        fn()
        a, e = timer.stop(mark)
        best = min(best, e - a)
    return max(best, 1e-9)


def device_peaks(torch, device: str, dtype, gemm_shapes: Sequence[tuple[int, int, int]], copy_bytes: int,
                 timer, repeats: int = 5) -> dict[str, Any]:
    """Peak GEMM FLOP/s (best shape) and copy bandwidth (read + write) on `device`, timed by `timer`."""
    gemm: dict[str, float] = {}
    for m, n, k in gemm_shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        gemm[f"{m}x{n}x{k}"] = 2.0 * m * n * k / _best_s(lambda: torch.mm(a, b), timer, repeats)
    elem = torch.empty((), dtype=dtype).element_size()
    src = torch.empty(copy_bytes // elem, device=device, dtype=dtype).fill_(1.0)
    dst = torch.empty_like(src)
    bw = 2.0 * src.numel() * elem / _best_s(lambda: dst.copy_(src), timer, repeats)
    return {"peak_flops": max(gemm.values()), "mem_bw_Bps": bw, "gemm_flops": gemm, "dtype": str(dtype),
            "device": device, "timer": getattr(timer, "kind", type(timer).__name__), "copy_bytes": copy_bytes}


def measure_peaks(threads: int = 1, repeats: int = 5, device: str = "cpu") -> dict[str, Any]:
    """The executor's device peaks: on CPU a single-thread fp32 1024^3 GEMM and a 64 MiB copy
    (wall clock); on CUDA bf16 GEMMs at `GPU_GEMM_SHAPES` and a 2 GiB device-to-device copy,
    timed with CUDA events (the issue: `testbed profile` on an H100 used to report the host CPU's
    142.8 GFLOP/s and 14.7 GB/s). Raises RuntimeError when `device` is CUDA and none is there."""
    import torch

    if is_cuda(device):
        timer = timer_for(device)  # raises without CUDA
        with torch.cuda.device(torch.device(device)):
            out = device_peaks(torch, device, torch.bfloat16, GPU_GEMM_SHAPES, GPU_COPY_BYTES, timer, repeats)
            torch.cuda.empty_cache()
        return out
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return device_peaks(torch, "cpu", torch.float32, CPU_GEMM_SHAPES, CPU_COPY_BYTES, WallTimer(), repeats)
    finally:
        torch.set_num_threads(old)


def _driver_version() -> str:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def _cpu_name() -> str:
    import platform

    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_provenance(device: str) -> dict[str, Any]:
    """Where a profile was measured: device name, driver, torch/CUDA versions, date (UTC)."""
    import datetime
    import os
    import platform

    import torch

    info: dict[str, Any] = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                            "device": device, "torch": torch.__version__, "python": platform.python_version(),
                            "host_cpu": _cpu_name(), "host_cpus": os.cpu_count()}
    if is_cuda(device):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r}: CUDA is not available on this machine")
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu=torch.cuda.get_device_name(dev), gpu_memory_gib=round(props.total_memory / 2 ** 30, 2),
                    compute_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), driver=_driver_version())
    return info


def device_memory_gib(device: str) -> float:
    """Memory of the executor's device: the GPU's on CUDA, the host's on CPU."""
    if is_cuda(device):
        import torch

        return torch.cuda.get_device_properties(torch.device(device)).total_memory / 2 ** 30
    return host_memory_gib()


def host_memory_gib() -> float:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    except (ValueError, OSError, AttributeError):
        return 16.0


__all__ = ["DEFAULT_GRID", "QUICK_GRID", "GRIDS", "ProfileGrid", "design", "max_context", "profile_engine",
           "measure_peaks", "device_peaks", "device_provenance", "device_memory_gib", "host_memory_gib"]
