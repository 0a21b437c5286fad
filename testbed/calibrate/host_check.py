"""Did the runs a profile is checked against run on the machine its fit runs ran on? (`validate --runs`)

A CPU profile describes the machine of its fit runs: set 9's profile held 35 of 36 rows on the machine it
was fitted on and 13 of 36 on the next session's machine, where the same engine ran 3-13% slower
(testbed/run/host_probe.py). Each real run records its host (`host` in run_info.json: CPU model,
logical CPUs, the median of a fixed one-thread GEMM); this compares the fit runs' with every other
set's and says so when the CPU model differs or the probe's median moved by more than PROBE_TOLERANCE.
Runs taken before the probe existed record none: the check then says it cannot tell. On a GPU the probe
says only how fast the host was (its prepare, sample and dispatch work), not the device: the H200 machine's
host (16 cores, sandboxed) scattered 1.59-2.42 ms over set G1's 23 runs in 13 minutes, so there a move is
reported as the host's, not as another machine.
"""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path

from testbed.calibrate.run_checks import run_info
from testbed.calibrate.shared_device import stage_gpus

# The probe's own scatter on one machine: 1.96-2.12 ms over eight probes on the shared 2-core machine
# at load ~3 (2026-11-28), i.e. within +-4% of its median; a move beyond 5% is the machine, not the probe.
PROBE_TOLERANCE = 0.05


def run_host(run_dir: Path) -> dict | None:
    """The `host` a real run recorded (None: taken before the probe, or no run_info.json)."""
    return _host_of(run_info(run_dir))


def _host_of(info: dict) -> dict | None:
    host = info.get("host")
    return host if isinstance(host, dict) and isinstance(host.get("gemm_probe_ms"), (int, float)) else None


def _shares_a_gpu(gpus: list[str]) -> bool:
    return len(gpus) != len(set(gpus))


def _describe(hosts: Sequence[dict]) -> tuple[str, float]:
    models = sorted({str(h.get("cpu_model", "unknown")) for h in hosts})
    probe = statistics.median(float(h["gemm_probe_ms"]) for h in hosts)
    return " / ".join(models), probe


def host_report(runs_by_set: dict[str, Iterable[Path]]) -> str:
    """One line per set other than `fit`, comparing its hosts with the fit runs' (module docstring),
    and one naming the runs whose stages shared a GPU (parallel.pp above the GPUs visible:
    engine/torch_exec/shared/placement.py). Each run_info.json is read once."""
    infos = {name: [(p, run_info(p)) for p in paths] for name, paths in runs_by_set.items()}
    hosts = {name: [_host_of(info) for _, info in runs] for name, runs in infos.items()}
    gpu = any(stage_gpus(info) for runs in infos.values() for _, info in runs)
    lines = _host_lines(hosts, gpu)
    shared = sorted(p.name for runs in infos.values() for p, info in runs if _shares_a_gpu(stage_gpus(info)))
    if shared:
        lines.append(f"  {len(shared)} run(s) had stages sharing one GPU ({', '.join(shared[:3])}"
                     f"{', ...' if len(shared) > 3 else ''}): their forwards took turns on it; the simulator "
                     "prices each stage on its own device unless the profile was fitted with `calibrate runs --shared-gpu`")
    return "\n".join(lines)


def _host_lines(hosts: dict[str, list[dict | None]], gpu: bool) -> list[str]:
    fit = [h for h in hosts.get("fit", []) if h]
    if not fit:
        return ["host: the fit runs record no host probe (taken before testbed/run/host_probe.py): "
                "whether the checked runs ran on the same machine is unknown"]
    fit_model, fit_probe = _describe(fit)
    lines = [f"host: fit runs on {fit_model}, GEMM probe {fit_probe:.3f} ms (median of {len(fit)} runs)"]
    for name, found in hosts.items():
        if name == "fit":
            continue
        known = [h for h in found if h]
        if not known:
            lines.append(f"  {name} runs: no host probe recorded (taken before the probe): cannot tell")
            continue
        model, probe = _describe(known)
        moved = probe / fit_probe - 1.0
        same = model == fit_model and abs(moved) <= PROBE_TOLERANCE
        verdict = "same machine by the probe" if same else (
            "the host ran at another speed (GPU runs: its host work, prepare / sample / dispatch, may be priced "
            "off; the probe does not measure the GPU)" if gpu and model == fit_model else
            "ANOTHER MACHINE or machine state: a CPU profile describes its fit runs' machine; refit on runs "
            "of this one (testbed calibrate runs)")
        lines.append(f"  {name} runs on {model}, probe {probe:.3f} ms ({moved:+.1%} against the fit runs): {verdict}")
    return lines
