"""The TCP link model's arithmetic (engine/pricing/tcp_link.py) and its use by the simulator."""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest

from engine.pricing.tcp_link import LINUX_RTO_MIN_S, TcpConnection, TcpConstants, load_constants
from engine.pricing.tcp_modes import predict_series, tcp_links

C = TcpConstants(initial_window_bytes=14_480.0, goodput_fraction=0.95, per_message_s=1e-4)
B, D = 100e6 / 8, 0.03  # 100 Mbps, 30 ms one way


def fresh() -> TcpConnection:
    return TcpConnection(B, D, C)


def test_one_small_message_costs_the_delay():
    free, arrive = fresh().send(0.0, 1024, messages=1)
    assert arrive == pytest.approx(D + C.per_message_s + 1024 / (B * 0.95))
    assert arrive - free == pytest.approx(D)


def test_each_extra_gloo_message_costs_a_round_trip():
    one = fresh().send(0.0, 1024, messages=1)[1]
    three = fresh().send(0.0, 1024, messages=3)[1]
    assert three - one == pytest.approx(2 * (2 * D), rel=0.01)  # two rendezvous, each a round trip


def test_slow_start_waits_a_round_trip_per_window():
    iw = C.initial_window_bytes
    n = 3 * iw  # one window, then two: one stall
    arrive = fresh().send(0.0, n, messages=1)[1]
    assert arrive == pytest.approx(D + C.per_message_s + 2 * D + (n - iw) / (B * 0.95))


def test_the_window_grows_and_later_transfers_skip_slow_start():
    conn = fresh()
    first = conn.send(0.0, 1 << 20)[1]
    second = conn.send(first + 0.05, 1 << 20)
    assert first > D + (1 << 20) / (B * 0.95) + 2 * (2 * D)  # several rounds of slow start
    assert second[1] - (first + 0.05) == pytest.approx(D + C.per_message_s + (1 << 20) / (B * 0.95), rel=1e-6)


def test_long_transfers_run_at_the_goodput_rate():
    n = 256 << 20
    t = fresh().send(0.0, n)[1]
    assert t == pytest.approx(n / (B * 0.95), rel=0.02)


def test_restart_after_idle_halves_the_window_per_rto():
    conn = fresh()
    conn.send(0.0, 4 << 20)
    grown = conn.window
    rto = 2 * D + LINUX_RTO_MIN_S
    conn.restart_after_idle(conn.last_sent_s + 0.5 * rto)
    assert conn.window == grown  # shorter than an RTO: kept
    conn.restart_after_idle(conn.last_sent_s + 2.5 * rto)
    assert conn.window == pytest.approx(max(C.initial_window_bytes, grown / 4))
    conn.restart_after_idle(conn.last_sent_s + 1000.0)
    assert conn.window == C.initial_window_bytes


def test_a_series_is_one_connection_per_rate():
    rows = [{"rate_bps": 100e6, "delay_s": D, "n": 1 << 20, "msgs": 1, "gap_s": 0.1}] * 2
    first, second = predict_series(rows, C)
    assert second < first  # the second transfer finds a grown window


def test_the_shipped_constants_load_and_the_model_choice_is_checked():
    c = load_constants()
    assert c.initial_window_bytes > 0 and 0 < c.goodput_fraction <= 1 and c.source
    assert tcp_links("ideal", 2, B, D) is None
    assert len(tcp_links("tcp", 2, B, D)) == 2
    with pytest.raises(Exception, match="link.model"):
        tcp_links("netem", 2, B, D)


def test_a_burst_larger_than_the_queue_costs_recovery_round_trips_and_cuts_the_window():
    """A grown window sent at once after a pause overflows the bottleneck's queue (measured at
    400 Mbps / 30 ms with a 1,000-frame queue: 4 MB after a 4 MB transfer in 165-218 ms, not 118)."""
    small_q = dict(initial_window_bytes=14_480.0, goodput_fraction=0.95, per_message_s=1e-4, queue_bytes=100e3)
    plain, bursty = TcpConstants(**small_q), TcpConstants(**small_q, burst_loss_rtts=1.0)
    a, b = TcpConnection(B, D, plain), TcpConnection(B, D, bursty)
    for conn in (a, b):  # the same history: the window grows beyond the 100 KB queue
        conn.send(0.0, 2 << 20)
        conn.window = 1 << 20
        conn.ssthresh = math.inf
    start = a.last_sent_s + 0.1  # a pause shorter than an RTO: the window is kept
    ta, tb = a.send(start, 512 << 10)[1] - start, b.send(start, 512 << 10)[1] - start
    assert tb >= ta + 2 * D - 1e-9  # one recovery round trip more
    assert b.ssthresh < (1 << 20)  # Reno's cut
    small = TcpConnection(B, D, bursty)
    assert small.send(0.0, 50e3)[1] == pytest.approx(TcpConnection(B, D, plain).send(0.0, 50e3)[1])  # fits: no loss


