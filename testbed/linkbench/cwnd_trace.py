"""The sender's congestion window through one run of the validation plan (a diagnostic, root only).

`python -m testbed.linkbench.cwnd_trace DELAY_S RATE_MBPS OUT.txt [RELAY]` builds the measured link, runs the
plan once (measure.py) while polling `ss -tin` in the sender's namespace, and writes, for the gloo
connection, the window when the sender went idle after each transfer and every change of Reno's
threshold. It showed what the link model's loss terms now follow (engine/pricing/tcp_link.py): at
200 Mbps / 50 ms the window reached 3.6 MB in slow start, Reno cut it to 1.8 MB, and the next
transfer's burst cut it to 0.9 MB (measurements/linkbench-2026-11-27/cwnd-traces.txt).
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile

from testbed.linkbench.measure import _run_pair, validation_plan
from testbed.linkbench.netns import DelayedLink, LinkSpec

FIELDS = ("bytes_acked", "cwnd", "ssthresh", "mss", "unacked")


def _samples(raw: str, peer: str) -> list[dict]:
    """One sample per poll: the connection towards `peer` that has acknowledged the most bytes."""
    out, best, dst = [], None, ""
    for line in raw.splitlines():
        if re.fullmatch(r"\d+\.\d+ \d+\.\d+", line):  # /proc/uptime: a new poll
            if best:
                out.append(best)
            best = None
        elif re.match(r"^\d+\s+\d+\s+\S+\s+\S+", line):
            dst = line.split()[-1]
        elif "cwnd:" in line and peer in dst:
            # ss leaves out a field that is unset (ssthresh before a loss) or zero (unacked when idle)
            got = {k: float(m.group(1)) if (m := re.search(rf"\b{k}:(\d+)", line)) else (0.0 if k == "unacked" else -1.0)
                   for k in FIELDS}
            if best is None or got["bytes_acked"] >= best["bytes_acked"]:
                best = got
    return out + ([best] if best else [])


def summary(samples: list[dict]) -> list[str]:
    lines, ss, busy = [], None, False
    for s in samples:
        mb = lambda k: s[k] * s["mss"] / 1e6
        if s["ssthresh"] != ss and s["ssthresh"] > 0:
            lines.append(f"  ssthresh -> {s['ssthresh']:.0f} segments ({mb('ssthresh'):.2f} MB) at {s['bytes_acked'] / 1e6:.3f} MB acked")
        ss = s["ssthresh"]
        if s["unacked"] == 0 and busy:
            lines.append(f"idle: {s['bytes_acked'] / 1e6:.3f} MB acked, cwnd {s['cwnd']:.0f} segments ({mb('cwnd'):.2f} MB)")
        busy = s["unacked"] > 0
    return lines


def main(argv: list[str]) -> int:
    delay, rate, out = float(argv[0]), float(argv[1]) * 1e6, argv[2]
    relay = argv[3] if len(argv) > 3 else "c"
    with DelayedLink(LinkSpec(rate, delay, relay)) as link, tempfile.TemporaryFile("w+") as raw:
        poll = subprocess.Popen(["ip", "netns", "exec", link.ns_a, "sh", "-c",
                                 "while true; do cat /proc/uptime; ss -tinH state established; done"], stdout=raw)
        try:
            _run_pair(link, validation_plan(), 29900, 300.0)
        finally:
            poll.terminate()
            poll.wait()
        raw.seek(0)
        lines = summary(_samples(raw.read(), link.addr_b))
    with open(out, "w") as f:
        f.write(f"# {delay * 1e3:.0f} ms one way, {rate / 1e6:.0f} Mbps, {relay} relay\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
