"""Grids of runs: the job runner shared by compare, capacity, reproduce and tune's pool (jobs),
`testbed compare` (compare) and the tables and figures of `compare` and `report` (report)."""
