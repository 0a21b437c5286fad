"""Ends a host could not write: the local journal of the terminal states a command owed its shared
stores when it gave up on them (issue 48).

When the study's PostgreSQL is gone for good (longer than the reconnect window), a `tune` host
ends with one `error:` line, but the trial it was running and its MLflow runs (the study's and the
trial's) live in the database that is gone: they stayed RUNNING until another host's `tune`
reclaimed them (measured: 1 trial and 2 runs RUNNING after both hosts of the two-host study exit).
So what a host cannot write is written here instead, in its own output folder
(`<output.dir>/unwritten-ends.jsonl`, one JSON object a line, typed by `End`; never pickle), and
the first command of that folder that reaches the store again applies it:
- run ends: any command that opens an MLflow tracker on the same tracking URI (`testbed run`,
  `compare`, `capacity`, `tune`, ...; `Tracker.__init__`);
- trial ends: the next `tune` on that study (the only command that opens an Optuna study), before
  it reclaims anything, completing the trial from its recorded results where it has some.
An entry is dropped once applied, or when its row has been ended by someone else meanwhile (a
study run resumed by another host after the entry was written is left alone); a study run that
another host still holds (cluster/owners.py) is kept until that host is gone. Entries of other
stores are kept. No password is written: a store is named by its redacted URL."""
from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from testbed.config.redact import redact

FILE = "unwritten-ends.jsonl"
KINDS = ("trial", "run")
STATUSES = ("FAIL", "FAILED", "KILLED")


@dataclass(frozen=True)
class End:
    """One terminal state owed to a store: a trial (`study`, `trial_id`, `number`) told FAIL, or
    an MLflow run (`run_id`) ended FAILED or KILLED, with its `reason` (the error the host gave
    up on). `store`: the redacted storage or tracking URL; `at`: when the host gave up (epoch s)."""

    kind: str
    store: str
    reason: str
    status: str
    host: str
    at: float
    study: str = ""
    trial_id: int = -1
    number: int = -1
    run_id: str = ""
    session: str = ""  # the command that gave up (a study run's holder: cluster/owners.py)

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.status not in STATUSES:
            raise ValueError(f"bad entry kind={self.kind!r} status={self.status!r}")
        for f in fields(self):
            if not isinstance(getattr(self, f.name), {"str": str, "float": (int, float), "int": int}[f.type]):
                raise ValueError(f"bad entry field {f.name}={getattr(self, f.name)!r}")


def store_key(url: str) -> str:
    return redact(url)


def trial_end(storage_url: str, study: str, trial_id: int, number: int, reason: str) -> End:
    from testbed.cluster import identity

    return End("trial", store_key(storage_url), reason[:2000], "FAIL", identity.host_name(), time.time(),
               study=study, trial_id=int(trial_id), number=int(number))


def run_end(tracking_uri: str, run_id: str, reason: str, status: str, session: str = "") -> End:
    from testbed.cluster import identity

    return End("run", store_key(tracking_uri), reason[:2000], status, identity.host_name(), time.time(),
               run_id=run_id, session=session)


@contextmanager
def _locked(folder: Path) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / (FILE + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield folder / FILE
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record(folder: str | Path, *ends: End) -> None:
    """Append `ends` to the folder's journal. Best effort: a folder that cannot be written is one
    warning line (the rows then wait for the next command's reclaim, as before)."""
    if not ends:
        return
    try:
        with _locked(Path(folder)) as path, open(path, "a") as f:
            f.writelines(json.dumps(asdict(e), sort_keys=True) + "\n" for e in ends)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        print(f"warning: could not journal {len(ends)} unwritten end(s) in {folder}: {exc}", file=sys.stderr)


def read(path: Path) -> list[End]:
    """The journal's entries; a line that is not a valid entry is dropped (never executed)."""
    out = []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    for line in lines:
        try:
            raw = json.loads(line)
            out.append(End(**raw) if isinstance(raw, dict) else None)
        except (ValueError, TypeError):
            continue
    return [e for e in out if e is not None]


def pending(folder: str | Path, kind: str, store: str) -> list[End]:
    return [e for e in read(Path(folder) / FILE) if e.kind == kind and e.store == store_key(store)]


def settle(folder: str | Path | None, kind: str, store: str, apply: Callable[[End], str]) -> list[str]:
    """Apply the journal's `kind` entries of `store` (`apply(end)`: a note, "" when there was
    nothing left to end; raises when the store cannot take it now: the entry is kept). Returns
    the notes; applied entries leave the journal."""
    if folder is None or not (Path(folder) / FILE).exists():
        return []
    key, notes = store_key(store), []
    with _locked(Path(folder)) as path:
        keep = []
        for e in read(path):
            if e.kind != kind or e.store != key:
                keep.append(e)
                continue
            try:
                note = apply(e)
            except Exception:  # noqa: BLE001 - unreachable again: the next command tries
                keep.append(e)
                continue
            if note:
                notes.append(note)
        if keep:
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(asdict(e), sort_keys=True) + "\n" for e in keep))
            os.replace(tmp, path)
        else:
            path.unlink(missing_ok=True)
    return notes


class StillHeld(LookupError):
    """A journaled run end that must wait: another host still holds the run."""


def end_runs(folder: str | Path | None, tracker) -> list[str]:
    """Apply the run ends owed to `tracker`'s store (called when a tracker opens); a study run
    that another host still runs is left RUNNING and its entry kept (cluster/owners.py)."""
    from testbed.cluster import identity, owners

    def apply(e: End) -> str:
        try:
            run = tracker.client.get_run(e.run_id)
        except Exception as exc:  # noqa: BLE001
            if "RESOURCE_DOES_NOT_EXIST" in str(exc) or "not found" in str(exc).lower():
                return ""
            raise
        resumed = float(run.data.tags.get("testbed.resumed_at", "0") or 0)
        if run.info.status != "RUNNING" or resumed > e.at:
            return ""
        alive = owners.others_alive(tracker.client, e.run_id, e.session, identity.session_id())
        if alive:  # a study run another host still runs: kept until it has stopped (cluster/owners.py)
            raise StillHeld(f"MLflow run {e.run_id} is still held by {', '.join(alive)}")
        tracker.fail(e.run_id, e.reason, status=e.status)
        return (f"MLflow run {e.run_id} ended {e.status}: host {e.host} could not write it when it gave up "
                f"({e.reason[:200]})")

    return settle(folder, "run", tracker.uri, apply)


def end_trials(folder: str | Path | None, storage_url: str, study, recover: Callable[[object], bool],
               mark: Callable[[int, str], bool]) -> list[str]:
    """Apply the trial ends owed to this study (called by `tune` once it has opened the study,
    before it reclaims anything): a trial still RUNNING is completed from its recorded results
    (`recover`) where it has some, else failed with the recorded reason (`mark`: interrupted +
    FAILED, so it runs again)."""
    def apply(e: End) -> str:
        if e.study != study.study_name:
            raise LookupError("another study's entry")  # kept for that study's `tune`
        trial = next((t for t in study.get_trials(deepcopy=False) if t._trial_id == e.trial_id), None)
        if trial is None or trial.state.name != "RUNNING":
            return ""
        if recover(trial):
            return f"trial {trial.number}: completed from its recorded results (host {e.host} gave up before telling it)"
        if not mark(e.trial_id, e.reason):
            return ""
        return f"trial {trial.number}: failed (interrupted) as host {e.host} recorded when it gave up; it runs again"

    return settle(folder, "trial", storage_url, apply)
