"""`testbed capacity`: the highest request rate each grid point sustains under an SLO criterion,
in the simulator or against a live OpenAI-compatible endpoint. Modules: settings (`capacity.*`),
search (bracketing + bisection of one window, pure), cover (a point's windows and the confirmation
of their lowest capacity, pure), windows (where trace windows and held-out stretches lie), planning
(the points and their windows, settled before any probe), command (the sweep feed, the command), steady (probe length, the steady-state check, one request
alone), budget (a configuration search within a GPU budget), results (tables, ranking, JSON, MLflow),
estimate (the time before the first probe), figure (capacity.png), live (`--base-url`: `testbed
bench serve` as the probe, the host checks), long_check (plain long runs at the answers)."""
from testbed.capacity.command import cli_capacity, run_capacity
from testbed.capacity.planning import plan
from testbed.capacity.search import Outcome, Probe, RateSearch
from testbed.capacity.settings import CapacitySettings

__all__ = ["CapacitySettings", "Outcome", "Probe", "RateSearch", "cli_capacity", "plan", "run_capacity"]
