"""A declared split of real runs: which runs a profile is fitted on, which choose its options, which test it.

    testbed calibrate runs measurements/cpu-tiny-llama/manifest.yaml --profile cpu-tiny-llama-pp2-runs ...
    testbed validate --runs measurements/cpu-tiny-llama/manifest.yaml hardware=<profile> [--test]

Why: the H100 profiles of issue 35 had their cost-model pass, their refits, whether a profile table
joined the fit and the stall thresholds all chosen by looking at the held-out runs' errors; with one
or two held-out runs per workload those errors were optimistic. A manifest is committed before the
fit (git log shows the order) and names, per profile:

- `fit`: the runs `calibrate runs` fits on (nothing else is read for the fit);
- `validation`: the runs that choose the fit's options (`options:` lists the candidates, e.g.
  `table: [null, profiles/x.csv]`);
- `test`: the runs that say how good the chosen profile is. `validate --runs <manifest> --test`
  reports them and appends a line to `test_reports.log` beside the manifest; a second report of the
  same test runs says so (they have then been looked at twice: say it when quoting);
- `spent_test`: earlier test runs, already reported: a refit is tested on new runs declared as
  `test` before the refit, and the spent ones are neither fitted on, chosen on nor reported again
  (the CPU runs' first test set after the small-M term of 2026-11-27, docs/calibrate-runs.md);
- `diagnosis`: runs taken to find a mechanism (a simulator/engine disagreement) after the fit:
  read freely while diagnosing, never fitted on, chosen on or reported as test runs.

The runs live packed (`runs: runs.tar.xz`, a few MB) in the repository's measurements/ folder and are
unpacked once into a cache keyed by the archive's hash (`unpacked`). `runs:` may list several archives,
unpacked in order into one tree (a later one adds runs, or files such as a fit run's trace.json, to
it): a test set declared before it is taken names an archive that is not there yet, and only its
test runs may be missing until it is (`Manifest.absent`; `validate --test` then says so).
"""
from __future__ import annotations

import hashlib
import os
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.base.errors import ConfigError
from testbed.calibrate.run_checks import PACKED_MARKER

SETS = ("fit", "validation", "test")
SPENT = "spent_test"
DIAGNOSIS = "diagnosis"
PROFILE_KEYS = {"base", "options", SPENT, DIAGNOSIS, *SETS}
MEASUREMENTS_DIR = Path(__file__).resolve().parents[2] / "measurements"


@dataclass(frozen=True)
class Split:
    """One profile's declared split (module docstring)."""

    name: str
    base: str | None
    options: dict = field(default_factory=dict)
    fit: tuple[str, ...] = ()
    validation: tuple[str, ...] = ()
    test: tuple[str, ...] = ()
    spent_test: tuple[str, ...] = ()
    diagnosis: tuple[str, ...] = ()

    def set_of(self, run: str) -> str:
        return next(s for s in SETS if run in getattr(self, s))

    def runs(self, sets: tuple[str, ...] = SETS) -> tuple[str, ...]:
        return tuple(r for s in sets for r in getattr(self, s))


@dataclass(frozen=True)
class Manifest:
    path: Path
    runs_dir: Path
    profiles: dict[str, Split]
    absent: tuple[str, ...] = ()  # archives `runs:` lists that are not there yet (a declared test set)

    def split(self, profile: str | None) -> Split:
        if profile is None and len(self.profiles) == 1:
            return next(iter(self.profiles.values()))
        if profile not in self.profiles:
            raise ConfigError(f"--profile {profile!r} is not in {self.path}; valid choices: "
                              f"{', '.join(self.profiles)}")
        return self.profiles[profile]

    def run_dir(self, name: str) -> Path:
        return self.runs_dir / name

    def resolve(self, relative: str) -> Path:
        """A file the manifest names (a profile table), relative to its folder."""
        return (self.path.parent / relative).resolve()


def is_manifest(paths: list[str]) -> bool:
    """`--runs X.yaml` / `calibrate runs X.yaml`: one YAML file, not run directories."""
    return len(paths) == 1 and paths[0].endswith((".yaml", ".yml")) and Path(paths[0]).is_file()


