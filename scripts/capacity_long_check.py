"""Plain long runs at the capacities a `testbed capacity` search reported (issue 45's check).

    python scripts/capacity_long_check.py runs/capacity/<experiment> [--winner] [--starts 0,600,1800]

Exit 0 when every point holds (>= 0.78 attainment from each start, below the target at 1.15x),
1 when one does not, 2 on bad input. See testbed/capacity/long_check.py.
"""
import sys

from testbed.capacity.long_check import main

if __name__ == "__main__":
    sys.exit(main())
