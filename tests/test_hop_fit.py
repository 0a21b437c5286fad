"""`calibrate runs --hop receive` (testbed/calibrate/hop_fit.py): a host hop and the ids' return
priced once, by what the engine's receive measured."""
from __future__ import annotations

import pytest

from testbed.calibrate.hop_fit import UNMEASURED_BW_GBS, fit_beyond_receive, price_hops_once
from testbed.calibrate.run_fit import RunFit

RECV = (0.5e-3, 2e-9)  # fixed s, s per byte


def _waited(extra):  # hops where the receiver waited: the receive's price + `extra(bytes, aware)`
    return [("decode", b, RECV[0] + RECV[1] * b + extra(b, aware), aware)
            for b in (10_000, 50_000, 200_000, 400_000) for aware in (False, True)]


def test_what_the_waited_hops_took_beyond_the_receive_is_the_link_and_the_metadata():
    lat, per_byte, meta = fit_beyond_receive(_waited(lambda b, aware: 3e-4 + 1e-9 * b + (0 if aware else 2e-3)), *RECV)
    assert (lat, per_byte, meta) == pytest.approx((3e-4, 1e-9, 2e-3), rel=1e-6)


def test_hops_that_took_the_receive_alone_leave_no_link_cost_and_no_metadata():
    assert fit_beyond_receive(_waited(lambda b, aware: 0.0), *RECV) == pytest.approx((0, 0, 0), abs=1e-12)
    assert fit_beyond_receive([], *RECV) == (0.0, 0.0, 0.0)


def test_the_return_is_the_measured_one_less_the_latency_the_simulator_adds_before_it():
    fit = RunFit({"recv_fixed_s": RECV[0], "recv_per_byte_s": RECV[1], "return_fixed_s": 0.45e-3},
                 p2p_bw_gbs=0.47, p2p_latency_s=0.57e-3)  # as `--hop link` left them
    added = price_hops_once(fit, _waited(lambda b, aware: 1e-4), [0.4e-3, 0.5e-3], base_latency_s=1e-5)
    assert fit.p2p_latency_s == pytest.approx(1e-4) and added == fit.p2p_latency_s
    assert fit.p2p_bw_gbs == UNMEASURED_BW_GBS and fit.coefficients["transfer_metadata_s"] == pytest.approx(0, abs=1e-12)
    assert fit.coefficients["return_fixed_s"] == pytest.approx(0.45e-3 - 1e-4)
    single = RunFit({"return_fixed_s": 0.4e-3})  # P=1: no hops; the base's latency comes before the return
    assert price_hops_once(single, [], [0.4e-3], base_latency_s=1e-4) == 1e-4
    assert single.coefficients == {"return_fixed_s": pytest.approx(0.3e-3)} and single.p2p_latency_s is None


def test_an_unknown_hop_mode_is_refused_before_any_work():
    from engine.base.errors import ConfigError
    from engine.pricing.hardware import get_hardware
    from testbed.calibrate.run_fit import fit_runs

    with pytest.raises(ConfigError, match="--hop='wire'.*link, receive"):
        fit_runs([], get_hardware("h100-80g"), hop="wire")
