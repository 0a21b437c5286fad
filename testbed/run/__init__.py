"""`testbed run`: the command (command), one experiment built and run from a RunSpec (runner), its
in-memory result (result), the run folder it leaves (outputs) and its figures (plots)."""
