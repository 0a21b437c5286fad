"""Outputs of the calibration and bench commands, checked before their work and kept after it (issue 48
item 3): `calibrate tables --out /dev/null` and `--save /proc/nope` crashed after 190-210 s of
fitting, `bench engine --json` on an unwritable path after 92 s of measuring, the figures lost;
`calibrate runs --name ../../evil` wrote outside `--out`.

`writable_dir` / `writable_file` are called first thing (one `error:` line naming the option, exit 2);
`write_or_keep` writes a result and, when the write fails anyway (a disk that filled meanwhile),
puts the text in the temporary folder and says where in the error."""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from engine.base.errors import ConfigError, TestbedError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,127}")


class ResultKept(TestbedError):
    """A computed result could not be written where asked; it was kept elsewhere (exit 1)."""

    exit_code = 1


def plain_name(option: str, name: str) -> str:
    """A file name inside the output folder: no folders, no `..`, no leading dot."""
    if not NAME.fullmatch(name) or ".." in name:
        raise ConfigError(f"invalid {option}={name!r}: a plain name (letters, digits, . _ + -, no '/' or '..'), "
                          f"written inside the output folder")
    return name


def writable_dir(option: str, path: str | os.PathLike, shown: str | os.PathLike | None = None) -> Path:
    """Create `path` (with its parents) and prove it takes a file, before any work (`shown`: the
    value the user gave, when `path` is its folder)."""
    p = Path(path).expanduser()
    said = f"invalid {option}={str(shown if shown is not None else path)!r}"
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{said}: {'its folder ' + str(p) + ' is' if shown else 'it is'} a file, not a folder")
    try:
        p.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".write-check-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{said}: cannot write {'in ' + str(p) if shown else 'there'} "
                          f"({exc.strerror or exc})") from None
    return p


def writable_file(option: str, path: str | os.PathLike) -> Path:
    """`path` can be written as a regular file (its folder is created), before any work; an
    existing file is left as it is."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise ConfigError(f"invalid {option}={str(path)!r}: it is a folder, not a file")
    if p.exists() and not p.is_file():
        raise ConfigError(f"invalid {option}={str(path)!r}: not a regular file (a device or a pipe)")
    writable_dir(option, p.parent, shown=path)
    if p.exists() and not os.access(p, os.W_OK):
        raise ConfigError(f"invalid {option}={str(path)!r}: the file is not writable")
    return p


def write_or_keep(path: Path, text: str, what: str) -> Path:
    """Write `text` to `path`; if that fails, keep it in the temporary folder and raise ResultKept
    naming both (the result is never lost to a late write error)."""
    return _keep(path, text, what, lambda: (path.parent.mkdir(parents=True, exist_ok=True), path.write_text(text)))


def _keep(path: Path, text: str, what: str, write: Callable[[], object]) -> Path:
    try:
        write()
        return path
    except OSError as exc:
        fd, kept = tempfile.mkstemp(prefix=f"testbed-{path.stem}-", suffix=path.suffix or ".txt")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        raise ResultKept(f"{what} could not be written to {path} ({exc.strerror or exc}); it is kept in {kept}") from None

