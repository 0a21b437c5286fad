"""`testbed bench engine`'s options checked before it measures anything (issue 48 items 3 and 4):
`--repeats -3` was a traceback and `--repeats 0` ran with the default; the `--compare`-only options
(`--num-blocks 0`, `--block-size 0`, `--threads-per-stage 0`) were ignored without it, and the grid's
(`--kernels`, `--quick`) ignored with it; an unwritable `--json` was a traceback after 92 s of
measuring, the figures lost (`out_checks.write_or_keep` keeps them now)."""
from __future__ import annotations

import argparse

from engine.base.errors import ConfigError
from testbed.run.out_checks import writable_file

MAX_REPEATS = 1000
# (dest, option, lowest value) of the counts a user sets
GRID_COUNTS = (("repeats", "--repeats", 1),)
COMPARE_COUNTS = (("pp", "--pp", 1), ("threads_per_stage", "--threads-per-stage", 1), ("num_requests", "--num-requests", 1),
                  ("max_len", "--max-len", 1), ("num_blocks", "--num-blocks", 1), ("block_size", "--block-size", 1),
                  ("hf_batch", "--hf-batch", 1))


def _given(args: argparse.Namespace, add: callable) -> list[str]:
    """The options of the parser `add` builds whose values differ from their defaults, as typed."""
    ap = argparse.ArgumentParser(add_help=False)
    add(ap)
    defaults = ap.parse_args([])
    return [a.option_strings[0] if a.option_strings else a.dest for a in ap._actions
            if a.dest != "help" and getattr(args, a.dest, None) != getattr(defaults, a.dest, None)]


def check_engine_args(args: argparse.Namespace) -> None:
    """One `error:` line (exit 2) for a bad count, an option of the other mode, or an output that
    cannot be written; before any measurement."""
    from testbed.bench.engine import add_arguments
    from testbed.bench.engine_grid import add_grid_arguments

    grid, compare = _given(args, add_grid_arguments), _given(args, add_arguments)
    other = grid if args.compare else compare
    if other:
        belongs = "the grid (without --compare)" if args.compare else "--compare"
        raise ConfigError(f"{', '.join(other)}: option(s) of {belongs}, not of `testbed bench engine"
                          f"{' --compare' if args.compare else ''}`; drop them or {'drop' if args.compare else 'add'} "
                          f"--compare")
    for dest, option, low in COMPARE_COUNTS if args.compare else GRID_COUNTS:
        value = getattr(args, dest, None)
        if value is not None and not low <= value <= (MAX_REPEATS if dest == "repeats" else 10**7):
            raise ConfigError(f"invalid {option}={value}; a whole number from {low} to "
                              f"{MAX_REPEATS if dest == 'repeats' else 10**7:,}")
    target = ("--out", args.out) if args.compare else ("--json", args.json_out)
    if target[1]:
        writable_file(*target)