def test_the_queue_may_scale_with_the_path():
    c = TcpConstants(initial_window_bytes=14_480.0, goodput_fraction=0.95, per_message_s=1e-4, queue_bytes=0.0,
                     queue_bdp=1.0)
    assert c.queue(3e6) == 3e6 and C.queue(3e6) == C.queue_bytes


def test_repeats_are_separate_connections_and_the_fit_targets_their_mean():
    from testbed.linkbench.fit import repeat_means

    row = {"rate_bps": 100e6, "delay_s": D, "n": 1 << 20, "msgs": 1, "gap_s": 0.1}
    rows = [dict(row, repeat=0, measured_s=0.2), dict(row, repeat=1, measured_s=0.4)]
    first, again = predict_series(rows, C)
    assert first == pytest.approx(again)  # a fresh connection each: slow start both times
    (mean,) = repeat_means(rows)
    assert mean["measured_s"] == pytest.approx(0.3) and mean["spread"] == pytest.approx(0.2 / 0.3)


@pytest.mark.parametrize("bad", [dict(initial_window_bytes=0.0), dict(goodput_fraction=1.5),
                                 dict(per_message_s=-1.0), dict(burst_loss_rtts=-1.0), dict(queue_bdp=-0.5),
                                 dict(loss_beta=1.0), dict(sender_Bps=0.0), dict(slow_burst_p=1.5),
                                 dict(slow_burst_p=-0.1)])
def test_bad_constants_are_refused(bad):
    kw = dict(initial_window_bytes=14_480.0, goodput_fraction=0.95, per_message_s=1e-4) | bad
    with pytest.raises(Exception):
        TcpConstants(**kw)


def test_the_simulator_prices_a_slow_link_by_tcp():
    """link.model=tcp over MoLink's link: the per-hop rendezvous and slow start make TTFT longer than
    the ideal pipe's; the ideal model is today's, unchanged."""
    from conftest import small_config
    from testbed.run.runner import run_experiment

    base = ["policy=vllm", "hardware=rtx4090", "model=qwen-7b", "parallel.pp=3", "workload.num_requests=12",
            "link.bandwidth=100Mbps", "link.latency=30ms"]
    ideal = run_experiment(small_config(*base)).summary
    tcp = run_experiment(small_config(*base, "link.model=tcp")).summary
    assert tcp["ttft_mean_s"] > ideal["ttft_mean_s"] + 4 * 0.03
    assert math.isfinite(tcp["tpot_mean_s"]) and tcp["tpot_mean_s"] > ideal["tpot_mean_s"]


def test_slow_start_grows_the_window_only_to_twice_what_was_in_flight():
    """Linux `tcp_is_cwnd_limited`: a 16 KB transfer on a 29 KB window leaves it at ~32 KB, not 45 KB,
    so 128 KB then takes two round trips before its last window (measured: 272 ms at 30 ms, 3
    messages; a window grown by every byte acknowledged gave one round trip less)."""
    conn = fresh()
    conn.window, conn.last_sent_s = 2 * C.initial_window_bytes, 0.0
    conn.send(0.1, 16384)
    assert conn.window == pytest.approx(2 * 16384)


Q = 1.5e6  # the harness's 1,000-frame queue, about


def _burst_conn(rate_Bps: float, delay_s: float, window: float, ssthresh: float) -> TcpConnection:
    c = TcpConstants(initial_window_bytes=14_480.0, goodput_fraction=1.0, per_message_s=0.0, queue_bytes=Q,
                     burst_loss_rtts=0.25)  # a sender far faster than the bottleneck: the queue alone absorbs
    conn = TcpConnection(rate_Bps, delay_s, c)
    conn.window, conn.ssthresh, conn.last_sent_s = window, ssthresh, 0.0
    return conn


def test_a_burst_loss_in_congestion_avoidance_halves_the_window():
    """Linux `tcp_reno_ssthresh` (cwnd / 2) of the window the loss was found at, at any rate and delay
    (the traces, 200 and 400 Mbps at 30 and 50 ms: 1.79-1.84 MB -> 0.90-0.92 MB)."""
    for rate, delay in ((25e6, 0.03), (50e6, 0.05)):
        conn = _burst_conn(rate, delay, 1.8e6, 1.8e6)
        conn.send(0.1, 4e6)
        assert conn.window == conn.ssthresh == pytest.approx(0.9e6)


