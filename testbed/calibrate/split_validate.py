"""`testbed validate --runs <manifest.yaml>` and `testbed calibrate runs <manifest.yaml>`: the declared split.

    testbed calibrate runs measurements/cpu-tiny-llama/manifest.yaml --profile cpu-tiny-llama-pp2-runs \
        --name cpu-tiny-llama-pp2-runs [--table-option 1]
    testbed validate --runs measurements/cpu-tiny-llama/manifest.yaml --profile cpu-tiny-llama-pp2-runs \
        hardware=cpu-tiny-llama-pp2-runs [--test] [--errors-csv errors.csv]

The fit reads the split's `fit` runs only (testbed/calibrate/manifest.py). Validate replays the
fit and validation runs (the validation runs choose the options); `--test` adds the test runs,
reported once (`test_reports.log`), and the rank agreement of the policies per setting
(testbed/calibrate/rank.py), which needs every policy of a setting. Per (setting, policy) the
engine's figure is the mean of its repeats (the simulator is deterministic, the engine is not).
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from engine.base.errors import ConfigError
from engine.pricing.hardware import get_hardware
from testbed.calibrate.host_check import host_report
from testbed.calibrate.manifest import Manifest, Split, load_manifest, record_test_report
from testbed.calibrate.error_figure import error_figure, frame_of
from testbed.run.out_checks import writable_dir, writable_file
from testbed.calibrate.rank import CSV_METRICS, Replayed, error_by_load, format_rank, rank_table, write_errors_csv
from testbed.calibrate.runs import ReplayDiverged, load_run
from testbed.calibrate.spread_sim import check_spread, simulate_spread, spread_note

TABLE_METRICS = ("throughput_tok_s", "ttft_mean_s", "tpot_mean_s")


def manifest_fit_args(args) -> tuple[list[str], str | None, str | None]:
    """(run dirs, base, table) of `calibrate runs <manifest> --profile P`: its fit runs only; the
    base and table from the manifest unless given (`--table-option i` picks options.table[i])."""
    m = load_manifest(args.runs[0])
    split = m.split(getattr(args, "profile", None))
    args.profile = split.name  # recorded in the profile's provenance
    base = args.base or split.base
    if base is None:
        raise ConfigError(f"{split.name} in {m.path} names no base: pass --base")
    table = args.table
    choice = getattr(args, "table_option", None)
    if choice is not None:
        options = list(split.options.get("table") or [])
        if not 0 <= choice < len(options):
            raise ConfigError(f"--table-option {choice}: {split.name} lists {len(options)} table option(s) "
                              f"({options}); valid choices: 0-{len(options) - 1}")
        table = str(m.path.parent / options[choice]) if options[choice] else None  # as given: portable
    return [str(m.run_dir(r)) for r in split.fit], base, table


def cmd_validate_manifest(args, console) -> int:
    from testbed.calibrate.profile import _override
    from testbed.config.composer import load_saved_profiles

    load_saved_profiles()
    spread_s = check_spread(getattr(args, "spread", 0.0))
    overrides = list(args.overrides) + [r for r in args.runs if "=" in r]
    hardware = _override(overrides, "hardware")
    if hardware is None or any(o.partition("=")[0] != "hardware" for o in overrides):
        raise ConfigError("testbed validate --runs <manifest.yaml> takes hardware=<profile> and nothing else; got "
                          f"{' '.join(overrides) or 'nothing'}")
    m = load_manifest([r for r in args.runs if "=" not in r][0])  # registers the profiles beside its runs
    split = m.split(args.profile)
    hw = get_hardware(hardware)
    sets = ("fit", "validation", "test") if args.test else ("fit", "validation")
    unpacked_test = [r for r in split.test if not m.run_dir(r).is_dir()]
    if args.test and unpacked_test:
        raise ConfigError(f"the test runs of {split.name} are not packed yet ({', '.join(m.absent) or m.path.name} "
                          f"missing): {', '.join(unpacked_test[:3])}")
    out = Path(args.out) if args.out else Path("runs") / "validate" / f"{time.strftime('%Y%m%d-%H%M%S')}_{split.name}"
    writable_dir("--out", out)  # before the replays (minutes): a bad path fails at once
    if args.errors_csv:
        writable_file("--errors-csv", args.errors_csv)
    rows = replay_all(m, split, sets, hardware, console, spread_s)
    text = format_split(rows, split, hardware, args.test) + spread_note(spread_s)
    text += "\n" + host_report({which: [m.run_dir(r) for r in getattr(split, which)] for which in sets})
    if args.test:
        earlier = record_test_report(m, split, hardware, str(hw.version), spread_s)
        text += (f"\n\ntest runs of {split.name} reported before ({len(earlier)}x): {'; '.join(earlier[-3:])}: "
                 "they have been looked at already, say so when quoting them") if earlier else \
            f"\n\nfirst report of {split.name}'s test runs (recorded in {m.path.parent / 'test_reports.log'})"
    out.mkdir(parents=True, exist_ok=True)
    (out / "errors.md").write_text("```\n" + text + "\n```\n")
    (out / "replays.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1, default=float))
    error_figure(frame_of(rows), out / "errors.png", f"{split.name}: simulated on {hardware} vs the engine")
    if args.errors_csv:
        write_errors_csv(rows, Path(args.errors_csv), CSV_METRICS)
    print(text)
    print(out.resolve())
    return 0


def replay_all(m: Manifest, split: Split, sets: tuple[str, ...], hardware: str, console,
               spread: float = 0.0) -> list[Replayed]:
    from testbed.calibrate.offline import replayed, stalls_against

    rows = []
    for name in split.runs(sets):
        run = load_run(m.run_dir(name))
        t = time.perf_counter()
        sim = simulate_spread(run, hardware, spread)[1]
        try:
            st = stalls_against(run, hardware, sim)
        except ReplayDiverged as exc:  # the stall check needs the shapes; the simulated run does not
            console.print(f"  {name}: no stall check ({exc})")
            st = {"count": -1, "excess_s": 0.0}
        rows.append(replayed(run, sim, st, split.set_of(name)))
        console.print(f"  {name}: simulated in {time.perf_counter() - t:.1f} s")
    return rows


def grouped(rows: list[Replayed], which: str) -> dict[tuple[str, str], list[Replayed]]:
    """(setting, policy) -> its runs in set `which` (repeats of one command; a fit command's
    repeats in the validation set are averaged there, apart from the fit run)."""
    out: dict[tuple[str, str], list[Replayed]] = {}
    for r in rows:
        if r.set == which:
            out.setdefault((r.setting, r.policy), []).append(r)
    return out


def mean_errors(group: list[Replayed]) -> dict[str, float]:
    """The simulator (its replay of the first run) against the mean of the repeats."""
    out = {}
    for m in TABLE_METRICS:
        real = [float(r.real.get(m, math.nan)) for r in group]
        mean = sum(real) / len(real)
        out[m] = float(group[0].sim.get(m, math.nan)) / mean - 1.0 if mean else math.nan
        out[f"{m}_spread"] = (max(real) - min(real)) / mean if len(real) > 1 and mean else math.nan
    return out


def format_split(rows: list[Replayed], split: Split, hardware: str, with_test: bool) -> str:
    lines = [f"{split.name}: simulated (hardware={hardware}) vs real, each run replayed with its own requests; "
             "error = sim / mean of the repeats - 1 (throughput / TTFT mean / TPOT mean), spread = (max - min) / mean"]
    for which in ("fit", "validation", "test"):
        groups = grouped(rows, which)
        if not groups:
            continue
        lines.append(f"\n{which} runs")
        lines.append(f"  {'setting':<28}{'policy':<9}{'runs':>5}{'throughput':>12}{'TTFT mean':>11}{'TPOT mean':>11}"
                     f"{'spread (tp/ttft/tpot)':>24}  stalls")
        for (setting, policy), g in sorted(groups.items()):
            e = mean_errors(g)
            spread = "/".join("-" if not math.isfinite(e[f"{m}_spread"]) else f"{100 * e[f'{m}_spread']:.0f}%"
                              for m in TABLE_METRICS)
            stall = sum(max(0, r.stall_count) for r in g)
            unknown = sum(r.stall_count < 0 for r in g)
            note = (f"{stall}, {sum(r.stall_s for r in g):.2f} s" if stall else "none") + (
                f" ({unknown} run(s) not checked: replay diverged)" if unknown else "")
            lines.append(f"  {setting:<28}{policy:<9}{len(g):>5}" + "".join(f"{100 * e[m]:>+10.1f}% " for m in TABLE_METRICS)
                         + f"{spread:>23}  " + note)
        within = [all(abs(mean_errors(g)[m]) <= 0.10 for m in ("throughput_tok_s", "tpot_mean_s"))
                  for g in groups.values()]
        lines.append(f"  {sum(within)} of {len(within)} within 10% on throughput and TPOT mean")
    if with_test:  # on the test runs alone when they hold several policies a setting (new repeats of every run)
        tested = [r for r in rows if r.set == "test"]
        table = rank_table(tested) or rank_table(rows)
        lines.append(format_rank(table, error_by_load(tested if rank_table(tested) else rows)))
    else:
        lines.append("\n(test runs and the rank agreement: --test; the test runs are reported once)")
    return "\n".join(lines)
