"""A fitted profile is never lost to a late write error (issue 48 item 3): kept in the temporary
folder, the error says where (testbed/run/out_checks.py does the same for other results)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from testbed.run.out_checks import ResultKept


def save_profile_or_keep(spec, target: Path, provenance: dict) -> Path:
    """`save_hardware_profile`, kept in the temporary folder when the write fails (ResultKept)."""
    from testbed.calibrate.fit import save_hardware_profile

    try:
        return save_hardware_profile(spec, target, provenance)
    except OSError as exc:
        fd, kept = tempfile.mkstemp(prefix=f"testbed-{target.stem}-", suffix=".yaml")
        os.close(fd)
        save_hardware_profile(spec, Path(kept), provenance)
        raise ResultKept(f"the fitted profile could not be written to {target} ({exc.strerror or exc}); "
                         f"it is kept in {kept}") from None
