#!/usr/bin/env python
"""Issue 48's service fault probes, re-runnable: real services started here (tests/services.py's
PostgreSQL and `mlflow server`, tests/ray_cluster.py's two-node Ray cluster from the installed
`ray`), one `testbed` command per probe, a fault injected while it runs, and the outcome
classified:
  warned     exit 0 and a `warning:` line saying what it waited for (a restart ridden out)
  accepted   exit 0 without a word (the fault missed the command, or was ridden out silently)
  refused    exit != 0 with one `error:` line and no traceback (a service gone for good, a bad address)
  traceback  a Python traceback on stderr
  hang       no exit within the probe's limit (killed)
and, beside the verdict: MLflow runs left RUNNING right after the command, and after the same
folder's next command (a tiny `testbed run` on the same store: cluster/unwritten.py), and whether a
result was lost (`run`: no summary.json in its run folder; `tune`: a trial run FINISHED whose trial
is not COMPLETE; `compare`: no point folder with a summary.json).
PostgreSQL as the study's storage with two hosts is tests/test_two_host_outage.py.
Usage: nice -n 10 python scripts/service_probes.py [--only mlflow|ray|postgres] [--out table.md]
(~20-40 min on a loaded 2-core box: each probe is bounded by its own limit)."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

BASE = ["policy=sarathi", "workload=synthetic", "workload.arrival=offline", "model=llama2-13b", "hardware=a100-80g",
        "parallel.pp=2", "output.plots=false", "output.progress=false", "output.dir=runs"]
COMMANDS = {  # each long enough (seconds of simulation) for a fault to land inside it
    "run": ["run", *BASE, "workload.num_requests=15000"],
    "compare": ["compare", *BASE[1:], "policy=sarathi,gllm", "workload.num_requests=3000"],
    "tune": ["tune", *BASE, "tune.trials=4", "workload.num_requests=3000"],
    "capacity": ["capacity", *[b for b in BASE if not b.startswith("workload.arrival")], "capacity.windows=1",
                 "capacity.window_requests=3000", "capacity.precision=0.1"],
}
LIMIT_S = 420
DOWN_S = 10
# the reconnect window: the default (120 s) for a restart (10 s down, then an `mlflow server` start of
# 15-40 s on a loaded 2-core box), 20 s for a service gone for good
RECONNECT_S = {"restart": "120", "gone": "20"}


@dataclass
class Probe:
    service: str
    fault: str  # "restart" | "gone" | "head dies" | "wrong address"
    command: str
    argv: list[str]
    inject: Callable[[], None] | None  # called once the command holds a run open
    store: str  # the tracking URI whose RUNNING runs are counted


def _running(uri: str) -> list[str]:
    """Ids of the RUNNING runs in every experiment of the store at `uri` ([] if unreachable)."""
    if not uri:  # MlflowClient("") would open (and create) ./mlflow.db
        return []
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(uri)
        ids = [e.experiment_id for e in client.search_experiments()]
        return [r.info.run_id for r in client.search_runs(ids, "attributes.status = 'RUNNING'", max_results=1000)]
    except Exception:  # noqa: BLE001 - the store is the one away
        return []


def _wait_for_open_run(uri: str, proc: subprocess.Popen, before: set, limit_s: float = 240) -> bool:
    """Until the command holds a run open (one RUNNING that was not before it started)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if set(_running(uri)) - before:
            return True
        time.sleep(0.5)
    return False


