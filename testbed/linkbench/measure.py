"""Measure gloo transfers through a real rate-limited, delayed kernel link (netns.py + relay.py).

`measure(delay_s, rates_bps, plan)` builds one namespace link per delay, and for each rate starts a
fresh pair of gloo processes (a new TCP connection: slow start from the initial window) that run
the plan; it returns one row per transfer: rate, delay, bytes, messages, the idle gap before it,
and the measured seconds (first byte offered by the sender to last byte received).

`python -m testbed.linkbench.measure OUT.json [--delays 0.03] [--rates 60,100,200,400] [--relay c]` runs the
validation grid (`validation_plan`) and writes the rows with the machine's provenance.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from testbed.linkbench.netns import (CONGESTION_CONTROL, RELAY_LAYOUTS, RELAYS, TBF_BURST_BYTES, TBF_QUEUE_BYTES,
                                     DelayedLink, LinkSetupError, LinkSpec)

SIZES = (1 << 10, 16 << 10, 128 << 10, 1 << 20, 4 << 20, 16 << 20)


def validation_plan(sizes=SIZES, warm_gap_s: float = 0.1, idle_gap_s: float = 1.0) -> list[dict]:
    """Each size twice (3-message engine path, then the payload alone), short gaps; then one transfer
    after a long idle (TCP's restart after idle)."""
    plan = []
    for n in sizes:
        plan += [{"n": n, "msgs": 3, "gap": warm_gap_s}, {"n": n, "msgs": 1, "gap": warm_gap_s}]
    plan.append({"n": 1 << 20, "msgs": 3, "gap": idle_gap_s})
    return plan


def _run_pair(link: DelayedLink, plan: list[dict], port: int, timeout_s: float) -> list[float]:
    arg = json.dumps(plan)
    cmd = lambda ns, rank: ["ip", "netns", "exec", ns, sys.executable, "-m", "testbed.linkbench.gloo_pair",
                            str(rank), link.addr_a, str(port), arg]
    recv = subprocess.Popen(cmd(link.ns_b, 1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    send = subprocess.Popen(cmd(link.ns_a, 0), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = []
    try:
        for p in (send, recv):
            try:
                out, err = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"gloo pair timed out after {timeout_s} s") from None
            if p.returncode:
                raise RuntimeError(f"gloo pair failed ({p.returncode}): {err[-800:]}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in (send, recv):
            if p.poll() is None:
                p.kill()
                p.wait()
    return [r - s for s, r in zip(*outs)]


def queue_bytes_for(rate_bps: float, delay_s: float, queue_bdp: float | None) -> float | None:
    """The bottleneck queue: `queue_bdp` x the path's bandwidth-delay product (rate x RTT, RTT = 2 x
    the one-way delay), or None for the harness's fixed queue (`TBF_QUEUE_BYTES`)."""
    return None if queue_bdp is None else max(TBF_BURST_BYTES, queue_bdp * rate_bps / 8.0 * 2.0 * delay_s)


def measure(delay_s: float, rates_bps, plan: list[dict], timeout_s: float = 300.0, repeats: int = 1,
            queue_bdp: float | None = None, relay: str = "c", layout: str = "shared") -> list[dict]:
    """Each rate's plan `repeats` times, each on a fresh connection; every row says its repeat, the
    bottleneck's queue, and what that run's connection lost (queue drops, retransmitted segments,
    timeouts: the same for every row of one run) and how late the relay was in it (`relay_run`, with
    `late` = netns.late_flag; a late run is also warned about on stderr)."""
    rows = []
    with DelayedLink(LinkSpec(rates_bps[0], delay_s, relay, layout)) as link:
        for i, rate in enumerate(rates_bps):
            queue = queue_bytes_for(rate, delay_s, queue_bdp)
            link.set_rate(rate, queue)
            for k in range(repeats):
                link.relay_snapshot()  # starts the relay's tally for this run (what came before is not its)
                drops0, c0 = link.drops(), link.sender_counters()
                times = _run_pair(link, plan, 29500 + (i * repeats + k) % 400, timeout_s)
                late = link.relay_snapshot()
                c1 = link.sender_counters()
                lost = {"drops": link.drops() - drops0} | {key: c1.get(key, 0) - c0.get(key, 0) for key in c1}
                if late["late"]:
                    print(f"warning: relay late in run {k} at {rate / 1e6:g} Mbps, {delay_s * 1e3:g} ms: mean "
                          f"{late['late_mean_s'] * 1e3:.2f} ms, worst {late['late_max_s'] * 1e3:.1f} ms", file=sys.stderr)
                rows += [{"rate_bps": rate, "delay_s": delay_s, "n": p["n"], "msgs": p["msgs"], "gap_s": p["gap"],
                          "measured_s": t, "repeat": k, "queue_bytes": queue or TBF_QUEUE_BYTES, "run_losses": lost,
                          "relay_run": late} for p, t in zip(plan, times)]
    rows_relay = link.relay_report
    return rows if not rows_relay else [dict(r, relay=rows_relay) for r in rows]


def provenance(load_before: list[str] | None = None, relay: str = "c", layout: str = "shared") -> dict:
    import torch

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kernel": platform.release(),
            "torch": torch.__version__, "python": platform.python_version(),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3], "loadavg_before": load_before,
            "congestion_control": CONGESTION_CONTROL, "relay": relay, "relay_layout": layout,
            "link": "veth + tbf (queue: each row's queue_bytes) + TUN delay relay (testbed/linkbench)",
            "data_plane": "torch.distributed gloo send/recv over TCP (engine/torch_exec/stage/worker.py)"}


def _exit_cleanly(*_) -> None:
    raise SystemExit(143)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.linkbench.measure")
    ap.add_argument("out")
    ap.add_argument("--delays", default="0.03")
    ap.add_argument("--rates", default="60,100,200,400", help="Mbps")
    ap.add_argument("--repeats", type=int, default=1, help="runs of the plan per rate, each a fresh connection")
    ap.add_argument("--queue-bdp", type=float, default=None,
                    help="bottleneck queue as a multiple of rate x RTT (default: the fixed TBF_QUEUE_BYTES)")
    ap.add_argument("--sizes", default=None, help="comma-separated bytes (default: the validation sizes)")
    ap.add_argument("--relay", default="c", help=f"the delay relay: {', '.join(RELAYS)} (python: the 2026-11-27 series')")
    ap.add_argument("--layout", default="shared",
                    help=f"relays: {', '.join(RELAY_LAYOUTS)} (shared: one for both directions, every series to 2026-11-28c)")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_cleanly)  # the link's namespaces are removed on the way out
    try:
        rates = [float(r) * 1e6 for r in a.rates.split(",")]
        delays = [float(x) for x in a.delays.split(",")]
        sizes = SIZES if a.sizes is None else tuple(int(x) for x in a.sizes.split(","))
    except ValueError:
        print(f"error: --rates {a.rates!r} / --delays {a.delays!r} / --sizes {a.sizes!r}: comma-separated numbers "
              "(Mbps, seconds, bytes)")
        return 2
    if a.relay not in RELAYS:
        print(f"error: --relay {a.relay!r}: valid choices: {', '.join(RELAYS)}")
        return 2
    if a.layout not in RELAY_LAYOUTS:
        print(f"error: --layout {a.layout!r}: valid choices: {', '.join(RELAY_LAYOUTS)}")
        return 2
    if not 1 <= a.repeats <= 50 or (a.queue_bdp is not None and not 0 < a.queue_bdp <= 20):
        print(f"error: --repeats {a.repeats} / --queue-bdp {a.queue_bdp}: repeats 1-50, queue-bdp in (0, 20]")
        return 2
    out = Path(a.out)
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        print(f"error: cannot write {out}: its folder is missing or not writable")
        return 2
    rows, load_before = [], Path("/proc/loadavg").read_text().split()[:3]
    try:
        for d in delays:
            rows += measure(d, rates, validation_plan(sizes), repeats=a.repeats, queue_bdp=a.queue_bdp, relay=a.relay,
                            layout=a.layout)
    except LinkSetupError as exc:
        print(f"error: the measured link could not be built (root and iproute2 needed): {exc}")
        return 2
    out.write_text(json.dumps({"provenance": provenance(load_before, a.relay, a.layout), "rows": rows}, indent=1) + "\n")
    late = {(r["delay_s"], r["rate_bps"], r["repeat"]) for r in rows if r["relay_run"]["late"]}
    print(f"{len(rows)} transfers -> {a.out}" + (f"; {len(late)} run(s) with a late relay (rows' relay_run.late)"
                                                  if late else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
