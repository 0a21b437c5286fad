"""`testbed capacity`: the highest request rate each grid point sustains under an SLO criterion,
in the simulator or against a live OpenAI-compatible endpoint. Modules: settings (`capacity.*`),
search (bracketing + bisection, pure), command (plan, the sweep feed, the command), results
(tables, ranking, JSON, MLflow), figure (capacity.png), live (`--base-url`: `testbed bench serve`
as the probe)."""
from testbed.capacity.command import cli_capacity, plan, run_capacity
from testbed.capacity.search import Outcome, Probe, RateSearch
from testbed.capacity.settings import CapacitySettings

__all__ = ["CapacitySettings", "Outcome", "Probe", "RateSearch", "cli_capacity", "plan", "run_capacity"]
