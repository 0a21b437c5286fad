"""`calibrate runs --inflight-handover`: the CPU engine's blocking hand-over priced as a rendezvous
(`CostCoefficients.handover_rendezvous_s`, charged by engine/simulator/handover.py).

What is measured: on a host device (gloo), for every hop of a policy that is not structure-aware
where the sending stage reached its send before the next stage began the matching receive, the
time from the receive's start to the send's end (the sender's last span; stage spans of
engine/torch_exec/stage/worker.py). The term is their median: the sender is freed that long after
the receiver takes the activation. Set 6 (tiny-llama P=2, 2-core CPU): 0.28-0.38 ms per run for
MoLink, vLLM and gllm alike; the fit runs of cpu-tiny-llama-set6-pp2-runs give 0.30 ms. A
structure-aware policy's `isend` returns at once (SiPipe: the send ends before the receive
begins), so its hops are not samples; the simulator holds it by the same rule one send later.
Chosen, or not, on validation runs (the manifest's `inflight_handover` option).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.base.errors import ConfigError
from testbed.calibrate.runs import RealRun, replayed_batches


def rendezvous_samples(run: RealRun, structure_aware: bool) -> list[float]:
    """Seconds from the receive's start to the send's end, on the hops where the sender was first
    (none for a GPU run, P = 1 or a structure-aware run)."""
    if run.spec.settings.executor.settings.device != "cpu" or run.pp < 2 or structure_aware:
        return []
    out = []
    for b in replayed_batches(run):
        for st, nxt in zip(b.stages, b.stages[1:]):
            if None in (st.send_start, st.busy_end, nxt.recv_start) or st.send_start >= nxt.recv_start:
                continue
            out.append(st.busy_end - nxt.recv_start)
    return out


def fit_handover(runs: Sequence[RealRun], aware: Sequence[bool]) -> tuple[float, int] | None:
    """(the median rendezvous s, how many hops it rests on); None at P = 1 (no hop: nothing to price,
    the option then changes nothing); one ConfigError where P >= 2 runs have no such hop."""
    if all(run.pp < 2 for run in runs):
        return None
    samples = [x for run, a in zip(runs, aware) for x in rendezvous_samples(run, a)]
    if not samples:
        raise ConfigError("--inflight-handover prices the blocking send of a host run at P >= 2 with a policy "
                          "that is not structure-aware; none of the runs has such a hop")
    return max(0.0, float(np.median(samples))), len(samples)
