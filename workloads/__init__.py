"""Workloads: where requests come from (real traces, real prompts, or synthetic distributions).

Importing the package registers every workload in `WORKLOADS`; `build_workload` turns a name or
a flat config dict into a list of `engine.core.request.Request`, sorted by arrival with ids 0..n-1.
"""
from workloads.base import WORKLOADS, WorkloadSpec, build_workload, workload_config
from workloads import azure, sharegpt, synthetic  # noqa: F401  (register themselves)
from workloads.azure import AzureConfig
from workloads.data import resolve_data_file
from workloads.sharegpt import ShareGPTConfig
from workloads.synthetic import SyntheticConfig

__all__ = ["WORKLOADS", "WorkloadSpec", "build_workload", "workload_config", "resolve_data_file",
           "AzureConfig", "ShareGPTConfig", "SyntheticConfig"]
