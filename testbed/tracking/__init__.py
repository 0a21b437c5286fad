"""MLflow: the in-process tracker of compare, tune, capacity and validate (tracker) and the
background processes that log and draw while `testbed run` simulates (background)."""
