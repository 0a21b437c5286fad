"""`executor=torch`: the real pipeline-parallel engine (one process per stage, real models).

Importing this package registers the executor and imports no torch (the settings and the
factory are torch-free; stages import torch in their own processes).

Architecture
------------
    driver process: Controller + Policy + TorchExecutor (engine/torch_exec/driver/executor.py)
        | ZeroMQ ROUTER (engine/torch_exec/driver/control.py) <-> one DEALER per stage: typed,
        | authenticated messages (wire/messages.py): micro-batch metadata out (the same to every stage),
        | sampled token ids and per-stage spans back, errors with tracebacks back
    stage 0 --torch.distributed send/recv (gloo on CPU, NCCL on GPUs)--> stage 1 --> ... stage P-1
        each stage process (engine/torch_exec/stage/worker.py) holds its slice of decoder layers
        (engine/torch_exec/stage/model.py; stage 0 the embedding, the last the final norm, lm_head and
        sampler) and a paged KV pool per layer indexed by the controller's block tables.

Layout: by process, so that a module's folder says where it runs
    driver/    the controller's process: TorchExecutor, its start-up, control socket, failure
               diagnosis, the stage processes' start, profiling
    stage/     each stage process (and its CPU samplers): the worker loop and set-up, the model slice,
               paced links, sampling, rendezvous, orphan and driver watches; never imports driver/
    wire/      what both speak: typed authenticated messages, the socketpair lane, block-table deltas,
               socket addresses; imports neither side
    shared/    what both compute: KV pool sizing, device placement, span timers
    weights/   checkpoints and the random-weight tokenizer; imports neither side
    tensors/ kernels/ graphs/   a stage's arrays, Triton kernels and CUDA graphs
    settings.py  the executor.* keys (torch-free; the config layer builds them for every run)
tests/test_architecture.py checks these directions.

Clock: spans are taken with `time.perf_counter()` in every process. On one Linux machine that is
CLOCK_MONOTONIC for all processes, so the driver only subtracts its run start; for stages on
another host it estimates the offset from the fastest of five ping round trips at start-up.

Multi-machine runs (torchrun-style rendezvous)
-----------------------------------------------
Set `executor.launch=external`, fixed ports and reachable addresses, the same run secret on every
host, and start the stages by hand:

    export TESTBED_STAGE_SECRET=$(python -c "import secrets; print(secrets.token_hex(32))")  # share it
    # driver host (runs the controller; binds the control socket on every interface)
    testbed run executor=torch executor.launch=external executor.zmq_host=0.0.0.0 \
        executor.zmq_port=5555 executor.master_addr=<stage-0 host> executor.master_port=29500 ...
    # on each stage host s = 0..P-1 (the same checkpoint path must exist on every host)
    python -m engine.torch_exec.stage.worker --driver tcp://<driver host>:5555 --stage <s>

(`TESTBED_STAGE_SECRET_FILE=<file holding the hex>` works too.) `master_addr`/`master_port` play
MASTER_ADDR/MASTER_PORT's role: stage 0 hosts the torch.distributed TCP store there, bound to that
address only, and the other stages join it. Every control message is a typed msgpack frame
authenticated with an HMAC of the run secret (engine/torch_exec/wire/messages.py), checked before it is
parsed; frames without it are dropped and counted, so a port scanner or a stray client cannot
run code or break the run. Binding a socket off loopback logs a warning naming its port. The
driver cannot watch external processes, so a dead external stage is reported by the
`stage_timeout_s` hang check (with the stage named), and external stages do not notice a dead
driver until their next message (end them by hand). With the default `launch=spawn` the driver
starts the P stages on this machine (torch.multiprocessing, spawn; the secret is a spawn
argument), binds everything to 127.0.0.1 and picks free ports; the stages and their CPU samplers
end when the driver dies, even by SIGKILL (engine/torch_exec/stage/orphan.py).

See `TorchSettings` (engine/torch_exec/settings.py) for every `executor.*` key.
"""
from __future__ import annotations

from engine.core.executor import EXECUTORS, ExecutorBuild, ExecutorSpec
from engine.torch_exec.settings import TorchSettings


def _make_torch(settings: TorchSettings, build: ExecutorBuild):
    from engine.torch_exec.driver.executor import make_torch_executor

    return make_torch_executor(settings, build)


if "torch" not in EXECUTORS:
    EXECUTORS.add("torch", ExecutorSpec(TorchSettings, _make_torch))

__all__ = ["TorchSettings"]
