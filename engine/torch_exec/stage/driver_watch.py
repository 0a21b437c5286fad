"""A stage started by hand (`executor.launch=external`) ends within seconds of losing its driver.

Spawned stages die with their parent (orphan.py); a stage on another host has no parent to
watch, and before this it could not tell a dead driver from a quiet one: after a failed start
(issue 24, defect 9) the surviving stage sat in the torch.distributed rendezvous, which waits up
to 10 minutes for the missing rank, holding stage 0's store port -- and the next run's stages
then found the port taken or the old stage in their place ("stage(s) [0] did not report 'hello'"
after 180 s).

ZeroMQ already knows when the driver goes: a monitor on the stage's DEALER socket reports
EVENT_DISCONNECTED as soon as the driver's connection closes (its process ended, or its control
socket closed at the end of a failed run), and ZMTP heartbeats (ZMQ_HEARTBEAT_IVL / _TIMEOUT;
the driver's ROUTER answers them inside libzmq) turn a silent peer -- a host that vanished --
into a disconnect within HEARTBEAT_TIMEOUT_MS. A daemon thread reads the monitor; on a
disconnect after a connect it gives the main thread GRACE_S to end by itself (a normal `Stop`
races the driver's socket closing), then ends the process with `os._exit`, which has the kernel
close every socket the stage held, the store's port included. A stage started before its
driver waits for it as before: only a connection once made and then lost counts; the connection
itself must come within the stage's `--wait-driver-s` (worker.py).
"""
from __future__ import annotations

import os
import sys
import threading
import time

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
GRACE_S = 2.0
EXIT_DRIVER_GONE = 75  # EX_TEMPFAIL: nothing failed here; the run it served is over
WAIT_DRIVER_S = 600.0  # a stage started by hand: how long its driver may take to appear (--wait-driver-s)
EXIT_NO_DRIVER = 69  # EX_UNAVAILABLE: the driver never came


def wait_for_driver(connected: threading.Event, stage: int, address: str, wait_s: float) -> None:
    """A stage started by hand: its hello waits in ZeroMQ's queue for a connection, and with no
    driver it waited silently for ever (issue 38 item 11). Now the connection must come within
    `wait_s`, else one line on stderr and exit EXIT_NO_DRIVER."""
    if connected.wait(wait_s):
        return
    print(f"stage {stage}: no driver at {address} within --wait-driver-s={wait_s:g} s; start the driver "
          f"(testbed run ... executor.launch=external) and then this stage again", file=sys.stderr, flush=True)
    os._exit(EXIT_NO_DRIVER)


def watch_driver(sock, stage: int, address: str) -> threading.Event:
    """Arm heartbeats and the disconnect watch on `sock` (call before `sock.connect`); the event
    is set once the driver's connection is made (a stage waits for it at most `--wait-driver-s`)."""
    import zmq

    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    connected = threading.Event()
    threading.Thread(target=_watch, args=(monitor, stage, address, connected), name="driver-watch",
                     daemon=True).start()
    return connected


def _watch(monitor, stage: int, address: str, connected: threading.Event) -> None:
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    try:
        while True:
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                connected.set()
            elif event == zmq.EVENT_DISCONNECTED and connected.is_set():
                break
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:  # a normal end terminates the context: poll raises ETERM
            if monitor.poll(100):
                monitor.recv_multipart()
    except zmq.ZMQError:  # the context is terminating: the stage is ending by itself
        monitor.close(linger=0)
        return
    print(f"stage {stage}: lost the driver at {address}; exiting (its ports are freed with it)",
          file=sys.stderr, flush=True)
    os._exit(EXIT_DRIVER_GONE)
