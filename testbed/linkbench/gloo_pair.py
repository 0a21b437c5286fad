"""One end of a measured transfer series: torch.distributed gloo point-to-point, as the engine's stages send.

`python -m testbed.linkbench.gloo_pair RANK MASTER_ADDR PORT PLAN_JSON` in each endpoint namespace
(rank 0 sends, rank 1 receives). PLAN_JSON is a list of transfers `{"n": bytes, "msgs": 3|1,
"gap": seconds}`. A 3-message transfer is the engine's plain data path when the receiver is not
structure-aware (engine/torch_exec/stage/worker.py `send_next` / `receive_hidden`): the metadata's size
(one int64), the metadata blob (`META_BYTES`), then the activation; a 1-message transfer is the
activation alone (structure-aware). The sender sleeps `gap` before each transfer (the link idles;
the receiver has long posted its first receive, as a stage waiting for input has), stamps
CLOCK_MONOTONIC and sends; the receiver stamps when the last message is in and answers with a
one-byte acknowledgement that the sender waits for before its next gap (gloo's send returns once
the data is in the socket buffer: without it the next transfer would queue behind this one's bytes). Both print one JSON
line of stamps; CLOCK_MONOTONIC is shared by the namespaces of one machine, so `recv - send` is the
transfer's time.
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

META_BYTES = 96
# The endpoints run SCHED_FIFO: they block on the link most of the time, and on a loaded machine a
# sender or receiver waiting for a CPU shows up as link time (seen: 8 KB in 30-64 ms at load 14).
RT_PRIORITY = 20  # an authenticated TensorMeta blob of a 2-D activation (wire/messages.py), about this size


def run(rank: int, master: str, port: int, plan: list[dict]) -> list[float]:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    biggest = max(p["n"] for p in plan)
    payload = torch.zeros(biggest, dtype=torch.uint8)
    size = torch.tensor([META_BYTES], dtype=torch.long)
    meta = torch.zeros(META_BYTES, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    stamps = []
    dist.barrier()
    for p in plan:
        n, msgs = int(p["n"]), int(p["msgs"])
        if rank == 0:
            time.sleep(float(p["gap"]))
            stamps.append(time.monotonic())
            if msgs == 3:
                dist.send(size, dst=1)
                dist.send(meta, dst=1)
            dist.isend(payload[:n], dst=1).wait()
            dist.recv(ack, src=1)
        else:
            if msgs == 3:
                dist.recv(size, src=0)
                dist.recv(meta, src=0)
            dist.recv(payload[:n], src=0)
            stamps.append(time.monotonic())
            dist.send(ack, dst=0)
    dist.barrier()
    dist.destroy_process_group()
    return stamps


def main(argv: list[str]) -> int:
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
    except OSError:
        pass
    rank, master, port = int(argv[0]), argv[1], int(argv[2])
    plan = json.loads(argv[3])
    os.environ["GLOO_SOCKET_IFNAME"] = "va" if rank == 0 else "vb"
    print(json.dumps(run(rank, master, port, plan)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
