"""Who holds a shared MLflow run: a study's run, which every host running `tune` on the study
uses at once (issue 48). One host's end of it (Ctrl-C, giving up on a service, a journaled end
its folder's next command applied: cluster/unwritten.py) marked it KILLED or FAILED while
another host was still running the study.

Each `tune` command holds the study run while it runs (`holding`): a tag
`testbed.owner.<session>` records its host, pid, pid namespace and a beat (wall-clock time)
that a thread renews every beat, and is removed when the command ends. A run may
be ended KILLED or FAILED only when no other holder is alive (`others_alive`); a holder is gone
when its beat is older than its grace, or when its pid names a dead process of this pid
namespace (identity.dead_local_process). Otherwise the run is left RUNNING for the hosts still
on it, the last of which ends it. The beats go through the raw MLflow client (no reconnect
wait): a beat the store does not take is skipped, so a holder whose store stayed away longer
than its grace counts as gone; should it come back, its own end of the run is written last.
Hosts compare beats across machines by wall clock: keep their clocks in sync (NTP) well inside
the grace (60 s by default, `tune.grace_period`).

The beat and the grace are the study's own (`beat_of`: `tune.heartbeat` and `tune.grace_period`,
cluster/heartbeat.py), not settings of their own; the holder's beat is still a second signal beside
Optuna's trial heartbeats, because it marks another thing in another store:
- a heartbeat says that a *trial* has a live worker, in the study's database; a holder says that a
  `tune` *command* still runs the study, in the MLflow store. A command holds the run while none
  of its trials is running (between two trials, waiting at the end for other hosts' trials in
  tune/reclaim.py `settle`, a Ray driver whose trials run in other processes): a reader of trial
  heartbeats would count it gone there and end the run under it;
- the run is ended where only the MLflow store is at hand: a journaled end applied by the
  folder's next `testbed run` (cluster/unwritten.py) opens no study database;
- SQLite and journal storages have no heartbeats (a dead local worker is found by its pid); the
  run's holders beat there too, every `heartbeat.DEFAULT_INTERVAL_S`: two `tune` commands on one
  SQLite study share its run as two hosts do (tests/test_shared_study_run.py)."""
from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from testbed.cluster import identity
from testbed.cluster.heartbeat import DEFAULT_INTERVAL_S, Heartbeat

PREFIX = "testbed.owner."


def tag_key(session: str) -> str:
    return PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", session)[:200]


def beat_of(hb: Heartbeat) -> tuple[float, float]:
    """(beat, grace) in seconds of a holder of the study's run: the study's heartbeat interval
    (`heartbeat.DEFAULT_INTERVAL_S` where its trials have none) and its grace period, at least
    three beats. A trial taken for dead too early is run again; a holder taken for gone too early
    has the shared run ended FAILED or KILLED under the hosts still on it, so a user's
    `tune.grace_period` under three beats is not followed that far here (the default grace,
    `heartbeat.default_for`, is at least three beats already)."""
    beat = float(hb.interval) if hb.on else float(DEFAULT_INTERVAL_S)
    return beat, max(float(hb.grace), 3 * beat)


def record(beat_s: float, grace_s: float) -> dict[str, Any]:
    """This process as a holder, beating now."""
    return {"host": identity.host_name(), "pid": os.getpid(), "namespace": identity.local_namespace(),
            "beat": time.time(), "grace": grace_s, "every": beat_s}


def gone(rec: dict, now: float | None = None) -> bool:
    """A holder whose beat is older than its grace, or whose process (of this namespace) is dead."""
    now = time.time() if now is None else now
    if identity.dead_local_process({"namespace": rec.get("namespace"), "pid": rec.get("pid")}):
        return True
    beat, grace = rec.get("beat"), rec.get("grace")
    if not isinstance(beat, (int, float)) or not isinstance(grace, (int, float)):
        return True  # not a record this code wrote
    return now - beat > grace


def holders(tags: dict[str, str]) -> dict[str, dict]:
    """tag key -> record, for the run's holder tags that parse."""
    out = {}
    for key, value in tags.items():
        if not key.startswith(PREFIX):
            continue
        try:
            rec = json.loads(value)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out[key] = rec
    return out


def others_alive(client: Any, run_id: str, *sessions: str) -> list[str]:
    """The hosts of the run's live holders other than `sessions` (this command's by default)."""
    mine = {tag_key(s) for s in (sessions or (identity.session_id(),)) if s}
    tags = client.get_run(run_id).data.tags
    return sorted({str(rec.get("host", "?")) for key, rec in holders(tags).items() if key not in mine and not gone(rec)})


def end_shared(tracker: Any, run_id: str, status: str, reason: str | None = None) -> bool:
    """End the shared run `status` (FAILED, KILLED) unless another host still holds it; True
    when it was ended. `reason` goes to its `error` tag."""
    alive = others_alive(tracker.client, run_id)
    if alive:
        print(f"note: the study's MLflow run {run_id} stays RUNNING: host(s) {', '.join(alive)} still run the study "
              f"(the last one ends it)", file=sys.stderr, flush=True)
        return False
    if reason is None:
        tracker.client.set_terminated(run_id, status)
    else:
        tracker.fail(run_id, reason, status=status)
    return True


@contextmanager
def holding(tracker: Any, run_id: str | None, hb: Heartbeat) -> Iterator[None]:
    """Hold the shared run `run_id` for the block, beating as `beat_of(hb)` says for the study's
    heartbeat `hb` (nothing without a tracker or run)."""
    if tracker is None or not run_id:
        yield
        return
    beat_s, grace_s = beat_of(hb)
    client = getattr(tracker.client, "_client", tracker.client)  # no reconnect wait: a missed beat is skipped
    key, stop = tag_key(identity.session_id()), threading.Event()

    def beat() -> None:
        try:
            client.set_tag(run_id, key, json.dumps(record(beat_s, grace_s)))
        except Exception:  # noqa: BLE001 - the store is away: the beat is skipped
            pass

    def loop() -> None:
        while not stop.wait(beat_s):
            beat()

    beat()
    _tidy(client, run_id)
    thread = threading.Thread(target=loop, name="study-run-holder", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=beat_s + 5)
        try:
            client.delete_tag(run_id, key)
        except Exception:  # noqa: BLE001 - left behind: it goes stale with its beat, or its pid
            pass


def _tidy(client: Any, run_id: str) -> None:
    """Remove the tags of holders that are gone (a host that gave up could not remove its own)."""
    try:
        for key, rec in holders(client.get_run(run_id).data.tags).items():
            if gone(rec):
                client.delete_tag(run_id, key)
    except Exception:  # noqa: BLE001 - tidying only
        pass
