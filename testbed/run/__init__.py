"""`testbed run`: the command (command), one experiment built and run from a RunSpec (runner), its
in-memory result (result), the run folder it leaves (outputs) and its figures (plots)."""

# The figure renderer `testbed run`'s background process calls, handed down to it by name
# (testbed/tracking/background.py imports nothing of this folder); importing this package is free.
FIGURES = "testbed.run.plots:render_plots"
