"""`testbed bench engine [overrides] [--quick]`: the real engine's step times against the floor.

    testbed bench engine model=tiny-llama parallel.pp=2 --quick                 # CPU, seconds
    testbed bench engine model=qwen2.5-7b executor.device=cuda parallel.pp=1 \
        workload=sharegpt workload.num_requests=200 workload.max_total_len=2048 --attention-bandwidth

For the run the overrides describe (its model, device, dtype, P; `executor=torch` is implied),
in one process and one run:

1. the floor (testbed/bench/engine_floor.py): the model's linear layers + lm_head (one CUDA graph
   on CUDA, eager on CPU) and SDPA attention on contiguous K/V, for every grid point -- measured
   first and released, so that on CUDA the stages' measured KV pool is not squeezed by it;
2. end to end: the run's workload through the controller and policy on the started engine,
   total and output tokens/s over the run, TPOT p50 and the stages' bubble ratios;
3. the grid, on the same started engine: one designed micro-batch at a time -- decodes of batch
   1-256 at context 128-2,048, prefills of 128-4,096 tokens -- in steady state (`SteadyBatches`:
   a decode point's sequences hold their blocks in the run's block manager and advance one token
   per launch, as in serving), `step` is the driver's wall time from launch to the sampled ids
   back (every stage, every hop, the sampler), `forward` the sum of the stages' own forward spans,
   so `step - forward` is the host's cost per step. `x floor` = step / floor.

`workload=sharegpt` (or any workload) replaces the default synthetic one of step 2; the synthetic
lengths apply only to the synthetic workload. `--kernels` adds the top kernels per micro-batch
kind from `torch.profiler` (testbed/bench/engine_kernels.py), measured in this process before the
stages start.

Host timing (`perf_counter`) for the engine, which spans processes; CUDA events for the in-process
floor (the stages synchronise the device before closing a forward span). `--attention-bandwidth`
adds the paged-attention kernel's K/V bytes read per second against the device's copy rate.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.batch import MicroBatch

if TYPE_CHECKING:
    from testbed.config.spec import RunSpec

GRID = {"decode_batch": (1, 8, 32, 64, 128, 256), "decode_context": (128, 512, 2048),
        "prefill_tokens": (128, 512, 1024, 2048, 4096)}
QUICK = {"decode_batch": (1, 8), "decode_context": (32, 128), "prefill_tokens": (32, 128)}
BASE = ["executor=torch", "model=tiny-llama", "workload=synthetic", "workload.arrival=offline", "output.trace=full",
        "output.mlflow=false", "output.plots=false", "output.progress=false"]
# the synthetic workload's lengths apply only when the run keeps it; another workload (sharegpt,
# azure) has its own lengths and only takes the request count
QUICK_WORKLOAD = ["workload.num_requests=6", "workload.input_mean=48", "workload.output_mean=8"]
FULL_WORKLOAD = ["workload.num_requests=64", "workload.input_mean=512", "workload.output_mean=128"]
BANDWIDTH_POINTS = ((32, 512), (128, 512), (128, 2048), (256, 2048))


@dataclass(frozen=True)
class Point:
    kind: str  # decode | prefill
    batch: int
    tokens: int  # prefill tokens (0 for decodes)
    context: int  # decode context (0 for prefills)


@dataclass(frozen=True)
class Row:
    point: Point
    step_s: float
    forward_s: float
    linear_floor_s: float
    attention_floor_s: float

    @property
    def floor_s(self) -> float:
        return self.linear_floor_s + self.attention_floor_s

    @property
    def x_floor(self) -> float:
        return self.step_s / self.floor_s if self.floor_s > 0 else math.inf


def grid_points(grid: dict) -> list[Point]:
    pts = [Point("decode", b, 0, c) for c in grid["decode_context"] for b in grid["decode_batch"]]
    return pts + [Point("prefill", 1, t, 0) for t in grid["prefill_tokens"]]


def add_grid_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("overrides", nargs="*", help="run overrides: model=, executor.device=, parallel.pp=, workload ...")
    ap.add_argument("--quick", action="store_true", help="a CI-sized grid and workload (seconds on CPU)")
    ap.add_argument("--repeats", type=int, default=None, help="timed launches per point (default 5; quick 2)")
    ap.add_argument("--attention-bandwidth", action="store_true",
                    help="also the paged-attention kernel's K/V bytes/s against the device's copy rate")
    ap.add_argument("--kernels", action="store_true",
                    help="also the top kernels of a decode, a mixed and a prefill forward (torch.profiler)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the figures as JSON here")


def _config(overrides: list[str], quick: bool, grid: dict) -> RunSpec:
    from testbed.config.spec import compose_spec
    from testbed.config.overrides import merge

    spec = compose_spec(merge(BASE, workload_defaults(overrides, quick), overrides))
    rc = spec.settings
    if rc.executor.name != "torch":
        from engine.base.errors import ConfigError

        raise ConfigError(f"testbed bench engine measures the real engine: invalid executor={rc.executor.name}; "
                          f"valid choices: torch")
    values: dict[str, Any] = {}
    st = rc.executor.settings
    if st.profile_tokens is None:  # a measured pool leaves room for the grid's largest prefill
        values["executor.profile_tokens"] = max(grid["prefill_tokens"]) + max(grid["decode_batch"])
    if st.device != "cuda" and rc.kv.num_blocks is None:
        # on CPU the pool is what the grid needs (distinct blocks per sequence), not the hardware table's
        bs = rc.kv.block_size
        per_seq = -(-(max(max(grid["decode_context"]), max(grid["prefill_tokens"])) + 1) // bs) + 1
        values["kv.num_blocks"] = max(per_seq * max(grid["decode_batch"]), 1024)
    return spec.with_values(values)


def workload_defaults(overrides: list[str], quick: bool) -> list[str]:
    """The bench's workload size for the workload the overrides name: the synthetic one's lengths
    only when it is the synthetic workload (`workload=sharegpt` has no `workload.input_mean`)."""
    named = [ov.partition("=")[2] for ov in overrides if ov.partition("=")[0] == "workload"]
    layer = QUICK_WORKLOAD if quick else FULL_WORKLOAD
    return layer if not named or named[-1] == "synthetic" else layer[:1]


def run_grid(args: argparse.Namespace, console=None) -> dict:
    """Measure, print the tables, return the figures (also written to --json)."""
    import engine.torch_exec  # noqa: F401
    import policies  # noqa: F401
    from rich.console import Console

    console = console or Console()
    grid = QUICK if args.quick else GRID
    repeats = args.repeats or (2 if args.quick else 5)
    spec = _config(list(args.overrides), args.quick, grid)
    points = grid_points(grid)
    floors, arch, bandwidth = _floors(spec, points, repeats, args.attention_bandwidth)
    kernels = None
    if args.kernels:  # in this process, released before the stages start (their KV pool is measured)
        from testbed.bench.engine_kernels import kernel_tables

        kernels = kernel_tables(spec, args.quick, repeats)
    e2e, steps, info = _engine(spec, points, repeats)
    rows = [Row(p, steps[p][0], steps[p][1], floors[p].linear_s, floors[p].attention_s) for p in points]
    out = {"info": {**info, "model": arch.name, "load_avg": _load_avg(), "repeats": repeats},
           "end_to_end": e2e, "rows": [{**asdict(r.point), "step_s": r.step_s, "forward_s": r.forward_s,
                                         "linear_floor_s": r.linear_floor_s,
                                         "attention_floor_s": r.attention_floor_s, "x_floor": r.x_floor}
                                        for r in rows], "attention_bandwidth": bandwidth, "kernels": kernels}
    print_tables(out, console)
    if kernels is not None:
        from testbed.bench.engine_kernels import print_kernels

        print_kernels(kernels, console)
    if args.json_out:  # checked before the measurement; a late failure keeps the figures elsewhere
        from testbed.run.out_checks import write_or_keep

        write_or_keep(Path(args.json_out), json.dumps(out, indent=1), "the figures")
    return out


def _floors(spec: RunSpec, points: list[Point], repeats: int, bandwidth: bool):
    import torch

    from engine.torch_exec.weights.checkpoint import model_source, read_arch, spec_arch
    from engine.torch_exec.driver.executor import check_launchable
    from engine.torch_exec.settings import TorchSettings
    from testbed.bench.engine_floor import Floor, attention_bandwidth, copy_rate

    rc = spec.settings
    st: TorchSettings = rc.executor.settings
    check_launchable(st)  # e.g. executor.device=cuda without CUDA: one error line, before the floor
    path, spec = model_source(st, rc.model)
    arch = read_arch(path) if path else spec_arch(spec)
    device = "cuda:0" if st.device == "cuda" else "cpu"
    old = torch.get_num_threads()
    if st.device == "cpu":
        torch.set_num_threads(st.threads_per_stage)  # one stage's cores
    try:
        floor = Floor(arch, st.resolved_dtype, device, repeats)
        floors = {p: floor.time_point(p.kind, p.batch, p.tokens, p.context) for p in points}
        floor.close()
        del floor
        bw = None
        if bandwidth:
            bw = _bandwidth(arch, st.resolved_dtype, device, rc.kv.block_size, copy_rate, attention_bandwidth)
    finally:
        torch.set_num_threads(old)
    return floors, arch, bw


def _bandwidth(arch, dtype: str, device: str, block_size: int, copy_rate, attention_bandwidth) -> dict:
    big = (1 << 30) if device.startswith("cuda") else (1 << 27)
    rate = copy_rate(device, big)
    rows = []
    for b, c in BANDWIDTH_POINTS:
        got = attention_bandwidth(arch, dtype, device, b, c, block_size)
        if isinstance(got, str):
            return {"copy_Bps": rate, "note": got, "rows": []}
        t, nbytes, bps = got
        rows.append({"batch": b, "context": c, "kernel_s": t, "kv_bytes": nbytes, "Bps": bps, "of_copy": bps / rate})
    return {"copy_Bps": rate, "note": "", "rows": rows}


def _engine(spec: RunSpec, points: list[Point], repeats: int):
    """Start the engine once: the end-to-end run first (clean bubbles and window), then the grid."""
    from engine.core.metrics import SLO, summarize
    from testbed.run.runner import prepare_experiment

    prep = prepare_experiment(spec)
    ctrl = prep.controller
    ex = ctrl.executor
    P = ex.pipeline_depth
    try:
        ctrl.start()
        t = time.perf_counter()
        ctrl.run()
        wall = time.perf_counter() - t
        s = summarize(ctrl, SLO(), [f"stage{i}" for i in range(P)])
        e2e = {"num_requests": s["num_requests"], "num_finished": s["num_finished"], "wall_s": wall,
               "total_tok_s": s["throughput_tok_s"], "output_tok_s": s["output_throughput_tok_s"],
               "tpot_p50_s": s["tpot_p50_s"], "stage_bubble_ratio": s["stage_bubble_ratio"], "policy": ctrl.policy.name}
        bs = ctrl.kv.block_size
        batches = SteadyBatches(ctrl.kv)
        steps = {p: _time_point(ex, batches, p, repeats) for p in points}
        info = {"device": ex.settings.device, "dtype": ex.settings.resolved_dtype, "pp": P,
                "kv_num_blocks": ctrl.kv.num_blocks, "block_size": bs, "stages": ex.stage_info}
    finally:
        ex.shutdown()
    return e2e, steps, info


class SteadyBatches:
    """The grid's micro-batches in steady state, as a serving engine sees them: a decode point's
    sequences are made once, hold their blocks in the run's block manager and advance one token per
    launch (their tables are reused; a new block only when a sequence crosses a block boundary),
    so `step - forward` is the host's per-step cost, not the set-up of new sequences and tables.
    A prefill is a new sequence each time, as in serving."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self.next_seq = 20_000_000
        self.next_mb = 2_000_000
        self.live: list = []

    def decodes(self, batch: int, context: int) -> list:
        """`batch` sequences that hold `context - 1` tokens: the next token is at position context - 1."""
        from engine.core.request import Request, Sequence

        self.release()
        for _ in range(batch):
            self.next_seq += 1
            seq = Sequence(Request(self.next_seq, 0.0, context, 1 << 20))
            seq.num_computed = context - 1
            self.kv.allocate(seq.seq_id, context - 1)
            self.live.append(seq)
        return self.live

    def decode_step(self) -> MicroBatch:
        """The live sequences' next decode (committed as the controller commits one)."""
        self.kv.append_one_each([s.seq_id for s in self.live])
        return self._mb((), tuple(self.live))

    def advance(self, tokens) -> None:
        """The step completed: each sequence holds its new token (the next decode feeds it)."""
        for seq, tok in zip(self.live, tokens):
            seq.num_computed += 1
            seq.output_token_ids.append(tok)

    def prefill(self, tokens: int) -> MicroBatch:
        from engine.core.batch import PrefillChunk
        from engine.core.request import Request, Sequence

        self.release()
        self.next_seq += 1
        seq = Sequence(Request(self.next_seq, 0.0, tokens, 1))
        self.kv.allocate(seq.seq_id, tokens)
        self.live.append(seq)
        return self._mb((PrefillChunk(seq, 0, tokens, True),), ())

    def release(self) -> None:
        for seq in self.live:
            self.kv.free(seq.seq_id)
        self.live = []

    def _mb(self, prefills: tuple, decodes: tuple) -> MicroBatch:
        self.next_mb += 1
        return MicroBatch(self.next_mb, prefills, decodes)