def test_a_burst_loss_in_slow_start_cuts_half_of_the_window_grown_until_it_is_found():
    """Before the hole is found the bytes ahead of it (what the queue took) are acknowledged, and in
    slow start each grows the window (`tcp_slow_start`): 2.11 MB + ~1.5 MB -> 1.79 MB in the traces."""
    conn = _burst_conn(25e6, 0.03, 2.11e6, math.inf)
    conn.send(0.1, 4e6)
    assert conn.ssthresh == pytest.approx(0.5 * (2.11e6 + Q))


def test_a_lost_burst_crosses_at_the_bottleneck_rate_before_the_cut_window_applies():
    """The queue the burst filled keeps the bottleneck busy while it drains, then it idles until the
    retransmissions come (a round trip after the hole): the burst's bytes cross at the rate, and only
    the rest of the transfer runs at the cut window."""
    rate, delay = 25e6, 0.05
    conn = _burst_conn(rate, delay, 1.8e6, 1.8e6)
    took = conn.send(0.1, 4e6)[0] - 0.1
    rtt, cut = 2 * delay, 0.9e6
    rest = 4e6 - 1.8e6  # 2.2 MB at 0.9 MB a round trip: two round trips, then 0.4 MB at the rate
    idle = rtt - Q / rate  # the queue drains in 60 ms; the retransmissions come a round trip after the hole
    assert took == pytest.approx(0.25 * rtt + idle + 1.8e6 / rate + 2 * rtt + (rest - 2 * cut) / rate)


def test_slow_start_s_overshoot_cuts_to_what_the_path_holds():
    """The queue overflows when the window reaches what the path holds (BDP + queue); before the loss is
    found every byte in flight ahead of it is acknowledged and grows the window to twice that, and
    Reno halves it (measured at 10 ms / 400 Mbps: threshold 2.52 MB, path + queue 2.51 MB)."""
    c = TcpConstants(initial_window_bytes=14_480.0, goodput_fraction=1.0, per_message_s=0.0, queue_bytes=1e6)
    for delay in (0.01, 0.05):
        conn = TcpConnection(B, delay, c)
        conn.send(0.0, 64e6)
        assert conn.ssthresh == pytest.approx(B * 2 * delay + 1e6)


def test_slow_start_stops_at_the_threshold_without_a_loss():
    c = TcpConstants(initial_window_bytes=14_480.0, goodput_fraction=1.0, per_message_s=0.0, queue_bytes=1e6)
    conn = TcpConnection(B, D, c)
    conn.ssthresh = 0.2e6  # below what the path holds (0.75 MB + the queue)
    conn.send(0.0, 8e6)
    assert conn.ssthresh == 0.2e6 and conn.window == 0.2e6


def _two_speed(slow_burst_p: float) -> TcpConstants:
    """The harness's queue, a sender whose slow bursts reach the bottleneck at 200 MB/s."""
    return TcpConstants(initial_window_bytes=14_480.0, goodput_fraction=1.0, per_message_s=0.0, queue_bytes=Q,
                        burst_loss_rtts=0.25, sender_Bps=200e6, slow_burst_p=slow_burst_p)


def test_a_burst_is_lost_by_chance_only_where_it_fits_at_the_slow_speed():
    """400 Mbps: the queue alone takes 1.5 MB; at 200 MB/s it absorbs 1.5 / (1 - 50/200) = 2.0 MB."""
    c, rate = _two_speed(0.7), 50e6
    assert c.burst_loss_p(1.4e6, Q, rate) == 0.0  # the queue alone takes it
    assert c.burst_loss_p(1.9e6, Q, rate) == pytest.approx(0.3)  # lost only if it comes at line speed
    assert c.burst_loss_p(2.2e6, Q, rate) == 1.0  # lost at either speed
    assert c.absorbed(1.9e6, Q, rate) == Q  # lost at line speed: the queue took only its size
    assert c.absorbed(2.2e6, Q, rate) == pytest.approx(0.7 * 2.0e6 + 0.3 * Q)


def test_one_outcome_gives_the_deterministic_model_bit_for_bit():
    from engine.pricing.tcp_modes import TcpModes

    c = _two_speed(1.0)
    one, modes = TcpConnection(50e6, 0.03, c), TcpModes(50e6, 0.03, c)
    t = 0.0
    for n in (1 << 20, 1 << 20, 4 << 20, 4 << 20, 16 << 20):
        assert modes.send(t, n) == one.send(t, n)
        assert len(modes.modes) == 1
        t = one.last_sent_s + 0.1


