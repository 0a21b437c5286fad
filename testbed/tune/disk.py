"""A full disk under `tune` (issue 48 item 5): the output folder of a study on PostgreSQL or a journal
file was refused as "not a writable directory" when it only did not exist yet; a full disk (or a
file-size limit) was a traceback from SQLite or a file write. Now the folder is made first, and a
full disk is one `error:` line, exit 1 (the study's trials are where the storage put them)."""
from __future__ import annotations

import errno
import os
from pathlib import Path

from engine.base.errors import TestbedError

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
SQLITE_FULL = "database or disk is full"


class DiskFull(TestbedError):
    """No room left where the command writes: not a user error in the command line (exit 1)."""

    exit_code = 1


def disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) says the disk, a quota or a file-size limit is full."""
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not e for e in seen):
        if isinstance(cur, OSError) and cur.errno in FULL or SQLITE_FULL in str(cur):
            return True
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return False


def full_disk_error(exc: BaseException, out_dir: str | os.PathLike) -> DiskFull:
    where = getattr(exc, "filename", None) or Path(out_dir).expanduser()
    text = str(exc).strip().splitlines()
    return DiskFull(f"no room left to write under {where} ({text[0][:200] if text else type(exc).__name__}): free "
                    f"space (or raise the quota / file-size limit), then run the same command again")
