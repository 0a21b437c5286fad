"""`testbed bench`: benchmarks that print figures -- the simulator (sim), the real engine against
its floor (engine, engine_grid, engine_floor) and a served endpoint replayed (serve)."""
