"""The driver's socketpair to a stage (engine/torch_exec/wire/lane.py): whole frames in order, however
the bytes arrive; a closed or corrupt line is an error, not a hang; a frame that fails the codec
or names another stage is dropped and reported."""
from __future__ import annotations

import threading

import pytest

from engine.torch_exec.wire import messages as wire
from engine.torch_exec.wire.lane import HEADER, DriverLanes, Lane, LaneClosed, StageLine

SECRET = bytes(range(32))


def test_frames_arrive_whole_and_in_order_across_partial_reads():
    lane, child = Lane.pair()
    other = Lane(child)
    big = bytes(range(256)) * 12_000  # 3 MB: several reads (READ_BYTES is 1 MiB)
    sender = threading.Thread(target=lambda: [other.send(f) for f in (b"a", big, b"", b"z" * 5)])
    sender.start()
    got = []
    while len(got) < 4:
        assert lane.poll(5.0)
        got += lane.frames()
    sender.join()
    assert got == [b"a", big, b"", b"z" * 5]
    child.sendall(HEADER.pack(3) + b"ab")  # a frame cut short: nothing until the rest arrives
    assert lane.poll(1.0) and lane.frames() == []
    child.sendall(b"c")
    assert lane.frames() == [b"abc"]


def test_a_closed_or_corrupt_lane_raises():
    lane, child = Lane.pair()
    child.sendall(HEADER.pack(2) + b"ok")
    child.close()
    assert lane.frames() == [b"ok"]  # what came before the close is still delivered
    with pytest.raises(LaneClosed):
        lane.frames()
    lane, child = Lane.pair()
    child.sendall(HEADER.pack(1 << 31))
    with pytest.raises(LaneClosed, match="corrupt"):
        lane.frames()


def test_driver_lanes_drop_frames_that_fail_the_codec_or_name_another_stage():
    driver = wire.Codec(SECRET, me="driver", run="r")
    lanes, ends = DriverLanes(), []
    for s in range(2):
        lane, child = Lane.pair()
        lanes.add(s, lane)
        ends.append(StageLine(None, Lane(child)))
        ends[-1].use_lane()
    stage0 = wire.Codec(SECRET, me="stage0", run="r")
    ends[0].send(stage0.encode(wire.Pong(0, 1.0)))
    ends[1].send(stage0.encode(wire.Pong(0, 2.0)))  # stage 0's frame on lane 1
    ends[1].send(b"\x00" * 40)  # not authentic
    dropped = []
    msgs, closed = lanes.messages(None, driver, lambda who, exc: dropped.append((who, str(exc))))
    assert msgs == [wire.Pong(0, 1.0)] and closed == []
    assert [who for who, _ in dropped] == ["stage 1's lane", "stage 1's lane"]
    assert "on stage 1's lane" in dropped[0][1] and "MAC" in dropped[1][1]
    lanes.lanes[0].send(driver.encode(wire.Stop(), to="stage0"))
    assert ends[0].frame(1.0) is not None and ends[0].frame(0.0) is None
