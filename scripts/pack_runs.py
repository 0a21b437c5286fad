"""Pack the runs a manifest names into its runs.tar.xz, as measurements/ keeps them.

    python scripts/pack_runs.py measurements/cpu-tiny-llama/manifest.yaml <folder holding the run folders>

Every run the manifest names, its files as `testbed run` wrote them but: no figures (*.png), no
`output_token_ids` column in requests.csv (random weights' tokens, most of its bytes; nothing reads
them), and `trace.json` only for the runs some split fits on or diagnoses with (validate needs none). Deterministic
(sorted names, fixed owner, mode and time) so that the same runs give the same archive.
"""
from __future__ import annotations

import io
import lzma
import sys
import tarfile
from pathlib import Path

import pandas as pd
import yaml

MTIME = 1795737600  # 2026-11-27 00:00 UTC


def pack(manifest: Path, source: Path) -> Path:
    tree = yaml.safe_load(manifest.read_text())
    splits = tree["profiles"].values()
    fit = {r for s in splits for k in ("fit", "diagnosis") for r in s.get(k) or ()}  # the traces kept
    names = sorted({r for s in splits for k in ("fit", "validation", "test", "spent_test", "diagnosis") for r in s.get(k) or ()})
    out = manifest.parent / tree["runs"]
    with lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name in names:
            for f in sorted((source / name).iterdir()):
                # dot files: the marker an unpacked archive's runs carry (testbed/calibrate/run_checks.py)
                if f.suffix == ".png" or f.name.startswith(".") or (f.name == "trace.json" and name not in fit):
                    continue
                data = f.read_bytes()
                if f.name == "requests.csv":
                    buf = io.StringIO()
                    pd.read_csv(f).drop(columns=["output_token_ids"], errors="ignore").to_csv(buf, index=False)
                    data = buf.getvalue().encode()
                info = tarfile.TarInfo(f"runs/{name}/{f.name}")
                info.size, info.mtime, info.mode = len(data), MTIME, 0o644
                tar.addfile(info, io.BytesIO(data))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python scripts/pack_runs.py <manifest.yaml> <folder holding the run folders>")
    print(pack(Path(sys.argv[1]), Path(sys.argv[2])))
