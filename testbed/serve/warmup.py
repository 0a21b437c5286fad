"""Warm-up before `testbed serve` listens, so that /health answers only once the first real
request is as fast as the later ones (the first benchmark after start was slower: first-touch
allocations, lazy initialisation in torch and in the stages).

A few requests of mixed prompt lengths go through the same engine thread and policy as any
client's, concurrently (prefill and decode micro-batches of several shapes); then the
controller forgets them (`Controller.reset_statistics`), so the run's summary, requests.csv and
metrics hold client requests only. `serve.warmup_requests=0` skips it; the simulator never needs it.
"""
from __future__ import annotations

import asyncio

from engine.core.request import SamplingParams
from testbed.serve.engine_loop import EngineLoop
from testbed.serve.protocol import GenerateSpec

PROMPT_LENS = (16, 64, 256, 32)  # cycled over the warm-up requests
MAX_TOKENS = 8
FIRST_ID = 3  # ids 0-2 are the usual special tokens


def warm_up(engine: EngineLoop, num_requests: int, vocab_size: int, max_total: int) -> None:
    """Serve `num_requests` requests to the end, then forget them; raises if the engine fails."""
    if num_requests < 1:
        return
    specs = []
    for i in range(num_requests):
        n = max(1, min(PROMPT_LENS[i % len(PROMPT_LENS)], max_total - MAX_TOKENS))
        ids = tuple(FIRST_ID + (7 * i + k) % max(1, vocab_size - FIRST_ID) for k in range(n))
        specs.append(GenerateSpec(ids, min(MAX_TOKENS, max(1, max_total - n)), SamplingParams(), ignore_eos=True))
    asyncio.run(_serve_all(engine, specs))
    if engine.dead is not None:
        raise RuntimeError(f"the engine failed during warm-up: {engine.dead}")
    engine.reset_statistics()


async def _serve_all(engine: EngineLoop, specs: list[GenerateSpec]) -> None:
    loop = asyncio.get_running_loop()
    gens = [engine.submit(spec, loop) for spec in specs]

    async def until_end(gen) -> None:
        while (await gen.queue.get())[0] != "end":
            pass

    await asyncio.gather(*(until_end(g) for g in gens))
