"""How late the delay relay releases packets, measured from outside it: kernel timestamps on the TUN devices.

The relay's own `late_*` figures count from the time it stamped a packet, which in its "loop" mode is when
its one loop got round to reading it: a packet that arrived while the relay was writing a released burst
waited unread and unstamped in the TUN queue, and no figure of the relay's shows it. Here a packet
socket on each TUN device (in the router namespace) records, with the kernel's timestamp, every packet
the kernel hands to the relay (outgoing) and every packet the relay writes back (incoming); matched by
their first header bytes (IP + TCP headers, timestamps option included), a packet's hold is
`back - out`, its lateness `hold - delay`, and the relay's backlog at its arrival is the bytes handed
over and not yet written back.

`python -m testbed.linkbench.lateness OUT.json --relays c:per-direction,c-timer:rate-first [--delay 0.025] [--rate 400] [--repeats 3]`
builds a per-direction link per relay, runs the validation plan (measure.py) `repeats` times while capturing,
and writes per relay the matched packets `[arrival_s, lateness_s, backlog_bytes, bytes, direction]` and a
summary; `--figure OUT.png --table OUT.txt` draws lateness against backlog (`figure`). Root only.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections import defaultdict, deque
from pathlib import Path

ETH_P_ALL = 0x0003
SO_TIMESTAMPNS = 35
PACKET_OUTGOING = 4
KEY_BYTES = 64  # IP header + TCP header with its options: the same bytes leave and come back
BACKLOG_EDGES = (0, 64e3, 256e3, 1e6, 2e6, 4e6, float("inf"))  # bytes held by the relay at a packet's arrival


def capture(devs: list[str], out: Path) -> int:
    """In the router namespace: record (dev, outgoing, kernel time, key, length) per packet until SIGTERM."""
    socks = []
    for dev in devs:
        s = socket.socket(socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(ETH_P_ALL))
        s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        s.setsockopt(socket.SOL_SOCKET, 33, 256 << 20)  # SO_RCVBUFFORCE: a burst must not overflow it
        s.bind((dev, 0))
        socks.append((dev, s))
    stop: list = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    rows = []
    print("ready", flush=True)
    import select
    while not stop:
        try:
            ready, _, _ = select.select([s for _, s in socks], [], [], 0.2)
        except InterruptedError:
            continue
        for dev, s in socks:
            if s not in ready:
                continue
            data, anc, _, addr = s.recvmsg(KEY_BYTES, 64, socket.MSG_TRUNC)
            t = next((struct.unpack("qq", d[:16]) for lvl, typ, d in anc if typ == SO_TIMESTAMPNS), (0, 0))
            length = struct.unpack("!H", data[2:4])[0] if len(data) >= 4 else len(data)
            rows.append([dev, addr[2] == PACKET_OUTGOING, t[0] + t[1] / 1e9, data.hex(), length])
    out.write_text(json.dumps(rows))
    return 0


def matched(rows: list, delay_s: float) -> list[list]:
    """[arrival_s, lateness_s, backlog_bytes, bytes, dev] per packet that went to the relay and came back."""
    pending: dict[tuple, deque] = defaultdict(deque)
    held = defaultdict(float)
    out = []
    for dev, outgoing, t, key, length in sorted(rows, key=lambda r: r[2]):
        if outgoing:
            pending[(dev, key)].append((t, held[dev], length))
            held[dev] += length
        elif pending[(dev, key)]:
            t0, backlog, n = pending[(dev, key)].popleft()
            held[dev] -= n
            out.append([t0, t - t0 - delay_s, backlog, n, dev])
    return out


def summary(packets: list[list]) -> dict:
    """Lateness (ms) by backlog bin: packets, mean, 95th percentile, worst."""
    bins = {}
    for lo, hi in zip(BACKLOG_EDGES, BACKLOG_EDGES[1:]):
        late = sorted(p[1] * 1e3 for p in packets if lo <= p[2] < hi)
        if late:
            bins[f"{lo / 1e3:g}-{hi / 1e3:g} KB"] = {"packets": len(late), "mean_ms": statistics.mean(late),
                                                      "p95_ms": late[int(0.95 * (len(late) - 1))], "max_ms": late[-1]}
    return bins


def run_relay(relay: str, layout: str, delay_s: float, rate_bps: float, repeats: int, workdir: Path) -> dict:
    from testbed.linkbench.measure import measure, validation_plan
    from testbed.linkbench import netns

    cap_out = workdir / f"capture-{relay}-{layout}.json"
    real_build = netns.DelayedLink._build

    def build_and_capture(link):  # the capture starts once the TUN devices exist, before the first run
        real_build(link)
        link._capture = subprocess.Popen(["ip", "netns", "exec", link.ns_r, sys.executable, "-m",
                                          "testbed.linkbench.lateness", "--capture", str(cap_out), "dly", "dlz"],
                                         stdout=subprocess.PIPE, text=True)
        if link._capture.stdout.readline().strip() != "ready":
            raise netns.LinkSetupError("the lateness capture did not start")

    real_close = netns.DelayedLink.close

    def close(link):
        proc = getattr(link, "_capture", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        real_close(link)

    netns.DelayedLink._build, netns.DelayedLink.close = build_and_capture, close
    try:
        rows = measure(delay_s, [rate_bps], validation_plan(), repeats=repeats, relay=relay, layout=layout)
    finally:
        netns.DelayedLink._build, netns.DelayedLink.close = real_build, real_close
    packets = matched(json.loads(cap_out.read_text()), delay_s)
    cap_out.unlink()
    return {"relay": f"{relay}:{layout}", "summary": summary(packets), "packets": [[round(x, 7) if isinstance(x, float) else x
                                                                       for x in p] for p in packets],
            "transfers": [{k: r[k] for k in ("n", "msgs", "gap_s", "measured_s", "repeat")} | {
                "relay_late_mean_s": r["relay_run"]["late_mean_s"]} for r in rows]}


def table(result: dict) -> str:
    lines = [f"# relay lateness measured on the TUN devices (kernel timestamps), {result['delay_s'] * 1e3:g} ms, "
             f"{result['rate_bps'] / 1e6:g} Mbps, {result['repeats']} runs of the validation plan; {result['date']}, "
             f"load {result['load_before']} -> {result['load_after']}",
             f"{'relay':24} {'backlog at arrival':>20} {'packets':>8} {'mean ms':>8} {'p95 ms':>8} {'max ms':>8}"]
    for r in result["relays"]:
        for name, b in r["summary"].items():
            lines.append(f"{r['relay']:24} {name:>20} {b['packets']:8d} {b['mean_ms']:8.3f} {b['p95_ms']:8.3f} "
                         f"{b['max_ms']:8.3f}")
    return "\n".join(lines) + "\n"


def figure(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r, colour in zip(result["relays"], ("tab:red", "tab:blue", "tab:green")):
        pk = r["packets"]
        ax.scatter([p[2] / 1e6 for p in pk], [p[1] * 1e3 for p in pk], s=3, alpha=0.4, color=colour, label=r["relay"])
    ax.set_xlabel("bytes held by the relay at the packet's arrival (MB)")
    ax.set_ylabel("release lateness (ms): hold - delay")
    ax.set_title(f"delay relay lateness, {result['delay_s'] * 1e3:g} ms, {result['rate_bps'] / 1e6:g} Mbps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--capture":
        return capture(argv[2:], Path(argv[1]))
    ap = argparse.ArgumentParser(prog="python -m testbed.linkbench.lateness")
    ap.add_argument("out")
    ap.add_argument("--relays", default="c:per-direction,c-timer:rate-first", help="RELAY:LAYOUT,...")
    ap.add_argument("--delay", type=float, default=0.025)
    ap.add_argument("--rate", type=float, default=400.0, help="Mbps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--figure")
    ap.add_argument("--table")
    a = ap.parse_args(argv)
    from testbed.linkbench.netns import RELAY_LAYOUTS, RELAYS

    relays = [tuple(v.split(":", 1)) if ":" in v else (v, "per-direction") for v in a.relays.split(",")]
    bad = [f"{r}:{l}" for r, l in relays if r not in RELAYS or l not in RELAY_LAYOUTS]
    if bad:
        print(f"error: --relays {bad[0]!r}: RELAY:LAYOUT, relays {', '.join(RELAYS)}, layouts {', '.join(RELAY_LAYOUTS)}")
        return 2
    out = Path(a.out)
    for option, path in (("out", a.out), ("--table", a.table), ("--figure", a.figure)):
        parent = Path(path).parent if path else None
        if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK)):
            print(f"error: {option} {path!r}: its folder {str(parent)!r} is not a writable folder")
            return 2
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "delay_s": a.delay,
              "rate_bps": a.rate * 1e6, "repeats": a.repeats, "load_before": load_before,
              "relays": [run_relay(r, l, a.delay, a.rate * 1e6, a.repeats, out.parent) for r, l in relays]}
    result["load_after"] = Path("/proc/loadavg").read_text().split()[:3]
    out.write_text(json.dumps(result) + "\n")
    if a.table:
        Path(a.table).write_text(table(result))
    if a.figure:
        figure(result, Path(a.figure))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
