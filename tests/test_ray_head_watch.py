"""Giving up on a Ray head is the command's own state (testbed/cluster/ray_head.py): the watch that
gave up says so, the `HeadLost` it raised says so past the loop, and nothing of it is left in the
process for its next command (a test, the tune worker 0 that is the parent process). No Ray needed:
the watch probes a closed port, `connected` gets a stand-in for the `ray` module."""
from __future__ import annotations

import socket
from contextlib import nullcontext

import pytest

from testbed.cluster import ray_backend, ray_head
from testbed.cluster.ray_head import HeadLost, HeadWatch, given_up


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_watch_that_gives_up_says_so_and_the_next_watch_starts_afresh(capsys):
    address = f"127.0.0.1:{_closed_port()}"
    watch = HeadWatch(address, "auto", window=0.0)
    with pytest.raises(HeadLost, match="ray.address='auto' stayed unreachable"):
        watch.check()
    assert watch.down and watch.given_up
    assert "warning: the Ray cluster's head" in capsys.readouterr().err
    assert not HeadWatch(address, "auto", window=60.0).given_up  # the next command's watch


def test_given_up_follows_the_error_a_head_lost_led_to():
    assert given_up(HeadLost("gone")) and not given_up(None) and not given_up(RuntimeError("other"))
    try:
        try:
            raise HeadLost("gone")
        except HeadLost:
            raise RuntimeError("the summary run's end failed") from None  # raised while handling it
    except RuntimeError as exc:
        assert given_up(exc)


class _Ray:
    """The part of the `ray` module `connected` uses."""

    def __init__(self) -> None:
        self.shutdowns = 0

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs) -> None:
        pass

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.mark.parametrize("raised, shutdowns", [(None, 1), (ValueError("a point failed"), 1), (HeadLost("gone"), 0)])
def test_connected_leaves_ray_alone_only_after_giving_up_on_its_head(monkeypatch, raised, shutdowns):
    ray = _Ray()
    monkeypatch.setattr(ray_backend, "import_ray", lambda: ray)
    monkeypatch.setattr(ray_backend, "probe", lambda address: None)
    monkeypatch.setenv(ray_head.RAY_LIMIT_ENV, "180")  # raise_ray_limit leaves a set value alone
    settings = ray_backend.SweepBackend(backend="ray", address="127.0.0.1:6379")
    with pytest.raises(type(raised)) if raised else nullcontext():
        with ray_backend.connected(settings):
            if raised:
                raise raised
    assert ray.shutdowns == shutdowns
