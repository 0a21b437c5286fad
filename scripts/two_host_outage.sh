#!/usr/bin/env bash
# The two-host study in the recipe's layout through a 10 s PostgreSQL restart and with PostgreSQL
# gone for good (issue 48): real PostgreSQL + `mlflow server` on it + two `tune` hosts (own host
# name, folder and pid namespace). Prints one FIGURES line per phase. Needs the postgres extra and
# PostgreSQL's server binaries (tests/services.py). ~3-6 min on a loaded 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest tests/test_two_host_outage.py -m "slow and services" -s -q -p no:cacheprovider "$@"
