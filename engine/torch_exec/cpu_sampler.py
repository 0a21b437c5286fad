"""SiPipe's CPU sampler pool (runtime.cpu_sampling): processes beside the last stage.

The last stage puts each micro-batch's logits on every sampler's torch.multiprocessing queue (the
tensor's storage moves to shared memory; only a handle crosses the queue) together with the row
keys and the prefill tokens the penalty state needs. Sampler k owns the rows of sequences with
seq_id % n == k, so each sequence's penalty state lives in exactly one process and is updated in
place there (engine/torch_exec/sampling.py `Sampler`). Each sampler returns its token ids straight
to the driver over its own ZeroMQ DEALER (`sampled`), the driver merges the n parts.
"""
from __future__ import annotations

import os
import pickle
import signal


def sampler_main(driver_addr: str, k: int, n: int, cfg: dict, queue) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch
    import zmq

    from engine.torch_exec.sampling import Sampler

    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"sampler{k}-{os.getpid()}".encode())
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(driver_addr)
    s = Sampler(cfg["vocab"], **cfg["sampler"])
    import time
    try:
        while True:
            item = queue.get()
            if item is None:
                break
            mb_id, logits, keys, prefills = item[:4]
            if len(item) > 4:  # served requests' own sampling
                s.set_params(item[4])
            t0 = time.perf_counter()
            for sid, start, toks in prefills:
                if sid % n == k:
                    s.observe_prefill(sid, start, toks)
            rows = [i for i, (sid, _) in enumerate(keys) if sid % n == k]
            mine = s.sample(logits[rows], [keys[i] for i in rows]) if rows else []
            t1 = time.perf_counter()
            sock.send(pickle.dumps(("sampled", k, mb_id, n, rows, mine, (t0, t1))))
    finally:
        sock.close()
        ctx.term()