def load_manifest(path: str | Path) -> Manifest:
    """Read and check a manifest: every run named once, in one set, and present in its archive."""
    import yaml

    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read manifest {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(tree, dict) or not isinstance(tree.get("profiles"), dict) or "runs" not in tree:
        raise ConfigError(f"manifest {path} needs `runs:` (a folder or .tar.xz) and `profiles:` (name -> split)")
    listed = tree["runs"] if isinstance(tree["runs"], list) else [tree["runs"]]
    archives = [path.parent / str(r) for r in listed]
    absent = tuple(a.name for a in archives if len(archives) > 1 and a.suffix == ".xz" and not a.exists())
    present = [a for a in archives if a.name not in absent]
    if not present:  # a set declared before any of its runs was packed
        raise ConfigError(f"manifest {path}: none of its archives exists yet ({', '.join(map(str, listed))}): "
                          f"pack its runs with scripts/pack_runs.py {path} <runs folder> <archive>")
    runs = present[0] if len(present) == 1 else path.parent
    runs_dir = runs if runs.is_dir() and len(present) == 1 else unpacked(present) if all(a.is_file() for a in present) else None
    if runs_dir is None or not runs_dir.is_dir():
        raise ConfigError(f"manifest {path}: runs {', '.join(map(str, listed))} is neither a folder nor an archive")
    profiles = {name: _split(path, str(name), body) for name, body in tree["profiles"].items()}
    for split in profiles.values():
        missing = [r for r in split.runs() + split.spent_test + split.diagnosis if not (runs_dir / r).is_dir()]
        if missing and not (absent and set(missing) <= set(split.test)):
            raise ConfigError(f"manifest {path}: {split.name} names runs not in {', '.join(map(str, listed))}: "
                              f"{', '.join(missing[:5])}")
    _register_profiles(path.parent / "profiles")
    return Manifest(path, runs_dir, profiles, absent)


def _register_profiles(folder: Path) -> None:
    """The profiles kept beside the runs (the `testbed profile` bases and the profiles fitted on
    them): `hardware=<name>` and `base:` find them once a manifest is read."""
    if folder.is_dir():
        from testbed.config.composer import _skip_profile
        from testbed.config.profiles import load_profiles_dir

        load_profiles_dir(folder, on_error=_skip_profile)


def _split(path: Path, name: str, body) -> Split:
    if not isinstance(body, dict) or set(body) - PROFILE_KEYS:
        bad = sorted(set(body) - PROFILE_KEYS) if isinstance(body, dict) else [type(body).__name__]
        raise ConfigError(f"manifest {path}: profile {name} has {', '.join(map(str, bad))}; valid keys: "
                          f"{', '.join(sorted(PROFILE_KEYS))}")
    sets = {s: tuple(str(r) for r in (body.get(s) or ())) for s in (*SETS, SPENT, DIAGNOSIS)}
    seen: dict[str, str] = {}
    for s, names in sets.items():
        for r in names:
            if r in seen:
                raise ConfigError(f"manifest {path}: run {r} is in both {seen[r]} and {s} of {name}")
            seen[r] = s
    if not sets["fit"]:
        raise ConfigError(f"manifest {path}: profile {name} has no fit runs")
    return Split(name, body.get("base"), dict(body.get("options") or {}), **sets)


def cache_root() -> Path:
    return Path(os.environ.get("TESTBED_CACHE_DIR") or Path.home() / ".cache" / "testbed") / "measurements"


def unpacked(archives: Path | list[Path]) -> Path:
    """The archives' folder tree, unpacked once, in order, into the cache (keyed by their content
    hash, so an updated archive is unpacked afresh); only regular files and folders, nothing outside it."""
    import shutil

    archives = [archives] if isinstance(archives, Path) else list(archives)
    archive = archives[0]
    blob = b"".join(a.read_bytes() for a in archives)
    digest = hashlib.sha256(blob + PACKED_MARKER.encode()).hexdigest()[:16]  # + the marker: caches unpacked before it differ
    dest = cache_root() / f"{archive.parent.name}-{digest}"
    if not (dest / ".unpacked").is_file():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for one in archives:
            with tarfile.open(one) as tar:
                tar.extractall(tmp, filter="data")
        for req in tmp.rglob("requests.csv"):  # the packer dropped the token ids (run_checks.check_real)
            (req.parent / PACKED_MARKER).write_text(str(archive))
        (tmp / ".unpacked").write_text(str(archive))
        try:
            tmp.rename(dest)  # atomic: a concurrent unpack of the same archive leaves one copy
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (dest / ".unpacked").is_file():
                raise ConfigError(f"cannot unpack {archive} into {dest}") from None
    inner = [p for p in dest.iterdir() if p.is_dir()]
    return inner[0] if len(inner) == 1 else dest


def test_set_id(split: Split) -> str:
    """A short hash of the test runs' names: the log tells one test set's reports from another's."""
    return hashlib.sha256("\n".join(split.test).encode()).hexdigest()[:8]


def record_test_report(manifest: Manifest, split: Split, hardware: str, version: str,
                       spread: float = 0.0) -> list[str]:
    """Append this test report to `test_reports.log` beside the manifest; the earlier lines for the
    same profile and test set (a test set looked at again after a refit is no longer untouched).
    Lines without `test_set=` predate it: they reported the runs now in `spent_test` if the split
    has any, else its `test`."""
    log = manifest.path.parent / "test_reports.log"
    ident = test_set_id(split)
    earlier = [ln for ln in (log.read_text().splitlines() if log.is_file() else []) if f" {split.name} " in ln
               and (f"test_set={ident}" in ln or ("test_set=" not in ln and not split.spent_test))]
    try:
        with log.open("a") as fh:
            fh.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {split.name} hardware={hardware} "
                     f"version={version} test_runs={len(split.test)} test_set={ident}"
                     f"{f' spread={spread:g}' if spread else ''}\n")
    except OSError:
        pass  # a read-only checkout: the report still prints
    return earlier
