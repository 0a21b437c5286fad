"""A Ray head that dies under a sweep or a study: Ray's core worker ended the driver after 60 s
with exit 1 and no `error:` line, leaving the summary run and a point run RUNNING (issue 48
service probes). testbed/cluster/ray_watch.py gives up on the head first and raises `HeadLost`
in the main thread, where the command ends its runs. The real head's death is probed by
scripts/service_probes.py --only ray."""
from __future__ import annotations

import socket
import time

import pytest

from testbed.cluster import ray_watch


def test_a_head_that_stops_answering_is_given_up_in_the_main_thread(monkeypatch):
    monkeypatch.setattr(ray_watch, "CHECK_S", 0.1)
    monkeypatch.setattr(ray_watch, "LOST_S", 0.3)
    head = socket.socket()
    head.bind(("127.0.0.1", 0))
    head.listen(8)
    address = f"127.0.0.1:{head.getsockname()[1]}"
    with pytest.raises(ray_watch.HeadLost, match="stopped answering"):
        with ray_watch.watched(address, "auto") as state:
            time.sleep(0.5)  # alive: nothing happens
            assert not state["lost"]
            head.close()  # the head dies
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the main thread polling Ray, as a sweep does
                time.sleep(0.05)
    assert state["lost"]


def test_a_live_head_is_left_alone(monkeypatch):
    monkeypatch.setattr(ray_watch, "CHECK_S", 0.1)
    monkeypatch.setattr(ray_watch, "LOST_S", 0.3)
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen(8)
        with ray_watch.watched(f"127.0.0.1:{head.getsockname()[1]}", "auto") as state:
            time.sleep(0.8)
    assert not state["lost"]