def test_an_uncertain_burst_is_priced_as_the_mean_of_its_two_outcomes():
    from engine.pricing.tcp_modes import TcpModes

    c = _two_speed(0.7)
    modes = TcpModes(50e6, 0.03, c)
    (_, conn), = modes.modes
    conn.window, conn.last_sent_s = 1.9e6, 0.0  # a window that fits only at the slow speed
    lost, kept = copy.copy(conn), copy.copy(conn)
    t_lost, t_kept = lost.send(0.1, 4e6, lose_burst=True)[1], kept.send(0.1, 4e6, lose_burst=False)[1]
    assert t_lost > t_kept and lost.window < kept.window
    assert modes.send(0.1, 4e6)[1] == pytest.approx(0.3 * t_lost + 0.7 * t_kept)
    assert sorted(w for w, _ in modes.modes) == pytest.approx([0.3, 0.7])


def test_the_modes_stay_few_and_their_chances_add_to_one():
    from engine.pricing.tcp_modes import MAX_MODES, TcpModes

    modes = TcpModes(50e6, 0.03, _two_speed(0.5))
    t = 0.0
    for i in range(12):
        t = modes.send(t + 0.1, (1 << 20) if i < 2 else (4 << 20))[0]
    assert 1 < len(modes.modes) <= MAX_MODES
    assert sum(w for w, _ in modes.modes) == pytest.approx(1.0)


@pytest.mark.slow  # ~80 s at load 9 on the shared 2-core machine (nine Nelder-Mead starts, then two with slow_burst_p)
def test_the_refit_writes_the_shipped_profile_byte_for_byte(tmp_path):
    """From the repository's measurements and its declared split (measurements/linkbench-2026-11-28b/
    manifest.yaml: fit and validation series, all taken on 2026-11-28 by link46d; the test series
    are never fitted on)."""
    import tarfile

    import yaml

    from testbed.linkbench.fit import main

    folder = Path(__file__).resolve().parents[1] / "measurements" / "linkbench-2026-11-28b"
    split = yaml.safe_load((folder / "manifest.yaml").read_text())
    for source in split["sources"]:
        if (folder / source).is_file():  # only the fit and validation files are read
            with tarfile.open(folder / source) as tar:
                tar.extractall(tmp_path, filter="data")
    path = lambda name: str(next(tmp_path.rglob(name)))
    args = [str(tmp_path / "out.json")] + [x for f in split["fit"] for x in ("--fit", path(f))]
    args += [x for f in split["validation"] for x in ("--check", path(f))] + ["--burst-loss", "--modes"]
    assert main(args) == 0
    shipped = Path(__file__).resolve().parents[1] / "engine" / "pricing" / "link_profiles" / "gloo-tcp.json"
    assert (tmp_path / "out.json").read_bytes() == shipped.read_bytes()


def test_refitting_the_burst_chance_alone_recovers_it_and_keeps_the_other_constants():
    """`fit --only-slow-burst-p` (measurements/linkbench-2026-11-28e): transfers priced with a known chance
    are fitted back to it, every other constant untouched."""
    from dataclasses import replace

    from testbed.linkbench.fit import fit_slow_burst_p
    from testbed.linkbench.measure import validation_plan

    base = load_constants()
    truth = replace(base, slow_burst_p=0.2)
    plan = validation_plan(sizes=(1 << 20, 4 << 20, 16 << 20))
    rows = [{"rate_bps": 400e6, "delay_s": 0.03, "n": p["n"], "msgs": p["msgs"], "gap_s": p["gap"]} for p in plan]
    rows = [dict(r, measured_s=t) for r, t in zip(rows, predict_series(rows, truth))]
    got = fit_slow_burst_p(rows, base)
    assert got.slow_burst_p == pytest.approx(0.2, abs=0.02)
    assert replace(got, slow_burst_p=base.slow_burst_p) == base


def test_refitting_the_burst_chance_alone_refuses_other_fit_options(tmp_path, capsys):
    from testbed.linkbench.fit import main

    series = tmp_path / "s.json"
    series.write_text('{"provenance": {}, "rows": []}')
    assert main([str(tmp_path / "o.json"), "--fit", str(series), "--only-slow-burst-p", "--modes"]) == 2
    assert capsys.readouterr().out.startswith("error: --only-slow-burst-p")
