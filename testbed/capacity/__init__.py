"""`testbed capacity`: the highest request rate each grid point sustains under an SLO criterion,
in the simulator or against a live OpenAI-compatible endpoint. Modules: settings (`capacity.*`),
search (bracketing + bisection, pure), command (plan, trace windows, the sweep feed, the command),
steady (probe length, the steady-state check, one request alone), budget (a configuration search
within a GPU budget), results (tables with median and range, ranking, JSON, MLflow), figure
(capacity.png), live (`--base-url`: `testbed bench serve` as the probe, the host checks)."""
from testbed.capacity.command import cli_capacity, plan, run_capacity
from testbed.capacity.search import Outcome, Probe, RateSearch
from testbed.capacity.settings import CapacitySettings

__all__ = ["CapacitySettings", "Outcome", "Probe", "RateSearch", "cli_capacity", "plan", "run_capacity"]
