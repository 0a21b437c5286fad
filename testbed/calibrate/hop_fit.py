"""`calibrate runs --hop receive`: a host (gloo) stage-to-stage hop priced once, by the receive the
engine measured (issue 47, 2026-11-28).

How the CPU engine hops (engine/torch_exec/stage/worker.py `send_next` / `receive_hidden`): a
policy that is not structure-aware sends the metadata's size, the metadata, then the tensor; the
receiving stage's `recv` span holds all three messages. On the 2026-11-27 fit and diagnosis runs
(P=2, traced), from the send's start (or the receive's, whichever came later) to the receive's end:
0.47 ms median where the receiver was there first and 0.47 ms where the sender was (gllm ShareGPT
r1, decodes), 0.55 / 0.49 ms (gllm Azure 5 req/s r1), 0.87 / 0.59 ms (vLLM ShareGPT d1); SiPipe's
structure-aware receive (one message) 0.88 ms. So a hop costs what the receive costs, whoever waits,
and the metadata rounds are inside it.

The simulator prices a hop as the link busy for bytes / bandwidth (+ `transfer_metadata_s` unless
structure-aware), the data landing `p2p_latency_s` later, then the receiving stage's `recv_*`; and
the ids' return as `p2p_latency_s` + `return_fixed_s`. The default fit (`--hop link`) fits the link's
latency and bandwidth on the same spans the receive term is fitted on, keeps the metadata's 2 ms
default (SiPipe's GPU figure) and fits the return as the whole measured return. Where the receiver
waits, a non-structure-aware hop then costs about 0.6 + 0.6 + 2 ms where the engine took 0.5, and
every return 0.57 ms more than measured (P=2's fitted latency).

`--hop receive` prices each once: the link's latency, bandwidth and metadata are fitted only on
what the hops where the receiver waited took beyond the receive's fitted price (non-negative least
squares on 1, bytes, not-structure-aware; 0 where nothing is left: the receive holds it all), and
the return is the measured one less the latency the simulator adds before it. A hop where the
sender was first (the receiver busy) costs the receive in both. Chosen, or not, on validation runs.
"""
from __future__ import annotations

import numpy as np

HOP_MODES = ("link", "receive")
UNMEASURED_BW_GBS = 1e3  # no per-byte cost measured beyond the receive (run_fit's convention)


def fit_beyond_receive(waited: list[tuple[str, int, float, bool]], recv_fixed_s: float,
                       recv_per_byte_s: float) -> tuple[float, float, float]:
    """(latency s, s per byte, metadata s) of the hops where the receiver waited, beyond the receive
    (`waited`: kind, bytes, send start to receive end, structure-aware)."""
    from testbed.calibrate.fit import _nnls

    if not waited:
        return 0.0, 0.0, 0.0
    lat, per_byte, meta = _nnls(
        [[1.0] * len(waited), [float(b) for _, b, _, _ in waited], [0.0 if aware else 1.0 for *_, aware in waited]],
        [t - recv_fixed_s - recv_per_byte_s * b for _, b, t, _ in waited], relative=False)
    return lat, per_byte, meta


def price_hops_once(result, waited: list[tuple[str, int, float, bool]], ret: list[float], base_latency_s: float) -> float:
    """Set `result`'s link, `transfer_metadata_s` and `return_fixed_s` as the module docstring says;
    return the latency the simulator adds before each return (the CPU-sampling fit subtracts it too)."""
    c = result.coefficients
    if "recv_fixed_s" in c:  # a host run with hops: the link holds only what the receive does not
        lat, per_byte, meta = fit_beyond_receive(waited, c["recv_fixed_s"], c["recv_per_byte_s"])
        result.p2p_latency_s = lat
        result.p2p_bw_gbs = 1.0 / per_byte / 1e9 if per_byte > 0 else UNMEASURED_BW_GBS
        c["transfer_metadata_s"] = meta
    latency = result.p2p_latency_s if result.p2p_latency_s is not None else base_latency_s
    if ret:
        c["return_fixed_s"] = max(0.0, float(np.mean(ret)) - latency)
    return latency
