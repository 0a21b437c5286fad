"""Running many `testbed` commands at once against shared services (issue 24): an Optuna study
in PostgreSQL, an `mlflow server` with a proxied artifact store, workers on several hosts.

The project adds no scheduler of its own; these modules only make its commands safe to run side
by side: worker identities that are not host names (identity), the PostgreSQL driver check and
the lock that serialises first starts on a fresh database (postgres), Optuna's heartbeats and the
retry of a dead worker's trial (heartbeat), and where artifacts go (artifacts).
The recipe and what it costs: docs/beyond-one-machine.md."""
