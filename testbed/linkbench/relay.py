"""A packet-delaying relay on a TUN device: the one-way delay of the measured link (no netem here).

This machine's kernel has veth pairs and the `tbf` qdisc but not `netem`, so the delay is added in
user space, inside the TCP connection's path: the router namespace routes every packet between the
two endpoints into a TUN device; this process reads each packet, holds it `delay_s`, and writes it
back, where the kernel forwards it on (through the rate-limiting `tbf`). TCP therefore sees a real
round-trip time (2 x delay + serialisation + queueing): its window growth, ACK clocking and
loss recovery are the kernel's own.

The TUN device is opened with a virtio-net header and TSO/checksum offloads, so the kernel hands
over GSO super-packets (up to 64 KB of MSS-sized segments) instead of one packet per 1,448 bytes:
at 400 Mbps that is ~1,000 reads/s instead of ~35,000, which a Python loop on a shared 2-core
machine sustains. What that leaves out: the segments of one super-packet are delayed as one unit
(they leave the sender back to back anyway); the delay is constant (no jitter, no reordering); and
a relay descheduled for longer than a packet's gap adds that time (`late_s` in its report says how
much, measured).

Run as `python -m testbed.linkbench.relay DEV DELAY_S` inside the router namespace; it prints
`ready` once attached, on SIGUSR1 a JSON line of what it forwarded since the last one (one per
measured run, as delay_relay.c), and on SIGTERM a JSON report line (packets, bytes, worst lateness).
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TUN, IFF_NO_PI, IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
READ_BYTES = 65536 + 64
# Real-time priority above the endpoints' (gloo_pair.RT_PRIORITY) and above other real-time work on a
# shared machine: a relay that waits for a CPU delays every packet (seen: 100 ms behind SCHED_FIFO
# engine runs at priority 10).
RT_PRIORITY = 30  # a GSO super-packet with its virtio-net header


def open_tun(dev: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI | IFF_VNET_HDR))
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
    return fd


class Tally:
    """Packets forwarded and how late, over the relay's life or one run."""

    def __init__(self) -> None:
        self.packets = self.nbytes = 0
        self.late_max = self.late_sum = 0.0

    def count(self, nbytes: int, late: float) -> None:
        self.packets += 1
        self.nbytes += nbytes
        self.late_max = max(self.late_max, late)
        self.late_sum += late

    def report(self) -> dict:
        return {"packets": self.packets, "bytes": self.nbytes, "late_max_s": self.late_max,
                "late_mean_s": self.late_sum / max(1, self.packets), "relay": "python"}


def serve(fd: int, delay_s: float, stop: list, snapshot: list | None = None) -> dict:
    """Hold each packet `delay_s`, in arrival order (a constant delay keeps the order); print one
    run's tally whenever `snapshot` is set (SIGUSR1)."""
    held: deque[tuple[float, bytes]] = deque()
    life, run = Tally(), Tally()
    snapshot = [] if snapshot is None else snapshot
    clock = time.monotonic
    while not stop:
        if snapshot:
            snapshot.clear()
            print(json.dumps(run.report()), flush=True)
            run = Tally()
        timeout = max(0.0, held[0][0] - clock()) if held else 0.2
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            now = clock()
            while True:
                try:
                    pkt = os.read(fd, READ_BYTES)
                except BlockingIOError:
                    break
                held.append((now + delay_s, pkt))
        now = clock()
        while held and held[0][0] <= now:
            due, pkt = held.popleft()
            life.count(len(pkt), now - due)
            run.count(len(pkt), now - due)
            try:
                os.write(fd, pkt)
            except BlockingIOError:  # the kernel's queue is full: dropped, as a full router queue would
                pass
    return life.report()


def main(argv: list[str]) -> int:
    dev, delay_s = argv[0], float(argv[1])
    fd = open_tun(dev)
    try:  # light (it blocks in select) but latency-critical: descheduled, it delays every packet
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
    except (OSError, AttributeError):
        pass
    stop: list = []
    snapshot: list = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGUSR1, lambda *_: snapshot.append(1))
    print("ready", flush=True)
    report = serve(fd, delay_s, stop, snapshot)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