def _wait_for_file(path: Path, proc: subprocess.Popen, limit_s: float = 240, then_s: float = 8) -> bool:
    """Until `path` exists, then `then_s` more (the sweep's workers connected and running)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists():
            time.sleep(then_s)
            return proc.poll() is None
        time.sleep(0.5)
    return False


def _lost(command: str, folder: Path, uri: str, storage: str | None) -> str:
    runs = folder / "runs"
    if command == "run":
        return "no" if any(runs.glob("*/summary.json")) else "YES"
    if command == "compare":
        return "no" if any(runs.rglob("summary.json")) else "YES"
    if command == "tune" and storage and uri:
        try:
            import optuna
            from mlflow.tracking import MlflowClient

            client = MlflowClient(uri)
            ids = [e.experiment_id for e in client.search_experiments()]
            finished = {r.info.run_id for r in client.search_runs(ids, "attributes.status = 'FINISHED'",
                                                                   max_results=1000)}
            from testbed.tune.storage import make_storage

            study = optuna.load_study(study_name="probe", storage=make_storage(storage))
            lost = [t.number for t in study.trials if t.state.name != "COMPLETE"
                    and t.user_attrs.get("mlflow_run_id") in finished]
            return "YES" if lost else "no"
        except Exception as exc:  # noqa: BLE001
            return f"? ({type(exc).__name__})"
    return "n/a"


def classify(code: int | None, err: str) -> str:
    if code is None:
        return "hang"
    if "Traceback" in err:
        return "traceback"
    if code != 0:
        return "refused" if err.count("error:") >= 1 else f"exit {code}, no error line"
    return "warned" if "warning:" in err else "accepted"


def run_probe(p: Probe, tmp: Path, env: dict) -> tuple:
    folder = tmp / f"{p.service}-{p.fault}-{p.command}".replace(" ", "_")
    folder.mkdir()
    storage = f"journal:{folder / 'study.log'}" if p.command == "tune" else None
    argv = p.argv + ([f"tune.storage={storage}", "tune.study=probe"] if storage else [])
    before = set(_running(p.store)) if p.store.startswith(("http", "postgresql")) else set()
    t0 = time.monotonic()
    env = {**env, "TESTBED_RECONNECT_S": RECONNECT_S.get(p.fault, "20")}
    proc = subprocess.Popen([sys.executable, "-m", "testbed.cli", *argv], cwd=folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    out: list[str] = []
    threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True).start()
    err_box: list[str] = []
    reader = threading.Thread(target=lambda: err_box.append(proc.stderr.read()), daemon=True)
    reader.start()
    hit = False
    if p.inject is not None:
        if p.store == "sqlite":  # the command's own store: never opened from here while it is being created
            hit = _wait_for_file(folder / "runs" / "mlflow.db", proc)
        else:
            hit = _wait_for_open_run(p.store, proc, before)
        if hit:
            p.inject()
    try:
        code = proc.wait(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(timeout=10)
    err = err_box[0] if err_box else ""
    wall = time.monotonic() - t0
    return folder, storage, code, err, wall, hit, before


def _after(p: Probe, folder: Path, env: dict, before: set) -> int:
    """RUNNING runs once the folder's next command (a tiny `testbed run` on the same store) ran."""
    argv = ["run", *BASE, "workload.num_requests=20", *[a for a in p.argv if a.startswith("output.tracking_uri=")]]
    subprocess.run([sys.executable, "-m", "testbed.cli", *argv], cwd=folder, env=env, capture_output=True,
                   timeout=LIMIT_S)
    left = set(_running(p.store)) - before
    if left:  # which ones, for the report
        from mlflow.tracking import MlflowClient

        client = MlflowClient(p.store)
        for run_id in left:
            run = client.get_run(run_id)
            print(f"    still RUNNING: {run.info.run_name} ({run.data.tags.get('testbed.kind', '?')}) {run_id}")
    return len(left)


def mlflow_probes(tmp: Path) -> tuple[list[Probe], Callable[[], None]]:
    from mlflow_db import fresh_mlflow_db
    from services import MlflowServer

    (tmp / "server").mkdir()
    server = MlflowServer(fresh_mlflow_db(tmp / "server"), tmp / "server")
    server.wait_healthy()

    def restart() -> None:
        server.restart(down_s=DOWN_S)

    def gone() -> None:
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)

    probes = []
    for command, argv in COMMANDS.items():
        for fault, inject in (("restart", restart), ("gone", gone)):
            probes.append(Probe("mlflow server", fault, command, [*argv, f"output.tracking_uri={server.base}"],
                                inject, server.base))

    def back() -> None:  # after a "gone" probe: the server again, for the count and the next probe
        if server.proc.poll() is not None:
            server._start()
            server.wait_healthy()

    return probes, (back, server.stop)


def postgres_probes(tmp: Path) -> tuple[list[Probe], tuple]:
    """The MLflow store itself on PostgreSQL (`output.tracking_uri=postgresql+psycopg://...`)."""
    from services import Postgres

    pg = Postgres()
    probes = []

    def restart() -> None:
        pg.restart(down_s=DOWN_S)

    def gone() -> None:
        os.killpg(pg.proc.pid, signal.SIGINT)
        pg.proc.wait(timeout=60)

    for command, argv in COMMANDS.items():
        uri = pg.new_database("mlflow").replace("postgresql://", "postgresql+psycopg://")
        for fault, inject in (("restart", restart), ("gone", gone)):
            probes.append(Probe("postgres (MLflow store)", fault, command, [*argv, f"output.tracking_uri={uri}"],
                                inject, uri))

    def back() -> None:
        if pg.proc.poll() is not None:
            pg._start()

    return probes, (back, pg.stop)


