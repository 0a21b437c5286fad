"""How fast a delay relay forwards (a harness diagnostic, root only).

`python -m testbed.linkbench.relay_speed RELAY [DELAY_S] [MB]` builds the measured link with that relay
(netns.py: "c" or "python"), removes its rate limit, and times one TCP stream of MB megabytes from the
sender's namespace to the receiver's (plain sockets, Reno, both ends SCHED_FIFO as the gloo endpoints).
Without a bottleneck the relay is the slowest part of the path, so the stream's rate is the relay's
forwarding speed: the speed at which a window's burst reaches the tbf queue in a measurement (the link
model's `sender_Bps`). Prints one JSON line: relay, delay, bytes, seconds, MB/s, the relay's report.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

from testbed.linkbench.netns import DelayedLink, LinkSpec

PORT = 29777
SERVER = ("import os,socket,sys\n"
          "try: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(20))\n"
          "except OSError: pass\n"
          "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', {port}))\n"
          "s.listen(1); print('ready', flush=True); c,_=s.accept(); n=0; b=bytearray(1<<20)\n"
          "while True:\n"
          "    k=c.recv_into(b)\n"
          "    if not k: break\n"
          "    n+=k\n"
          "print(n, flush=True)\n")
CLIENT = ("import os,socket,sys,time\n"
          "try: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(20))\n"
          "except OSError: pass\n"
          "s=socket.create_connection(('{addr}', {port})); b=bytes(1<<20); t=time.monotonic()\n"
          "for _ in range({mb}): s.sendall(b)\n"
          "s.shutdown(socket.SHUT_WR); s.recv(1); print(time.monotonic()-t, flush=True)\n")


def relay_speed(relay: str, delay_s: float = 0.001, mb: int = 256) -> dict:
    with DelayedLink(LinkSpec(10e9, delay_s, relay)) as link:
        for dev in ("ra", "rb"):  # no bottleneck: the relay is the slowest part
            link._in(link.ns_r, "tc", "qdisc", "del", "dev", dev, "root")
        server = subprocess.Popen(["ip", "netns", "exec", link.ns_b, sys.executable, "-c", SERVER.format(port=PORT)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "ready"
            out = subprocess.run(["ip", "netns", "exec", link.ns_a, sys.executable, "-c",
                                  CLIENT.format(addr=link.addr_b, port=PORT, mb=mb)],
                                 capture_output=True, text=True, timeout=300, check=True).stdout
            seconds = float(out.strip().splitlines()[-1])
            received = int(server.communicate(timeout=30)[0].strip().splitlines()[-1])
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    return {"relay": relay, "delay_s": delay_s, "bytes": received, "seconds": round(seconds, 4),
            "MBps": round(received / seconds / 1e6, 1), "relay_report": link.relay_report,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("c", "python"):
        print("error: relay must be one of: c, python (usage: relay_speed RELAY [DELAY_S] [MB])")
        return 2
    delay = float(argv[1]) if len(argv) > 1 else 0.001
    mb = int(argv[2]) if len(argv) > 2 else 256
    print(json.dumps(relay_speed(argv[0], delay, mb)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
