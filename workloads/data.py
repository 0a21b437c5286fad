"""Finding workload data files without shipping them in the repository.

`resolve_data_file("azure/AzureLLMInferenceTrace_conv.csv")` looks, in this order:

1. an explicit path (a workload's `path` setting): if given it must exist, no fallback, so a
   typo is never papered over by another copy of the data;
2. the `data_dir` argument (the CLI's --data-dir), laid out like shared/data (`azure/`, `sharegpt/`);
3. `$TESTBED_DATA_DIR`, same layout (CI points it at shared/data);
4. the cache: `$TESTBED_CACHE_DIR`, else `$XDG_CACHE_HOME/testbed/data` (`~/.cache/testbed/data`
   when XDG_CACHE_HOME is unset), same layout;
5. for the Azure traces only: a download of the public original into the cache, checked against
   its sha256 (a mismatch deletes the file and is an error). Set `TESTBED_ALLOW_DOWNLOAD=0` to
   forbid it (tests do). ShareGPT pairs are never downloaded: their rights are unclear, so they
   are built locally with `testbed data sharegpt` (see `workloads.sharegpt_build`).

A file found nowhere raises `DataNotFoundError` listing every place looked and how to get it.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

from engine.base.errors import DataNotFoundError

log = logging.getLogger(__name__)

DATA_DIR_ENV = "TESTBED_DATA_DIR"
CACHE_DIR_ENV = "TESTBED_CACHE_DIR"
ALLOW_DOWNLOAD_ENV = "TESTBED_ALLOW_DOWNLOAD"

AZURE_URL = "https://raw.githubusercontent.com/Azure/AzurePublicDataset/master/data/{file}"
# relpath -> (url, sha256) of the public originals (Azure LLM inference traces 2023, CC BY 4.0).
DOWNLOADS: dict[str, tuple[str, str]] = {
    "azure/AzureLLMInferenceTrace_conv.csv": (
        AZURE_URL.format(file="AzureLLMInferenceTrace_conv.csv"),
        "2f1e5b666d4e3055fdbba98598ce2ec307767b9064e03e2fa46676dbcc7d0bf8"),
    "azure/AzureLLMInferenceTrace_code.csv": (
        AZURE_URL.format(file="AzureLLMInferenceTrace_code.csv"),
        "54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6"),
}
SHAREGPT_PAIRS = "sharegpt/sharegpt_pairs.jsonl.gz"


def cache_dir() -> Path:
    """The data cache (layout as shared/data): `$TESTBED_CACHE_DIR`, else `testbed/data` under the
    XDG base directory `$XDG_CACHE_HOME` (`~/.cache` when unset or not absolute, as the spec says)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path("~/.cache").expanduser()
    return base / "testbed" / "data"


def downloads_allowed() -> bool:
    return os.environ.get(ALLOW_DOWNLOAD_ENV, "1").strip() != "0"


_FALLBACKS_SAID: set[tuple[str, str]] = set()


def _say_fallback(data_dir: str | os.PathLike, relpath: str, used: Path) -> None:
    """`data_dir=/nonexistent` fell back to the other folders without a word (issue 48 item 7):
    said once per folder and file, on stderr."""
    import sys

    key = (str(data_dir), relpath)
    if key not in _FALLBACKS_SAID:
        _FALLBACKS_SAID.add(key)
        print(f"warning: data_dir={data_dir} has no {relpath}; read {used} instead", file=sys.stderr, flush=True)


def resolve_data_file(relpath: str, explicit_path: str | os.PathLike | None = None,
                      data_dir: str | os.PathLike | None = None) -> Path:
    """The path of data file `relpath` (e.g. "azure/AzureLLMInferenceTrace_conv.csv")."""
    if explicit_path is not None:
        path = Path(explicit_path).expanduser()
        if path.is_file():
            return path
        raise DataNotFoundError(f"data file {path} (given explicitly as workload.path) does not exist")

    looked: list[str] = []
    env_dir = os.environ.get(DATA_DIR_ENV)
    for label, base in (("data_dir argument", data_dir), (f"${DATA_DIR_ENV}", env_dir),
                        ("cache", cache_dir())):
        if not base:
            looked.append(f"{label}: not set")
            continue
        path = Path(base).expanduser() / relpath
        if path.is_file():
            if label != "data_dir argument" and data_dir:
                _say_fallback(data_dir, relpath, path)
            return path
        looked.append(f"{label}: {path} (missing)")

    if relpath in DOWNLOADS:
        dest = cache_dir() / relpath
        if downloads_allowed():
            url, sha = DOWNLOADS[relpath]
            return download(url, dest, sha)
        looked.append(f"download into {dest}: disabled ({ALLOW_DOWNLOAD_ENV}=0)")
    else:
        looked.append("download: not offered for this file")

    how = (f"set {DATA_DIR_ENV} (or pass a data dir) to a folder laid out as azure/..., sharegpt/...")
    if relpath.startswith("sharegpt/"):
        how += "; or build the ShareGPT pairs into the cache with `testbed data sharegpt`"
    elif relpath in DOWNLOADS:
        how += f"; or allow the download ({ALLOW_DOWNLOAD_ENV} unset or 1) on a machine with internet access"
    raise DataNotFoundError(f"data file {relpath} not found; looked in: " + "; ".join(looked) + f". To get it: {how}")


def _open_url(url: str, timeout: float = 60.0):
    """The one network call (a seam tests replace, so they never touch the network)."""
    import urllib.request  # here: importing it (http, ssl, email) costs more than all of workloads

    return urllib.request.urlopen(url, timeout=timeout)  # noqa: S310 - fixed https URLs above


def download(url: str, dest: Path, sha256: str) -> Path:
    """Download `url` to `dest` atomically; a sha256 mismatch deletes the file and raises."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s to %s", url, dest)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, _open_url(url) as resp:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != sha256:
            raise DataNotFoundError(f"download of {url} has sha256 {digest.hexdigest()}, expected {sha256}; "
                                    f"deleted it. Get the file by hand and set {DATA_DIR_ENV}")
        shutil.move(tmp, dest)
    except OSError as exc:  # URLError, timeouts and disk errors are all OSError
        raise DataNotFoundError(f"could not download {url} to {dest}: {exc}. "
                                f"Set {DATA_DIR_ENV} to a folder holding {dest.parent.name}/{dest.name}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return dest
