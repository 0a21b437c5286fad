"""`calibrate runs --shared-gpu`: a stage's own work on a GPU its stages shared.

With P stages on fewer GPUs (engine/torch_exec/shared/placement.py) the stages' forwards overlap on
one device and each is stretched by the others: on the H200 (set G1, qwen2.5-7b, gllm P=2, ShareGPT
100) the two stages' forwards overlapped for 2.10 of their 2.53 / 2.85 s, a half-model decode
forward measured 8.3-9.0 ms. Fitted as measured, a profile prices that stretch into every forward,
also where the other stage was idle (a request's first prefill), and the simulator, which gave each
stage its own device, predicted TTFT 23-41% short.

This fit takes each forward's own work instead: while n forwards of one device overlap, each is
credited 1/n of the elapsed time (equal sharing: the device's time-slicing between the stages'
contexts), so the works of a device sum to the time it was busy. The simulator then lets the stages
take turns on the device (`executor.devices`, engine/simulator/shared_device.py), and a replay of
such a run does so when its profile was fitted this way (`shared_device_fit` = 1, replay_sim.py).
Runs whose stages each had a GPU (or whose run_info.json does not say) are fitted as measured.
"""
from __future__ import annotations

from collections.abc import Mapping

from engine.base.errors import ConfigError
from testbed.calibrate.run_checks import run_info


def stage_gpus(info: Mapping) -> list[str]:
    """The CUDA devices a run's stages ran on, one entry per stage (`stages` in run_info.json)."""
    stages = info.get("stages")
    devices = [str(s.get("device", "")) for s in stages if isinstance(s, dict)] if isinstance(stages, list) else []
    return [d for d in devices if d.startswith("cuda")]


def stage_devices(run) -> list[str]:
    """The device each stage of `run` ran on ([] when run_info.json does not say it for every stage)."""
    devices = stage_gpus(run_info(run.path))
    return devices if len(devices) == run.pp else []


def shared_devices(run) -> int:
    """How many GPUs `run`'s stages shared (fewer than P), else 0 (each had its own, or unknown)."""
    n = len(set(stage_devices(run)))
    return n if 0 < n < run.pp else 0


def own_work(spans: Mapping[tuple[int, int], Mapping[str, tuple[float, float]]],
             device_of: Mapping[int, str]) -> dict[tuple[int, int], float]:
    """(mb, stage) -> the forward's own work in seconds: its span, each instant divided by the
    number of forwards of its device running then (a sweep over the spans' ends)."""
    events: dict[str, list[tuple[float, int, tuple[int, int]]]] = {}
    for key, named in spans.items():
        if "forward" in named:
            start, dur = named["forward"]
            dev = device_of[key[1]]
            events.setdefault(dev, []).extend(((start, 1, key), (start + dur, -1, key)))
    work: dict[tuple[int, int], float] = {}
    for evs in events.values():
        evs.sort(key=lambda e: (e[0], e[1]))  # at one instant an end before a start
        running: set[tuple[int, int]] = set()
        last = evs[0][0]
        for t, kind, key in evs:
            if running and t > last:
                share = (t - last) / len(running)
                for k in running:
                    work[k] = work.get(k, 0.0) + share
            last = t
            if kind > 0:
                running.add(key)
            else:
                running.discard(key)
    for key, named in spans.items():
        if "forward" in named:
            work.setdefault(key, 0.0)
    return work


def check_some_shared(runs) -> None:
    """`--shared-gpu` with no run whose stages shared a GPU fits nothing new: refused."""
    if not any(shared_devices(r) for r in runs):
        raise ConfigError("--shared-gpu: none of the runs had stages sharing a GPU (run_info.json `stages`: "
                          "each stage on its own device, or not recorded); fit without it")