def ray_probes(tmp: Path) -> tuple[list[Probe], tuple]:
    from ray_cluster import start_cluster

    cluster = start_cluster()
    from services import free_port

    closed = f"127.0.0.1:{free_port()}"

    def head_dies() -> None:
        box["cluster"].procs[0].send_signal(signal.SIGKILL)

    box = {"cluster": cluster}
    probes = []
    for command in ("compare", "tune"):
        longer = {"tune.trials=4": "tune.trials=16", "workload.num_requests=3000": "workload.num_requests=20000"}
        if command == "tune":
            longer.pop("workload.num_requests=3000")
        argv = [*[longer.get(a, a) for a in COMMANDS[command]], "sweep.backend=ray"]
        # 16 trials: two Ray nodes ran 4 in ~11 s, before the fault; a compare of 3,000-request points
        # ended in 10 s, before it (NOT HIT): 20,000 requests a point
        probes.append(Probe("ray", "wrong address", command, [*argv, f"ray.address={closed}"], None, ""))
        probes.append(Probe("ray", "head dies", command, [*argv, f"ray.address={cluster.address}"], head_dies,
                            "sqlite"))
    # the head dies in the first "head dies" probe: the next one gets a fresh cluster

    def back() -> None:
        if box["cluster"].procs[0].poll() is not None:
            box["cluster"].stop()
            box["cluster"] = start_cluster()
            for pr in probes:
                pr.argv = [a if not a.startswith("ray.address=") or pr.fault == "wrong address"
                           else f"ray.address={box['cluster'].address}" for a in pr.argv]

    return probes, (back, lambda: box["cluster"].stop())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("mlflow", "ray", "postgres"), action="append")
    ap.add_argument("--command", choices=tuple(COMMANDS), action="append", help="only these commands")
    ap.add_argument("--out", help="append the table (markdown) here too")
    ap.add_argument("--logs", help="write each probe's stdout/stderr into this folder")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="svcprobes48-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TESTBED_ALLOW_DOWNLOAD": "0"}
    env.pop("TESTBED_WORKER_SESSION", None)
    rows = []
    groups = {"mlflow": mlflow_probes, "postgres": postgres_probes, "ray": ray_probes}
    for name in args.only or list(groups):
        probes, (back, stop) = groups[name](tmp)
        try:
            for p in probes:
                if args.command and p.command not in args.command:
                    continue
                folder, storage, code, err, wall, hit, before = run_probe(p, tmp, env)
                if args.logs:
                    Path(args.logs).mkdir(parents=True, exist_ok=True)
                    Path(args.logs, folder.name + ".err").write_text(err)
                back()
                store = p.store if p.store != "sqlite" else f"sqlite:///{folder / 'runs' / 'mlflow.db'}"
                p.store = store
                left = len(set(_running(store)) - before) if store else 0
                after = _after(p, folder, env, before) if left else 0
                line = next((ln for ln in err.splitlines() if ln.startswith(("error:", "warning:"))), "")
                rows.append((p.service, p.fault, p.command, classify(code, err), "yes" if hit else "NOT HIT",
                             str(left), str(after),
                             "n/a" if code == 2 else _lost(p.command, folder, store, storage),  # refused before work
                             f"{wall:.0f}",
                             str(err.count("error:")), line[:100].replace("|", "/")))
                print(" | ".join(rows[-1]), flush=True)
                for said in err.splitlines():  # the whole story of each probe, for the report
                    if said.startswith(("error:", "warning:", "note:", "Traceback")) or "reachable again" in said:
                        print(f"    {said[:400]}", flush=True)
        finally:
            stop()
    shutil.rmtree(tmp, ignore_errors=True)
    table = ["| service | fault | command | verdict | fault hit | RUNNING after | after next cmd | result lost | s "
             "| error lines | first error/warning line |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    counts = {v: sum(r[3] == v for r in rows) for v in ("traceback", "hang")}
    table.append(f"\n{len(rows)} probes: {counts['traceback']} tracebacks, {counts['hang']} hangs, "
                 f"{sum(r[7] == 'YES' for r in rows)} results lost, "
                 f"{sum(int(r[5]) > 0 for r in rows)} left runs RUNNING, "
                 f"{sum(int(r[6]) > 0 for r in rows)} still RUNNING after the folder's next command")
    print("\n".join(table))
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