def _time_point(ex, batches: SteadyBatches, p: Point, repeats: int) -> tuple[float, float]:
    """(median launch-to-tokens seconds, median summed stage forward seconds) of one point, after
    one untimed launch (first touch, lazy inits, the stages learning the tables)."""
    if p.kind == "decode":
        batches.decodes(p.batch, p.context)
    step, fwd = [], []
    for i in range(repeats + 1):
        mb = batches.decode_step() if p.kind == "decode" else batches.prefill(p.tokens)
        t = time.perf_counter()
        ex.launch(mb)
        done = ex.next_completion()
        dt = time.perf_counter() - t
        if p.kind == "decode":
            batches.advance(done.token_ids)
        if i:
            step.append(dt)
            fwd.append(sum(b - a for track, name, a, b, mb_id in ex.tracer.spans
                           if mb_id == mb.mb_id and name.startswith("forward")))
    batches.release()
    return statistics.median(step), statistics.median(fwd)


def _load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def print_tables(out: dict, console) -> None:
    from rich.table import Table

    info, e2e = out["info"], out["end_to_end"]
    console.print(f"[bold]testbed bench engine[/]: {info['model']} on {info['device']} ({info['dtype']}), "
                  f"P={info['pp']}, {info['kv_num_blocks']} KV blocks x {info['block_size']}, load {info['load_avg']}")
    e = Table(title=f"end to end: {e2e['num_finished']}/{e2e['num_requests']} requests, policy {e2e['policy']}")
    for col in ("total tok/s", "output tok/s", "TPOT p50 ms", "wall s", "bubble ratio per stage"):
        e.add_column(col, justify="right")
    e.add_row(f"{e2e['total_tok_s']:.1f}", f"{e2e['output_tok_s']:.1f}", f"{1e3 * e2e['tpot_p50_s']:.2f}",
              f"{e2e['wall_s']:.2f}", " ".join(f"{b:.3f}" for b in e2e["stage_bubble_ratio"]))
    console.print(e)
    for kind, title, keys in (("decode", "decode step", ("batch", "context")), ("prefill", "prefill", ("tokens",))):
        t = Table(title=f"{title} (step = launch to sampled ids; floor = linear + attention)")
        for col in keys + ("step ms", "forward ms", "floor ms", "linear ms", "attention ms", "x floor"):
            t.add_column(col, justify="right")
        for r in out["rows"]:
            if r["kind"] != kind:
                continue
            floor = r["linear_floor_s"] + r["attention_floor_s"]
            t.add_row(*(str(r[k]) for k in keys), f"{1e3 * r['step_s']:.2f}", f"{1e3 * r['forward_s']:.2f}",
                      f"{1e3 * floor:.3f}", f"{1e3 * r['linear_floor_s']:.3f}", f"{1e3 * r['attention_floor_s']:.3f}",
                      f"{r['x_floor']:.2f}")
        console.print(t)
    bw = out.get("attention_bandwidth")
    if bw is not None:
        console.print(f"copy rate: {bw['copy_Bps'] / 1e9:.1f} GB/s (one large copy_, bytes read + written)")
        if bw["note"]:
            console.print(f"attention bandwidth: skipped: {bw['note']}")
        else:
            t = Table(title="paged attention, one layer (K/V bytes read / kernel time)")
            for col in ("batch", "context", "kernel us", "GB/s", "of copy rate"):
                t.add_column(col, justify="right")
            for r in bw["rows"]:
                t.add_row(str(r["batch"]), str(r["context"]), f"{1e6 * r['kernel_s']:.1f}", f"{r['Bps'] / 1e9:.1f}",
                          f"{r['of_copy']:.2f}")
            console.print(t)
