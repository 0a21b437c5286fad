"""A real run replayed in the simulator: its requests, its settings, another hardware profile.

Used by `testbed validate --runs` (testbed/calibrate/offline.py, split_validate.py) and by the prediction
over a spread of machine speeds (spread_sim.py); below both, so that neither imports the other.
"""
from __future__ import annotations

from pathlib import Path

from engine.base.errors import ConfigError
from testbed.calibrate.runs import RealRun, kv_num_blocks
from testbed.calibrate.shared_device import shared_devices


def simulate_run(run: RealRun, hardware: str, out_dir: Path | None = None, compute_scale: float = 1.0):
    """The simulator on `run`'s requests with its settings (policy, workload, seed, P, KV pool)
    and `hardware` instead of the engine (its forward prices times `compute_scale`); the RunResult."""
    from testbed.config.composer import hardware_node
    from testbed.run.outputs import write_run_dir
    from testbed.run.runner import prepare_experiment

    node = hardware_node(hardware)
    rc = run.spec.settings
    blocking = rc.executor.settings.device == "cpu"  # gloo's blocking send (SimSettings.blocking_send)
    samplers = rc.executor.settings.num_cpu_samplers  # SiPipe's pool as the engine ran it (the sim's default is 4)
    # stages that shared a GPU take turns on it, where the profile priced their own work (shared_device.py)
    devices = shared_devices(run) if (node.get("calibration") or {}).get("shared_device_fit") else 0
    values = {"executor": {"name": "sim", "blocking_send": blocking, "host_device": blocking,
                           "num_cpu_samplers": samplers, "compute_scale": compute_scale, "devices": devices},
              "hardware": node,
              "kv.num_blocks": kv_num_blocks(run), "output.mlflow": False,
              "output.plots": False, "output.progress": False, "output.trace": "off"}
    spec = run.spec.with_values(values)
    # the policy plans with the cost model the engine's policy had (the run's own hardware)
    res = prepare_experiment(spec, requests=list(run.requests), planning=run.spec).run()
    if res.error:
        raise ConfigError(f"the simulated replay of {run.path} failed: {res.error}")
    if out_dir is not None:
        write_run_dir(res, out_dir, plots=False)
    return res
