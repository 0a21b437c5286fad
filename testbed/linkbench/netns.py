"""A rate-limited, delayed link between two network namespaces, built and torn down by one process.

    ns A (sender, 10.<k>.1.1) --veth-- ns R (router) --veth-- ns B (receiver, 10.<k>.2.1)
                                          |
                                   TUN device(s) + delay relay(s) (one-way delay, both directions:
                                   delay_relay.c, or relay.py for the 2026-11-27 series)
                                   tbf on R's two egress veths (the link's rate, both directions)

Every packet between A and B enters R, is routed into a TUN device (policy rules by incoming veth),
held by a relay, written back and forwarded out of the other veth through its `tbf` qdisc. With
`layout="shared"` one TUN device and relay carry both directions (every series up to 2026-11-28c);
with `layout="per-direction"` each direction has its own TUN device and relay process, so that the
ACKs are not written behind a burst of data (RELAY_LAYOUTS). TCP between A and B therefore sees RTT = 2 x delay + serialisation + queueing, and a
bottleneck queue whose size is `tbf`'s `latency` setting.

Needs root and `ip`/`tc` (iproute2); a failure to create a namespace raises `LinkSetupError` with the
command and its message, never a silent fallback.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# The endpoints' congestion control. This machine defaults to BBR, whose pacing makes a transfer
# rate-like rather than window by window (measured: 64 KB took 22 ms beyond the 30 ms delay at
# 400 Mbps); a namespace may default only to one of tcp_allowed_congestion_control (here reno, bbr),
# and a socket switched to CUBIC after BBR keeps BBR's pacing (64 KB: +14.7 ms). Reno is Linux's
# loss-based control with the same slow start, window validation and restart after idle as CUBIC
# (the default on the distributions GPU servers run); the two differ only after a loss (the window
# halves instead of falling to 0.7).
CONGESTION_CONTROL = "reno"
RELAY_RING_PACKETS = 50_000
# The bottleneck's queue: 1,000 full-size frames, netem's default `limit` (MoLink's paper gives only the
# rate and delay; a tc-emulated link keeps one queue, fixed in packets, across a rate sweep): 3.4 x the
# bandwidth-delay product at 60 Mbps / 30 ms, 0.5 x at 400 Mbps. Checked against a queue of one BDP at
# every rate (the rule-of-thumb router buffer; `measure.py --queue-bdp 1`), 2026-11-27, 3-5 repeats:
# at 400 Mbps the BDP queue narrows the spread of 16 MB (range 6-15% of the mean instead of 18-25%),
# but at 60-100 Mbps a grown window's burst after a 0.1 s pause then overflows it every time (1 MB in
# 0.70-0.97 s instead of 0.12-0.18 s), so it is no more realistic; the fixed queue stays. With a 50 ms
# queue, 1 MB transfers took up to 1.2 s in loss recovery (against 0.18 s without loss).
TBF_QUEUE_BYTES = 1000 * 1514
TBF_BURST_BYTES = 4 * 1514
# The delay relays: "c" (delay_relay.c, built here with the system C compiler; the default since
# 2026-11-28) or "python" (relay.py, the relay of every 2026-11-27 series). Both forward 1.2-1.5 GB/s
# in bulk (relay_speed.py); the 400 Mbps spread is TCP's with either (docs/measurements/links-2026-11-28.md).
# "c-timer" (2026-11-28f): the same C relay with a reader thread that stamps each packet as it arrives and a
# writer that releases it at arrival + delay (delay_relay.c, mode "timer"): "c" stamped a packet only when its
# one loop got to read it, after writing the due ones, so a packet arriving behind a released burst was held
# longer than the delay, by more the larger the burst (measurements/linkbench-2026-11-28f/lateness.txt).
RELAYS = ("c", "python", "c-timer")
# How the relays share the two directions. "shared": one TUN device and one relay for both (every series
# up to 2026-11-28c). Its writes carry the kernel's forwarding (38-45 us a write at 400 Mbps against 7-13
# at 60-200, 2026-11-28c), so the ACKs waited behind each released burst of data and every 15 ms /
# 400 Mbps run was late by 3.3-6.0 ms on average. "per-direction": A->B and B->A each through their own
# TUN device and relay process (two CPUs work in parallel; an ACK waits only behind other ACKs).
# "rate-first" (2026-11-28f): per-direction relays, and each direction's tbf moved from R's egress veth to
# the egress of its TUN device, so a packet is queued and serialised at the rate BEFORE the relay delays it
# (a link's queue and serialiser, then its propagation delay). Before, a sender's burst reached the relay at
# veth speed and every write carried the kernel's forwarding (tbf segmenting the GSO packet, the receiver's
# TCP) in the relay's time, so a burst was released slower than it came and the release fell further
# behind the larger the backlog (measured from outside the relay, lateness.py: mean 0.06 ms at < 64 KB held,
# 2.6-6 ms at 1-4 MB held, 2026-11-28f lateness.txt); here the relay gets packets at most at the rate.
RELAY_LAYOUTS = ("shared", "per-direction", "rate-first")
RELAY_SOURCE = Path(__file__).with_name("delay_relay.c")
# The delay is added by the user-space relay above: this machine's kernel (6.18; CONFIG_NET_SCH_FQ,
# _ETF, _NETEM not set) cannot hold a packet in any qdisc it has. TCP_TX_DELAY, the kernel-side
# alternative, is honoured only by `fq`: `tc qdisc add ... fq` fails ("Specified qdisc kind is
# unknown"), and TCP_TX_DELAY = 10 ms is accepted by setsockopt but leaves the RTT at 0.013 ms
# (checked 2026-11-28c; docs/measurements/links-2026-11-28c.md). No kernel mode is offered.
# A run is flagged late when its relay's mean lateness exceeds this share of the one-way delay, or any
# packet is held longer than one delay beyond its due time. Lateness adds to the RTT in each direction,
# so a mean of 5% of the delay adds ~5% to a latency-bound transfer: a third of issue 46's 15% target,
# left for the model. link46d's quiet runs had 0.3-0.8 ms (2-5% at 15 ms); link46e's 15 ms / 400 Mbps
# series 4.4 ms (29%). A packet held a whole extra delay doubles one round trip of its transfer.
LATE_MEAN_SHARE = 0.05
LATE_MAX_DELAYS = 1.0


# Rate-first's bucket: RATE_FIRST_BURST_S of the rate (at least TBF_BURST_BYTES, at most one 64 KB GSO packet
# with headers). tbf splits a GSO packet larger than its bucket into 1,514-byte frames; on the TUN device that
# meant ~33,000 reads and writes a second per direction at 400 Mbps, and on this 2-core machine the relay fell
# behind (smoke test 2026-11-28f: 16 MB x3 in 1.04 s against 0.71). The sender's packets carry about 1 ms of
# its pacing rate (Linux's TSO autosizing), so a 2 ms bucket passes most whole. What it costs: after an idle
# period up to one bucket (2 ms of the rate) leaves back to back instead of at the rate.
# tbf counts a GSO packet's length with every segment's headers, so a full 64 KB one (67.5 KB so counted)
# is larger than any bucket tbf allows (65,535 B) and was always split: the endpoints' GSO packets are
# capped at RATE_FIRST_GSO_BYTES (~24 segments) and the bucket holds one.
RATE_FIRST_BURST_S = 0.002
RATE_FIRST_BURST_MAX = 36_000
RATE_FIRST_GSO_BYTES = 32_768


def rate_first_burst(rate_bps: float) -> int:
    return int(min(RATE_FIRST_BURST_MAX, max(TBF_BURST_BYTES, rate_bps / 8.0 * RATE_FIRST_BURST_S)))


class LinkSetupError(RuntimeError):
    pass


def sh(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise LinkSetupError(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


@dataclass(frozen=True)
class LinkSpec:
    rate_bps: float  # bits per second of the bottleneck (tbf)
    delay_s: float  # one-way delay (the relay adds it in each direction)
    relay: str = "c"  # one of RELAYS
    layout: str = "shared"  # one of RELAY_LAYOUTS

    def __post_init__(self) -> None:
        if self.relay not in RELAYS:
            raise LinkSetupError(f"relay {self.relay!r}: valid choices: {', '.join(RELAYS)}")
        if self.layout not in RELAY_LAYOUTS:
            raise LinkSetupError(f"relay layout {self.layout!r}: valid choices: {', '.join(RELAY_LAYOUTS)}")


def late_flag(run: dict, delay_s: float) -> bool:
    """Whether one run's relay report (`DelayedLink.relay_snapshot`) was late enough to distort the
    run: mean lateness over LATE_MEAN_SHARE of the delay, or a packet LATE_MAX_DELAYS delays late."""
    return (run.get("late_mean_s", 0.0) > LATE_MEAN_SHARE * delay_s
            or run.get("late_max_s", 0.0) > LATE_MAX_DELAYS * delay_s)


def merge_reports(reports: list[dict]) -> dict:
    """One run's (or life's) relay report from each direction's relay: counts added, the worst lateness
    kept, the mean weighted by packets; each relay's own report kept under `directions`."""
    if len(reports) == 1:
        return reports[0]
    packets = sum(r["packets"] for r in reports)
    merged = {key: sum(r.get(key, 0) for r in reports) for key in ("packets", "bytes", "write_drops", "write_s")}
    merged["late_max_s"] = max(r["late_max_s"] for r in reports)
    merged["late_mean_s"] = sum(r["late_mean_s"] * r["packets"] for r in reports) / packets if packets else 0.0
    return merged | {"relay": reports[0].get("relay"), "directions": reports}


