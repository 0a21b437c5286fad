"""Where stage processes come from (`executor.start_method`): by default, forked from a server
that has imported torch once.

Spawning a stage process from scratch imports torch in it: about 1.7 s of CPU per stage on the
2-core CI machine (`python -c "import torch"`: 1.45 s user + 0.25 s sys), paid again by every run
and every stage. multiprocessing's fork server is started once per driver process with torch and
the stage module imported, and forks each stage from that warm copy. It is as safe as spawn
for CUDA: the server imports torch but never touches a device, so no CUDA context exists before
the fork (each stage initialises its own GPU, as a spawned one does).

A forked stage inherits the server's state, fixed when the server started, and none of the
driver's: its environment is the one the driver had when its first run started the server
(`OMP_WAIT_POLICY=PASSIVE`, which the OpenMP runtime reads when torch loads it, and glibc's
malloc settings, `MALLOC_ENV`, are set for that moment). The stage's parent is the server, not
the driver; the server exits when the driver dies (EOF on its pipe from the driver), and a stage
dies with the server or when the driver's pid is gone (engine/torch_exec/stage/orphan.py).
`executor.start_method=spawn` starts each stage from scratch.
"""
from __future__ import annotations

import os
from typing import Any

# imported once in the server; each stage forked from it starts with them loaded
PRELOAD = ["torch", "torch.distributed", "zmq", "engine.torch_exec.stage.worker", "engine.torch_exec.stage.model"]
# Passive OpenMP waits: spinning threads of P stages (plus the driver) on few cores starve each
# other (see testbed/bench/engine.py). The user's own value, if set, is kept.
# glibc malloc keeps what a stage frees (read by glibc as the process starts: a spawned stage or
# the fork server): by default large tensors (the gathered KV of a decode, a prefill's scores) are
# mmap'd and unmapped per use and the heap's free top is trimmed, so stretches of steps re-fault
# their memory page by page. On CPU (tiny-llama, P=1 Azure 6 req/s, 2 cores) such decodes took
# 12-16k minor faults (about 1 us each) and 2.25x their usual time; a run's decodes 80k-1.27M
# faults, with these settings 1.4-1.7k, mean TPOT 57.4/28.2/32.7 -> 25.9/26.1/27.5 ms
# (docs/measurements/decode-episodes-2026-11-28b.md). The stage's heap stays at its peak.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967295", "MALLOC_TOP_PAD_": "67108864"}
STAGE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", **MALLOC_ENV}


def stage_context(method: str) -> Any:
    """The multiprocessing context that starts stage processes (`method`: one of START_METHODS,
    checked by TorchSettings)."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_stage(method: str, driver_addr: str, stage: int, secret: bytes, run_id: str, lane=None) -> Any:
    """Start stage `stage` of this driver's run (a daemon: it ends with the driver's process);
    the started `Process`. `lane`: the child's end of its socketpair to the driver (wire/lane.py)."""
    from engine.torch_exec.stage.worker import stage_main

    ctx = stage_context(method)
    saved = {k: os.environ.get(k) for k in STAGE_ENV}
    for k, v in STAGE_ENV.items():  # copied by a spawned stage, or by the fork server as it starts
        os.environ.setdefault(k, v)
    try:
        p = ctx.Process(target=stage_main, args=(driver_addr, stage, os.getpid(), secret, run_id, lane),
                        name=f"pp-stage{stage}", daemon=True)
        p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
    return p
