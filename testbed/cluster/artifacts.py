"""Where a run's files go. With a tracking server (`output.tracking_uri=http://...`) the
experiment is created without an artifact location, so the server picks its own: with
`mlflow server --artifacts-destination DIR` (proxied artifacts, MLflow's default
`--serve-artifacts`) that is `mlflow-artifacts:/<experiment id>`, and every client uploads and
lists files through the server. A local folder (`<output.dir>/mlartifacts`) only for a local
store: given to a server, it was the folder of whichever host created the experiment, the
server's store stayed empty, and other hosts listed 0 files without an error (issue 24 item 1).

Logging files never leaves a run RUNNING: `log_files` returns the error as text (the caller tags
the run `artifact_error` and goes on) instead of crashing the command with the run open."""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from engine.base.errors import TestbedError

SERVER_SCHEMES = ("http://", "https://")


class ArtifactStoreError(TestbedError, OSError):
    """The artifact store refused a run's files (an unwritable folder, a server's HTTP 500): one
    line, exit 1. An OSError too, as the local store's own failure was before."""

    exit_code = 1


def experiment_location(tracking_uri: str, local_root: str | None) -> str | None:
    """The artifact location to create an experiment with: None (the server's) for a tracking
    server, else the local folder."""
    if tracking_uri.startswith(SERVER_SCHEMES):
        return None
    return local_root


def log_files(client: Any, run_id: str, paths: Iterable[Path], folders: Iterable[tuple[Path, str]] = ()) -> str | None:
    """Log files (and whole folders under a name) on a run; None, or the first error as one line
    with the run tagged `artifact_error`."""
    try:
        for path in paths:
            client.log_artifact(run_id, str(path))
        for folder, name in folders:
            client.log_artifacts(run_id, str(folder), name)
    except Exception as exc:  # OSError of an unwritable store, an HTTP error of a server
        text = one_line(exc)
        try:
            client.set_tag(run_id, "artifact_error", text)
        except Exception:
            pass
        return text
    return None


def one_line(exc: BaseException) -> str:
    """An artifact store's error as one line: MLflow's HTTP errors span a page."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:1000]
