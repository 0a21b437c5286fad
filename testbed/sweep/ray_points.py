"""Sweep points as Ray tasks: the sweep's own task and failure row, handed down to the cluster's
pool (testbed/cluster/ray_tasks.py), which runs whatever it is given and imports nothing above it."""
from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

from testbed.cluster.ray_backend import SweepBackend
from testbed.cluster.ray_tasks import RayPool, on_this_node, remote_pool
from testbed.sweep.jobs import failed_row, run_point


def run_point_on_ray(job: Any) -> dict:
    """`sweep.run_point` in a Ray worker; its MLflow run is tagged with where it ran
    (`testbed.ray_node`: the node id, `testbed.worker`: host:pid), to trace a point to a node.
    Its requests came with the job (resolved on the driver), so the node needs no workload files."""
    import ray

    requests = ray.get(job.requests) if isinstance(job.requests, ray.ObjectRef) else job.requests
    here = {"testbed.backend": "ray", "testbed.ray_node": ray.get_runtime_context().get_node_id(),
            "testbed.worker": f"{socket.gethostname()}:{os.getpid()}"}
    return run_point(dataclasses.replace(job, spec=on_this_node(job.spec), requests=requests,
                                         tags={**job.tags, **here}))


def ray_pool(backend: SweepBackend | None) -> Callable[[Sequence[Any]], RayPool] | None:
    """`sweep.run_jobs`'s pool for sweep.backend=ray (None: the local workers)."""
    return remote_pool(backend, run_point_on_ray, failed_row)
