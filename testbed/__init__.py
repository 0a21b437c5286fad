"""The testbed's commands (CLI, tracking, tuning, sweeps).

MLflow's telemetry is off in every process of the project (this package is imported first by each,
and its children inherit the environment): its thread cannot reach the internet from a lab's hosts,
and once in 41 commands of the multi-host probes it removed an environment variable while another
thread read them, a `KeyError` traceback and a run left RUNNING (issue 48 item 6). MLflow reads
`MLFLOW_DISABLE_TELEMETRY` (mlflow/telemetry/utils.py, 3.17)."""
import os as _os

_os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
