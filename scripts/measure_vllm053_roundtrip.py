"""Measure, on this machine, the gap vLLM 0.5.3's multiprocessing PP executor leaves on its last stage
between two steps: from the stage putting step j-1's result on its result queue to the stage
holding step j's request, as bytes read and as objects unpickled.

Why (vLLM 0.5.3, the version TD-Pipe built on; an unpacked wheel, `pip download vllm==0.5.3 --no-deps`):
- PP runs only through `AsyncLLMEngine` (`LLMEngine.step` raises, vllm/engine/llm_engine.py):
  `run_engine_loop` keeps one `engine_step(ve)` task per virtual engine (vllm/engine/async_llm_engine.py).
- `MultiprocessingGPUExecutorAsync._driver_execute_model_async` (vllm/executor/multiproc_gpu_executor.py)
  runs each stage's call under that stage's `asyncio.Lock` (`_run_task_with_lock`, vllm/utils.py), and
  the remote stage's request is put on its `mp.Queue` inside the lock
  (`ProcessWorkerWrapper.execute_method_async` -> `_enqueue_task`, vllm/executor/multiproc_worker_utils.py):
  step j reaches a stage only after step j-1's result came back from it to the driver
  (`ResultHandler.run` -> `loop.call_soon_threadsafe(future.set_result)`) and the lock passed on.
  The queue's feeder thread pickles the request in the driver process.
- The last stage returns only after sampling (its ids reach the CPU), so that round trip leaves its GPU
  idle; TD-Pipe's driver submits each step to every Ray worker when it schedules it
  (TD_Pipe/engine/llm_engine.py `LLMEngine.step`), so its last stage finds the next request queued.

What runs: a driver process with an asyncio loop, a result-handler thread and one `asyncio.Lock`, as
above, and one "last stage" process (fork, vLLM's default `VLLM_WORKER_MULTIPROC_METHOD`) that reads
each request, holds it `--stage-ms` (its GPU step: sleeps), and returns a small result. P virtual
engines, each looping: lock, send the request, await the result, then `--busy-us-per-seq` of CPU on the
event loop per sequence (its output processing and next schedule; 0 = an idle driver, the lower bound).
The requests are vLLM 0.5.3's own `ExecuteModelRequest` of decode `SequenceGroupMetadata` (imported
from the unpacked wheel). Times are `time.perf_counter` (CLOCK_MONOTONIC, one clock for both processes).
Reported per point: the median gap (result put -> request bytes read) and the unpickle time, and a
fit gap = fixed + per_seq x seqs + per_context_token x context tokens (NNLS).

    flock /work/notes/s5/measure.lock chrt -f 10 python scripts/measure_vllm053_roundtrip.py \
        --vllm-src /tmp/base46/vllm/0.5.3 --out engine/pricing/measured/vllm053_roundtrip.json
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import multiprocessing as mp
import os
import pickle
import random
import statistics
import sys
import threading
import time
from pathlib import Path

POINTS = ((64, 110, 140), (128, 110, 280), (256, 110, 140), (256, 110, 280), (256, 500, 500), (128, 500, 500))


def _request(n: int, prompt: int, out: int):
    from vllm.sampling_params import SamplingParams
    from vllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata

    rng = random.Random(n * 7919 + prompt * 31 + out)
    sp = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=3072)
    metas = []
    for i in range(n):
        d = SequenceData([rng.randrange(32000) for _ in range(prompt)])
        for _ in range(out):
            d.append_token_id(rng.randrange(32000), 0.0)
        metas.append(SequenceGroupMetadata(request_id=str(i), is_prompt=False, seq_data={i: d}, sampling_params=sp,
                                           block_tables={i: list(range((prompt + out) // 16 + 1))}))
    return ExecuteModelRequest(seq_group_metadata_list=metas, virtual_engine=0)


def _stage(task_q, result_q, stage_s: float, log_q) -> None:
    """The last stage: read a request's bytes (the time they are all here), unpickle, hold the GPU
    step, put a small result (a list of ids, as a SamplerOutput's few fields)."""
    log = []
    while True:
        buf = task_q._reader.recv_bytes()  # mp.Queue.get, split in its two steps
        t_read = time.perf_counter()
        task_id, method, args, _ = pickle.loads(buf)
        t_loaded = time.perf_counter()
        if method == "stop":
            break
        time.sleep(stage_s)
        t_put = time.perf_counter()
        result_q.put((task_id, [7] * len(args[0].seq_group_metadata_list)))
        log.append((t_read, t_loaded, t_put))
    log_q.put(log)


def _busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


async def _driver(req, ves: int, steps: int, busy_s: float, task_q, result_q) -> None:
    loop = asyncio.get_running_loop()
    futures: dict[int, asyncio.Future] = {}

    def handle() -> None:  # vLLM's ResultHandler thread
        while True:
            item = result_q.get()
            if item is None:
                return
            fut = futures.pop(item[0])
            loop.call_soon_threadsafe(fut.set_result, item[1])

    threading.Thread(target=handle, daemon=True).start()
    lock = asyncio.Lock()
    ids = iter(range(10 ** 9))

    async def call() -> list:
        fut = loop.create_future()
        tid = next(ids)
        futures[tid] = fut
        task_q.put((tid, "execute_model", (req,), {}))  # pickled by the queue's feeder thread
        return await fut

    async def engine(ve: int) -> None:
        for _ in range(steps):
            async with lock:
                await call()
            _busy(busy_s)  # this engine's output processing and next schedule, on the event loop

    await asyncio.gather(*(engine(v) for v in range(ves)))
    result_q.put(None)


def measure(n: int, prompt: int, out: int, args) -> dict:
    req = _request(n, prompt, out)
    ctx = mp.get_context("fork")
    task_q, result_q, log_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_stage, args=(task_q, result_q, args.stage_ms / 1e3, log_q), daemon=True)
    p.start()
    asyncio.run(_driver(req, args.ves, args.steps, args.busy_us_per_seq * 1e-6 * n, task_q, result_q))
    task_q.put((0, "stop", (), {}))
    log = log_q.get()
    p.join()
    gaps = [log[i][0] - log[i - 1][2] for i in range(args.ves + 1, len(log))]  # past the first round
    loads = [t_loaded - t_read for t_read, t_loaded, _ in log]
    return {"seqs": n, "prompt": prompt, "output": out, "context_tokens": n * (prompt + out),
            "request_bytes": len(pickle.dumps((0, "execute_model", (req,), {}))),
            "gap_s_median": statistics.median(gaps), "gap_s_p90": sorted(gaps)[int(0.9 * (len(gaps) - 1))],
            "unpickle_s_median": statistics.median(loads), "steps": len(gaps)}


