"""Study files of `testbed reproduce` (one YAML file per study; see testbed/reproduce.py)."""
