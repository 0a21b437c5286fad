"""2026-11-28f: the timer relay (delay_relay.c mode "timer"), the rate-first layout, the outside lateness
measure (testbed/linkbench/lateness.py) and candidate M2's lost-burst recovery (engine/pricing/tcp_link.py)."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace

import pytest

from engine.pricing.tcp_link import TcpConnection, load_constants
from testbed.linkbench.fit import main as fit_main
from testbed.linkbench.lateness import matched, summary
from testbed.linkbench.netns import (RATE_FIRST_BURST_MAX, TBF_BURST_BYTES, DelayedLink, LinkSpec, rate_first_burst,
                                     relay_binary)


def test_the_relay_refuses_an_unknown_mode():
    r = subprocess.run([str(relay_binary()), "dly", "0.01", "fifo"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "valid choices: loop, timer" in r.stderr


def test_rate_first_bucket_is_two_ms_of_the_rate_within_its_bounds():
    assert rate_first_burst(60e6) == 15_000  # 2 ms at 60 Mbps
    assert rate_first_burst(400e6) == RATE_FIRST_BURST_MAX  # capped: a 32 KB GSO packet and its headers
    assert rate_first_burst(1e6) == TBF_BURST_BYTES


def test_lateness_is_the_hold_beyond_the_delay_and_backlog_what_was_held_at_arrival():
    delay = 0.010
    rows = [["dly", True, 1.000, "aa", 1000], ["dly", True, 1.001, "bb", 2000],
            ["dly", False, 1.0105, "aa", 1000], ["dly", False, 1.0140, "bb", 2000],
            ["dlz", True, 1.002, "aa", 60], ["dlz", False, 1.012, "aa", 60], ["dly", True, 1.5, "cc", 10]]
    got = {(p[4], p[0]): p for p in matched(rows, delay)}
    assert got[("dly", 1.000)][1] == pytest.approx(0.0005) and got[("dly", 1.000)][2] == 0
    assert got[("dly", 1.001)][1] == pytest.approx(0.003) and got[("dly", 1.001)][2] == 1000  # "aa" still held
    assert got[("dlz", 1.002)][2] == 0  # each device's backlog is its own
    assert len(got) == 3  # "cc" never came back: not counted
    bins = summary(list(got.values()))
    assert bins["0-64 KB"]["packets"] == 3 and bins["0-64 KB"]["max_ms"] == pytest.approx(3.0)


def test_a_lost_burst_costs_lost_window_rtts_per_cut_window_of_lost_bytes():
    base = replace(load_constants(), slow_burst_p=1.0, sender_Bps=1e18)  # the 2.1 MB burst is lost, certainly
    rate, d = 400e6 / 8, 0.025

    def second_transfer(c):
        conn = TcpConnection(rate, d, c)
        _, arrive = conn.send(0.0, 16 << 20)  # grows the window past what the queue takes at once
        start = arrive + 0.1  # shorter than an RTO: the window stays
        window = conn.window
        free, _ = conn.send(start, 16 << 20, lose_burst=True)
        assert conn.burst_p == 1.0
        return free - start, window, conn.window

    t0, w0, cut = second_transfer(base)
    t1, _, _ = second_transfer(replace(base, lost_window_rtts=2.0))
    lost = min(w0, 16 << 20) - base.queue_bytes  # at line speed the queue alone takes the burst
    assert lost > 0
    assert t1 - t0 == pytest.approx(2.0 * lost / cut * 2 * d, rel=1e-6)


def test_fit_refuses_lost_window_without_the_burst_loss(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text('{"provenance": {}, "rows": []}')
    assert fit_main([str(tmp_path / "p.json"), "--fit", str(f), "--lost-window"]) == 2
    assert "error: --lost-window" in capsys.readouterr().out


def test_rate_first_timer_link_gives_the_asked_round_trip():
    from test_linkbench_delay import _ping

    started: list = []
    delay = 0.010
    try:
        with DelayedLink(LinkSpec(400e6, delay, relay="c-timer", layout="rate-first")) as link:
            assert len(link.relays) == 2
            client = _ping(link, 20, 29469, started)
            rtt = float(client.communicate(timeout=30)[0])
            run = link.relay_snapshot()
    finally:
        for p in started:
            p.kill()
            p.wait()
    assert 2 * delay <= rtt < 2 * delay + 0.003, rtt
    assert run["late_max_s"] < delay, run


def test_lateness_refuses_an_output_it_cannot_write_before_measuring(tmp_path, capsys):
    from testbed.linkbench.lateness import main as lateness_main

    assert lateness_main([str(tmp_path / "no-such-folder" / "out.json")]) == 2
    assert capsys.readouterr().out.startswith("error: out ")
    assert lateness_main([str(tmp_path / "out.json"), "--figure", str(tmp_path / "nope" / "f.png")]) == 2
    assert "--figure" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()


def _synthetic_series(tmp_path, truth):
    """A series priced by `truth` (two rates, two delays, 1-16 MB): what a fit must give back."""
    from engine.pricing.tcp_modes import predict_series
    from testbed.linkbench.measure import validation_plan

    plan = validation_plan(sizes=(1 << 20, 4 << 20, 16 << 20))
    rows = [{"rate_bps": r, "delay_s": d, "n": p["n"], "msgs": p["msgs"], "gap_s": p["gap"]}
            for r in (200e6, 400e6) for d in (0.015, 0.035) for p in plan]
    rows = [dict(r, measured_s=t) for r, t in zip(rows, predict_series(rows, truth))]
    f = tmp_path / "syn.json"
    f.write_text(json.dumps({"provenance": {"synthetic": True}, "rows": rows}))
    return f, rows


def test_fit_one_outcome_lost_window_pins_the_chance_and_gives_the_series_back(tmp_path):
    """Candidate M3 (measurements/linkbench-2026-11-28g): `--burst-loss --lost-window` without --modes fits
    goodput, per-message, burst_loss_rtts, sender and lost_window_rtts with slow_burst_p exactly 1.0 (one
    outcome). Refused before 28g (exit 2). Transfers priced with known constants (lost_window_rtts 1.5
    moves 6 of the 28 points by 2-28%) are fitted back to within 1%, with lost_window_rtts recovered."""
    truth = replace(load_constants(), slow_burst_p=1.0, lost_window_rtts=1.5)
    f, rows = _synthetic_series(tmp_path, truth)
    out = tmp_path / "m3.json"
    assert fit_main([str(out), "--fit", str(f), "--burst-loss", "--lost-window"]) == 0
    got = load_constants(path=out)
    assert got.slow_burst_p == 1.0 and json.loads(out.read_text())["constants"]["slow_burst_p"] == 1.0
    assert got.lost_window_rtts == pytest.approx(1.5, rel=0.1)
    from engine.pricing.tcp_modes import predict_series
    assert max(abs(p / r["measured_s"] - 1) for p, r in zip(predict_series(rows, got), rows)) < 0.01


def test_fit_refuses_lost_window_with_a_measured_sender(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text('{"provenance": {}, "rows": []}')
    assert fit_main([str(tmp_path / "p.json"), "--fit", str(f), "--burst-loss", "--lost-window",
                     "--sender-Bps", "1e8"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: --lost-window") and out.count("\n") == 1
