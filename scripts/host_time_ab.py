"""Host time per decode step (step - forward) of two checkouts, side by side in one run.

    python scripts/host_time_ab.py OLD_CHECKOUT NEW_CHECKOUT [--rounds 6] [--steps 30] [overrides...]
    # e.g. git worktree add ../old 1a5c8d9 && python scripts/host_time_ab.py ../old . model=tiny-llama

Each checkout runs in its own child process (its own PYTHONPATH), which starts the real engine
once (`executor=torch`, P=1 unless overridden) and then, when told, times `--steps` decode steps
of one point in steady state: the point's sequences hold their blocks in the run's block manager
and advance one token per step, as in serving (a step is the driver's launch to the sampled ids
back; forward is the stage's forward span). The parent alternates the children point by point,
round after round, so both see the same machine load; it prints the medians per point and the
ratio new / old. Only APIs both checkouts have are used (prepare_experiment, launch,
next_completion, the block manager), so any two commits of the engine can be compared.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

POINTS = ((1, 128), (8, 128), (32, 512), (64, 512))
BASE = ["executor=torch", "model=tiny-llama", "parallel.pp=1", "workload=synthetic", "workload.num_requests=1",
        "output.trace=full", "output.mlflow=false", "output.plots=false", "output.progress=false",
        "kv.num_blocks=4096"]


def child(overrides: list[str]) -> None:
    """Start the engine, then answer `point batch context steps` lines with JSON timings."""
    import engine.torch_exec  # noqa: F401
    import policies  # noqa: F401
    from engine.core.batch import MicroBatch
    from engine.core.request import Request, Sequence
    from testbed.config.spec import compose_spec
    from testbed.run.runner import prepare_experiment

    spec = compose_spec(BASE + overrides)
    ctrl = prepare_experiment(spec).controller
    ex, kv = ctrl.executor, ctrl.kv
    ctrl.start()
    next_seq, next_mb = [30_000_000], [3_000_000]
    print("ready", flush=True)
    for line in sys.stdin:
        _, batch, context, steps = line.split()
        batch, context, steps = int(batch), int(context), int(steps)
        seqs = []
        for _ in range(batch):
            next_seq[0] += 1
            seq = Sequence(Request(next_seq[0], 0.0, context, 1 << 20))
            seq.num_computed = context - 1
            kv.allocate(seq.seq_id, context - 1)
            seqs.append(seq)
        step, fwd = [], []
        for i in range(steps + 1):  # the first step is untimed (the stages meet these sequences)
            kv.append_one_each([s.seq_id for s in seqs])
            next_mb[0] += 1
            mb = MicroBatch(next_mb[0], (), tuple(seqs))
            t = time.perf_counter()
            ex.launch(mb)
            done = ex.next_completion()
            dt = time.perf_counter() - t
            for seq, tok in zip(seqs, done.token_ids):
                seq.num_computed += 1
                seq.output_token_ids.append(tok)
            if i:
                step.append(dt)
                fwd.append(sum(b - a for _, name, a, b, m in ex.tracer.spans if m == mb.mb_id
                               and name.startswith("forward")))
        ex.tracer.spans.clear()
        for seq in seqs:
            kv.free(seq.seq_id)
        print(json.dumps({"step": step, "forward": fwd}), flush=True)
    ex.shutdown()


def start(checkout: str, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", *overrides], cwd=checkout, env=env,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        raise SystemExit(f"{checkout}: the engine did not start ({line!r})")
    return p


def ask(p: subprocess.Popen, batch: int, context: int, steps: int) -> dict:
    p.stdin.write(f"point {batch} {context} {steps}\n")
    p.stdin.flush()
    return json.loads(p.stdout.readline())


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--new-first", action="store_true",
                    help="start the new checkout's engine first (run both orders: the order of start may matter)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()
    order = ("new", "old") if args.new_first else ("old", "new")
    procs = {name: start(getattr(args, name), args.overrides) for name in order}
    got: dict = {(name, pt): {"step": [], "forward": []} for name in procs for pt in POINTS}
    load = [os.getloadavg()[0]]
    try:
        for r in range(args.rounds):
            for pt in POINTS:
                for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    out = ask(procs[name], *pt, args.steps)
                    for k in ("step", "forward"):
                        got[(name, pt)][k] += out[k]
            load.append(os.getloadavg()[0])
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(60)
    print(f"load (1-min average) during the run: {min(load):.2f}-{max(load):.2f}; {args.rounds} rounds x "
          f"{args.steps} steps per point and checkout, alternated, {order[0]} started first; medians in ms")
    print(f"{'batch':>5} {'context':>7} | {'old step':>8} {'old fwd':>8} {'old host':>8} | "
          f"{'new step':>8} {'new fwd':>8} {'new host':>8} | {'host new/old':>12}")
    for pt in POINTS:
        row = []
        for name in ("old", "new"):
            g = got[(name, pt)]
            host = statistics.median(s - f for s, f in zip(g["step"], g["forward"]))
            row.append((statistics.median(g["step"]), statistics.median(g["forward"]), host))
        (os_, of, oh), (ns, nf, nh) = row
        print(f"{pt[0]:>5} {pt[1]:>7} | {1e3 * os_:8.2f} {1e3 * of:8.2f} {1e3 * oh:8.2f} | "
              f"{1e3 * ns:8.2f} {1e3 * nf:8.2f} {1e3 * nh:8.2f} | {nh / oh:12.2f}")


if __name__ == "__main__":
    main()
