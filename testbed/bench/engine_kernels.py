"""`testbed bench engine --kernels`: where one forward's time goes, kernel by kernel, per micro-batch kind.

The whole model as one `StageModel` in this process (no driver, no IPC: the stage's own forward,
as a P=1 stage runs it, CUDA graphs included where the engine uses them), random weights in the
run's dtype on the run's device. For a decode, a mixed (a prefill chunk plus decodes) and a
prefill micro-batch it times `prepare` and `forward` (median of `repeats`, after a warm-up), then
runs `PROFILED` forwards under `torch.profiler` (CPU activity, and CUDA on a GPU) and keeps the
top kernels: on CUDA by self device time (what the GPU ran), on CPU by self CPU time (the ops the
host executed). `host ms / forward` is the profiler's total self CPU time per forward: on a GPU,
the launch cost the host pays for that forward (a mixed forward that runs eagerly is
launch-bound when it exceeds the device time).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

# (kind, prefill tokens, decodes, decode context): the shapes of the H100 breakdown the issue cites
CASES = (("decode", 0, 128, 512), ("mixed", 400, 160, 512), ("prefill", 2048, 0, 0))
QUICK_CASES = (("decode", 0, 8, 128), ("mixed", 64, 8, 128), ("prefill", 128, 0, 0))
PROFILED = 5
TOP = 12


@dataclass(frozen=True)
class KernelRow:
    name: str
    calls_per_forward: float
    ms_per_forward: float  # self device time on CUDA, self CPU time on CPU
    share: float  # of the kind's total over the same events


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size) + 1


def _case_rows(prefill: int, decodes: int, context: int, block_size: int, cursor: list[int]):
    """The model's rows for one case, every sequence on its own blocks (round robin)."""
    def table(tokens: int) -> list[int]:
        n = _blocks(tokens, block_size)
        cursor[0] += n
        return list(range(cursor[0] - n, cursor[0]))

    chunks = [(1, 0, prefill, True, table(prefill), [1 + i % 1000 for i in range(prefill)])] if prefill else []
    rows = [(100 + i, context - 1, table(context), 7) for i in range(decodes)]
    return chunks, rows


def _event_ms(ev, cuda: bool) -> float:
    """Self time of a profiler average in ms (device time on CUDA; the attribute's name moved
    from `self_cuda_time_total` to `self_device_time_total` in torch 2.4)."""
    if cuda:
        us = getattr(ev, "self_device_time_total", None)
        if us is None:
            us = getattr(ev, "self_cuda_time_total", 0.0)
        return us / 1e3
    return ev.self_cpu_time_total / 1e3


def _profile(model, b, sync, cuda: bool, top: int) -> tuple[list[KernelRow], float]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(PROFILED):
            model.forward(b, None)
        sync()
    events = [ev for ev in prof.key_averages() if _event_ms(ev, cuda) > 0]
    host_ms = sum(ev.self_cpu_time_total for ev in prof.key_averages()) / 1e3 / PROFILED
    total = sum(_event_ms(ev, cuda) for ev in events) or 1.0
    events.sort(key=lambda ev: -_event_ms(ev, cuda))
    rows = [KernelRow(ev.key, ev.count / PROFILED, _event_ms(ev, cuda) / PROFILED, _event_ms(ev, cuda) / total)
            for ev in events[:top]]
    return rows, host_ms


def kernel_tables(spec, quick: bool, repeats: int, top: int = TOP) -> dict[str, Any]:
    """{"device", "sort", "kinds": [{kind, shape, prepare_s, forward_s, host_ms, rows}]} for the run's model."""
    import torch

    from engine.torch_exec.weights.checkpoint import model_source, random_tensors, read_arch, spec_arch, stage_tensor_names
    from engine.torch_exec.stage.model import StageModel

    rc = spec.settings
    st = rc.executor.settings
    path, model_spec = model_source(st, rc.model)
    arch = read_arch(path) if path else spec_arch(model_spec)
    cuda = st.device == "cuda"
    device = "cuda:0" if cuda else "cpu"
    cases = QUICK_CASES if quick else CASES
    bs = rc.kv.block_size
    need = max(_blocks(p, bs) + d * _blocks(c, bs) for _, p, d, c in cases)
    old = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(st.threads_per_stage)
    L = arch.num_layers
    try:
        m = StageModel(arch, 0, L, True, True, need, bs, dtype=st.resolved_dtype, device=device, attention=st.attention)
        m.set_weights(random_tensors(arch, stage_tensor_names(arch, 0, L, True, True), st.model_seed, m.dtype, m.device))
        m.configure(None, cuda_graphs=cuda and st.cuda_graphs)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        kinds = [_kind(m, case, bs, sync, cuda, repeats, top) for case in cases]
        del m
        if cuda:
            torch.cuda.empty_cache()
    finally:
        torch.set_num_threads(old)
    return {"device": device, "sort": "self device time" if cuda else "self CPU time", "kinds": kinds}


def _kind(m, case, bs: int, sync, cuda: bool, repeats: int, top: int) -> dict[str, Any]:
    kind, prefill, decodes, context = case
    chunks, rows = _case_rows(prefill, decodes, context, bs, [0])

    def timed(fn) -> float:
        fn()
        sync()
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            sync()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    m.forward(m.prepare(chunks, rows), None)  # first touch: the torch path zeroes the blocks it meets
    prep = timed(lambda: m.prepare(chunks, rows))
    b = m.prepare(chunks, rows)  # steady state: nothing left to zero
    fwd = timed(lambda: m.forward(b, None))
    kernels, host_ms = _profile(m, b, sync, cuda, top)
    return {"kind": kind, "prefill_tokens": prefill, "decodes": decodes, "context": context, "prepare_s": prep,
            "forward_s": fwd, "host_ms": host_ms, "graph": bool(b.graph_rows), "rows": [asdict(r) for r in kernels]}


def print_kernels(out: dict, console) -> None:
    from rich.table import Table

    for k in out["kinds"]:
        shape = {"decode": f"{k['decodes']} decodes x {k['context']}",
                 "mixed": f"{k['prefill_tokens']} prefill + {k['decodes']} decodes x {k['context']}",
                 "prefill": f"{k['prefill_tokens']} tokens"}[k["kind"]]
        t = Table(title=f"{k['kind']} {shape} on {out['device']}: prepare {1e3 * k['prepare_s']:.2f} ms, forward "
                        f"{1e3 * k['forward_s']:.2f} ms{' (CUDA graph)' if k['graph'] else ''}, host "
                        f"{k['host_ms']:.2f} ms / forward; top kernels by {out['sort']}")
        for col, just in (("kernel", "left"), ("calls", "right"), ("ms / forward", "right"), ("share", "right")):
            t.add_column(col, justify=just, overflow="fold")
        for r in k["rows"]:
            t.add_row(r["name"][:80], f"{r['calls_per_forward']:g}", f"{r['ms_per_forward']:.3f}", f"{r['share']:.1%}")
        console.print(t)