def relay_binary() -> Path:
    """delay_relay.c compiled (gcc/cc -O2) into a per-source cache under the temp folder, once."""
    src = RELAY_SOURCE.read_bytes()
    out = Path(tempfile.gettempdir()) / "testbed-linkbench" / f"delay_relay-{hashlib.sha256(src).hexdigest()[:12]}"
    if out.is_file():
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise LinkSetupError("the C delay relay needs a C compiler (gcc or cc); or choose relay 'python'")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}")
    sh(cc, "-O2", "-Wall", "-pthread", "-o", str(tmp), str(RELAY_SOURCE))
    tmp.replace(out)
    return out


class DelayedLink:
    """Context manager: the namespaces, veths, TUN relay and tbf qdiscs of one link; `ns_a`/`ns_b`
    name the endpoint namespaces and `addr_a`/`addr_b` their addresses; `set_rate` changes the
    bottleneck in place (the relay and delay stay)."""

    def __init__(self, spec: LinkSpec, tag: str | None = None) -> None:
        self.spec = spec
        k = (os.getpid() % 200) + 20
        self.tag = tag or f"l{os.getpid() % 100000}"
        self.ns_a, self.ns_r, self.ns_b = f"{self.tag}a", f"{self.tag}r", f"{self.tag}b"
        self.addr_a, self.addr_b = f"10.{k}.1.1", f"10.{k}.2.1"
        self._k = k
        self._rated: tuple[str, ...] = ("ra", "rb")  # the devices whose egress tbf is the link's rate
        self.relays: list[subprocess.Popen] = []  # A->B first; one for both directions when shared
        self.relay_report: str = ""

    # --- building ----------------------------------------------------------------------------------
    def __enter__(self) -> "DelayedLink":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _in(self, ns: str, *cmd: str) -> str:
        return sh("ip", "netns", "exec", ns, *cmd)

    def _build(self) -> None:
        k, a, r, b = self._k, self.ns_a, self.ns_r, self.ns_b
        for ns in (a, r, b):
            sh("ip", "netns", "add", ns)
            self._in(ns, "ip", "link", "set", "lo", "up")
        sh("ip", "link", "add", "va", "netns", a, "type", "veth", "peer", "name", "ra", "netns", r)
        sh("ip", "link", "add", "vb", "netns", b, "type", "veth", "peer", "name", "rb", "netns", r)
        self._in(a, "ip", "addr", "add", f"10.{k}.1.1/24", "dev", "va")
        self._in(b, "ip", "addr", "add", f"10.{k}.2.1/24", "dev", "vb")
        self._in(r, "ip", "addr", "add", f"10.{k}.1.2/24", "dev", "ra")
        self._in(r, "ip", "addr", "add", f"10.{k}.2.2/24", "dev", "rb")
        for ns, dev in ((a, "va"), (b, "vb"), (r, "ra"), (r, "rb")):
            self._in(ns, "ip", "link", "set", dev, "up")
        for ns in (a, b):
            self._in(ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={CONGESTION_CONTROL}")
        if self.spec.layout == "rate-first":  # GSO packets small enough for the bucket (RATE_FIRST_GSO_BYTES)
            self._in(a, "ip", "link", "set", "va", "gso_max_size", str(RATE_FIRST_GSO_BYTES))
            self._in(b, "ip", "link", "set", "vb", "gso_max_size", str(RATE_FIRST_GSO_BYTES))
        self._in(a, "ip", "route", "add", "default", "via", f"10.{k}.1.2")
        self._in(b, "ip", "route", "add", "default", "via", f"10.{k}.2.2")
        for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
            self._in(r, "sysctl", "-qw", key)
        # shared: both veths into "dly" (table 46); per-direction: from A into "dly", from B into "dlz" (47)
        tuns = {"ra": "dly", "rb": "dly" if self.spec.layout == "shared" else "dlz"}
        self._rated = ("dly", "dlz") if self.spec.layout == "rate-first" else ("ra", "rb")
        for table, tun in enumerate(dict.fromkeys(tuns.values()), start=46):
            self._in(r, "ip", "tuntap", "add", "dev", tun, "mode", "tun", "vnet_hdr")
            # The ring between the kernel and the relay: a grown window leaves the sender at veth speed, and
            # 500 packets (the default) overflowed before the relay read them, as no real link would
            # (16 MB at 200 Mbps ran at 62% of the rate, Reno's threshold cut to 0.9 MB by those drops).
            self._in(r, "ip", "link", "set", tun, "txqueuelen", str(RELAY_RING_PACKETS), "up")
            self._in(r, "sysctl", "-qw", f"net.ipv4.conf.{tun}.rp_filter=0")
            self._in(r, "ip", "route", "add", "default", "dev", tun, "table", str(table))
            for dev in (d for d, t in tuns.items() if t == tun):
                self._in(r, "ip", "rule", "add", "iif", dev, "table", str(table))
        for dev in ("ra", "rb"):
            self._in(r, "sysctl", "-qw", f"net.ipv4.conf.{dev}.rp_filter=0")
        self.set_rate(self.spec.rate_bps)
        relay = ([sys.executable, "-m", "testbed.linkbench.relay"] if self.spec.relay == "python"
                 else [str(relay_binary())])
        mode = ["timer"] if self.spec.relay == "c-timer" else []
        for tun in dict.fromkeys(tuns.values()):
            proc = subprocess.Popen(["ip", "netns", "exec", r, *relay, tun, repr(self.spec.delay_s), *mode],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.relays.append(proc)
            line = proc.stdout.readline().strip()
            if line != "ready":
                raise LinkSetupError(f"delay relay did not start: {line} {proc.stderr.read()}")

    @property
    def relay(self) -> subprocess.Popen | None:
        """The A->B relay (the only one when the layout is shared)."""
        return self.relays[0] if self.relays else None

    def set_rate(self, rate_bps: float, queue_bytes: float | None = None) -> None:
        """tbf on both of R's egress veths: `burst` four full-size frames (tbf's timer is a
        high-resolution one: it sustains 400 Mbps so), the queue `TBF_QUEUE_BYTES` long. A larger
        bucket lets a burst through at veth speed, as no real link does: with rate/250 s of bucket
        (100 KB at 200 Mbps), 128 KB crossed a 10 ms link in 12.1 ms against 15-16 ms at the rate.
        Rate-first (tbf on the TUN devices): `rate_first_burst`, so the sender's GSO packets reach the relay
        whole instead of segmented."""
        burst = rate_first_burst(rate_bps) if self.spec.layout == "rate-first" else TBF_BURST_BYTES
        limit = int(queue_bytes or TBF_QUEUE_BYTES)
        for dev in self._rated:
            self._in(self.ns_r, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
                     "burst", str(burst), "limit", str(limit))

    def relay_snapshot(self, timeout_s: float = 2.0) -> dict:
        """What the relay forwarded, and how late, since the last snapshot (SIGUSR1 -> one JSON line),
        with `late` = `late_flag`; taken after each measured run. Per direction: the two relays' reports
        merged (`merge_reports`), each under `directions`."""
        reports = []
        for proc in self.relays:
            proc.send_signal(signal.SIGUSR1)
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            if not ready:
                raise LinkSetupError(f"the delay relay gave no report within {timeout_s} s")
            reports.append(json.loads(proc.stdout.readline()))
        run = merge_reports(reports)
        return dict(run, late=late_flag(run, self.spec.delay_s))

    def drops(self) -> int:
        """Packets the bottleneck queues dropped so far (both directions; `tc -s qdisc`)."""
        total = 0
        for dev in self._rated:
            out = self._in(self.ns_r, "tc", "-s", "qdisc", "show", "dev", dev)
            total += int(out.split("dropped ", 1)[1].split(",", 1)[0]) if "dropped " in out else 0
        return total

    def sender_counters(self) -> dict[str, int]:
        """The sender namespace's TCP counters that tell loss recovery apart (`nstat`): segments
        retransmitted, retransmission timeouts, fast recoveries."""
        out = self._in(self.ns_a, "nstat", "-az", "TcpRetransSegs", "TcpExtTCPTimeouts", "TcpExtTCPSackRecovery",
                       "TcpExtTCPRenoRecovery", "TcpExtTCPLossProbes")
        got = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                got[parts[0]] = int(parts[1])
        return got

    def close(self) -> None:
        lives = []
        for proc in self.relays:
            if proc.poll() is not None:
                continue
            proc.terminate()
            try:
                out, _ = proc.communicate(timeout=5)
                lives += [json.loads(out.strip().splitlines()[-1])] if out.strip() else []
            except (subprocess.TimeoutExpired, ValueError):
                proc.kill()
                proc.wait()
        if lives:
            self.relay_report = json.dumps(merge_reports(lives))
        for ns in (self.ns_a, self.ns_r, self.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