def fit(points: list[dict]) -> dict:
    import numpy as np
    from scipy.optimize import nnls

    y = np.array([p["gap_s_median"] for p in points])
    a = np.array([[1.0, p["seqs"], p["context_tokens"]] for p in points]) / y[:, None]
    coef, _ = nnls(a, np.ones(len(points)))
    err = a @ coef - 1
    return {"fixed_s": coef[0], "per_seq_s": coef[1], "per_context_token_s": coef[2],
            "median_error": float(np.median(np.abs(err))), "max_error": float(np.max(np.abs(err)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", required=True, help="an unpacked vLLM 0.5.3 wheel (the folder holding vllm/)")
    ap.add_argument("--stubs", default=None, help="a folder of stub modules the wheel's imports need (sentencepiece)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ves", type=int, default=4, help="virtual engines (P)")
    ap.add_argument("--steps", type=int, default=12, help="steps per virtual engine")
    ap.add_argument("--stage-ms", type=float, default=20.0, help="the last stage's GPU step, held by sleeping")
    ap.add_argument("--busy-us-per-seq", type=float, default=0.0,
                    help="event-loop CPU per sequence after each step (output processing + next schedule); 0 = idle driver")
    args = ap.parse_args()
    out = Path(args.out)
    if not os.access(out.parent if out.parent.exists() else Path("."), os.W_OK):
        sys.exit(f"error: cannot write {out}")
    if not (Path(args.vllm_src) / "vllm" / "sequence.py").exists():
        sys.exit(f"error: --vllm-src={args.vllm_src} has no vllm/sequence.py (unpack the 0.5.3 wheel there)")
    for extra in filter(None, (args.stubs, args.vllm_src)):
        sys.path.insert(0, extra)
    load_before = os.getloadavg()
    points = [measure(n, pr, o, args) for n, pr, o in POINTS]
    rec = {"what": "vLLM 0.5.3 mp PP executor: last stage, result put -> next request's bytes read (async engine, "
                   "one asyncio.Lock per stage, mp.Queue both ways)",
           "vllm_commit": __import__("vllm.commit_id", fromlist=["x"]).__commit__,
           "command": " ".join(sys.argv), "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
           "cpu": _cpu(), "cores": os.cpu_count(), "python": sys.version.split()[0],
           "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "settings": {"ves": args.ves, "steps": args.steps, "stage_ms": args.stage_ms,
                        "busy_us_per_seq": args.busy_us_per_seq},
           "points": points, "fit": fit(points)}
    out.write_text(json.dumps(rec, indent=1) + "\n")
    for p in points:
        print(f"{p['seqs']:4d} x {p['prompt']}+{p['output']}: {p['request_bytes'] / 1e6:.2f} MB, gap "
              f"{p['gap_s_median'] * 1e3:.2f} ms (p90 {p['gap_s_p90'] * 1e3:.2f}), unpickle {p['unpickle_s_median'] * 1e3:.2f} ms")
    print("fit:", {k: f"{v:.3g}" for k, v in rec["fit"].items()})


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
