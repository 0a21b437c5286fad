"""Stages that share one device take turns on it (`executor.devices` below P).

The torch engine places stage s on cuda:(s mod visible GPUs) (engine/torch_exec/shared/placement.py):
with P=2 on one GPU both stages' kernels go to the same device. Measured on the H200 (set G1,
qwen2.5-7b, gllm, ShareGPT 100 offline, docs/measurements/gpu-h200-2026-11-28.md): the two stages'
forwards overlapped for 2.10 s of their 2.53 / 2.85 s busy, and a half-model decode forward took
8.3-9.0 ms where the whole model alone took 13.4 ms: each stage ran slower because the other ran
too. The simulator gave every stage its own device, and predicted TTFT 23-41% short on those runs.

Modelled here as a reservation: a stage's device part (its forward and what follows it on the
stage: sampling, the logits' hand-off) starts when its input work is done and the device is free
of the other stages' device parts, in the order the stages asked; its host part (input preparation,
a receive) still overlaps them. The forward prices must then be a stage's own work on the device,
not the stretched time it measured while sharing: `testbed calibrate runs --shared-gpu` fits them
so (testbed/calibrate/shared_device.py). Turns, not a processor shared at 1/n each: the same total
device time, the whole device to one forward at a time. Checked on G1's P=2 fit and validation runs:
the engine served 10-14% less than this model (the real sharing loses time turns do not), and the
runs' TTFT gap stayed (-26% / -24%): a first-order model, not fitted to the loss.
"""
from __future__ import annotations

from collections.abc import Sequence

from engine.core.trace import Tracer


def device_map(pp: int, devices: int) -> tuple[int, ...] | None:
    """Each stage's device (stage s on s mod `devices`, as the engine places them); None when
    every stage has its own (`devices` 0 or at least P)."""
    if devices <= 0 or devices >= pp:
        return None
    return tuple(s % devices for s in range(pp))


class SharedDevices:
    """When each device is next free of the stages placed on it (`device_map`)."""

    __slots__ = ("device_of", "free_at")

    def __init__(self, device_of: tuple[int, ...]) -> None:
        self.device_of = device_of
        self.free_at = [0.0] * (max(device_of) + 1)

    def chain(self, tracer: Tracer, track: str, stage: int, now: float,
              parts: Sequence[tuple[str, float]], device_from: int, mb_id: int) -> float:
        """Trace `parts` from `now` on `track`, the ones from index `device_from` on (the device
        part) no earlier than the device is free; returns the end and holds the device until it."""
        host, device = tuple(parts[:device_from]), tuple(parts[device_from:])
        start = now
        for _, d in host:
            start += d
        dev = self.device_of[stage]
        if self.free_at[dev] > start:
            if host:
                tracer.chain(track, now, host, mb_id)
            end = tracer.chain(track, self.free_at[dev], device, mb_id)  # the gap before it: idle
        else:
            end = tracer.chain(track, now, parts, mb_id)
        self.free_at[dev] = end
        return end
