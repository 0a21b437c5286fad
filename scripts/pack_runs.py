"""Pack the runs a manifest names into its runs.tar.xz, as measurements/ keeps them.

    python scripts/pack_runs.py measurements/cpu-tiny-llama/manifest.yaml <folder holding the run folders>
    python scripts/pack_runs.py <manifest listing runs: [a.tar.xz, b.tar.xz]> <folder> b.tar.xz

Every run the manifest names, its files as `testbed run` wrote them but: no figures (*.png), no
`output_token_ids` column in requests.csv (random weights' tokens, most of its bytes; nothing reads
them), and `trace.json` only for the runs some split fits on or diagnoses with (validate needs none). Deterministic
(sorted names, fixed owner, mode and time) so that the same runs give the same archive. Where `runs:`
lists several archives, the one named is packed with the named runs the folder holds, less the files
the other listed archives already hold (e.g. only the fit runs' trace.json, or a test set taken later).
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


def pack(manifest: Path, source: Path, archive: str | None = None) -> Path:
    tree = yaml.safe_load(manifest.read_text())
    splits = tree["profiles"].values()
    fit = {r for s in splits for k in ("fit", "diagnosis") for r in s.get(k) or ()}  # the traces kept
    names = sorted({r for s in splits for k in ("fit", "validation", "test", "spent_test", "diagnosis") for r in s.get(k) or ()})
    listed = tree["runs"] if isinstance(tree["runs"], list) else [tree["runs"]]
    if archive is None and len(listed) > 1 or archive is not None and archive not in listed:
        sys.exit(f"error: name the archive to pack, one of: {', '.join(map(str, listed))}")
    out = manifest.parent / (archive or listed[0])
    held = _held(manifest.parent, [a for a in listed if a != out.name])
    if len(listed) > 1:
        names = [n for n in names if (source / n).is_dir()]
    with lzma.open(out, "wb", preset=9 | lzma.PRESET_EXTREME) as xz, tarfile.open(fileobj=xz, mode="w") as tar:
        for name in names:
            for f in sorted((source / name).iterdir()):
                # dot files: the marker an unpacked archive's runs carry (testbed/calibrate/run_checks.py)
                if f.suffix == ".png" or f.name.startswith(".") or (f.name == "trace.json" and name not in fit):
                    continue
                if f"runs/{name}/{f.name}" in held:
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


def _held(folder: Path, archives: list[str]) -> set[str]:
    """The member names the other listed archives (those already there) hold."""
    held: set[str] = set()
    for a in archives:
        if (folder / a).is_file():
            with tarfile.open(folder / a) as tar:
                held.update(tar.getnames())
    return held


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python scripts/pack_runs.py <manifest.yaml> <folder holding the run folders> [<archive>]")
    print(pack(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] if len(sys.argv) == 4 else None))
