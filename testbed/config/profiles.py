"""Saved hardware profiles: the YAML files `testbed profile` / `testbed calibrate` write
(testbed/calibrate/fit.py), read back at start-up so that `hardware=<name>` finds them: the ones
shipped in engine/pricing/hardware_profiles/, then the user's $TESTBED_PROFILE_DIR. Reading them is
configuration, so it lives here, below the commands (config/ imports no command)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

from engine.base.errors import ConfigError
from engine.pricing.cost_coefficients import CostCoefficients
from engine.pricing.hardware import HARDWARE, SHIPPED_DIR, HardwareSpec, register_hardware

HW_FIELDS = tuple(f.name for f in fields(HardwareSpec))
# Profiles shipped with the repository (a measured GPU: `testbed profile ... --out engine/pricing/hardware_profiles`),
# registered at start-up before the user's $TESTBED_PROFILE_DIR (docs/profiling.md#on-a-gpu-machine).
SHIPPED_PROFILES_DIR = SHIPPED_DIR  # engine/pricing/hardware_profiles/


# path -> (the file's identity when read, its spec): every config compose loads the profile
# folders, and parsing their YAML again took 35 of the 140 ms a compose cost
_LOADED: dict[Path, tuple[tuple[int, int, int], HardwareSpec]] = {}


def load_hardware_profile(path: str | Path) -> HardwareSpec:
    """The profile in `path`, parsed again only when the file changed (inode, size or mtime)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return _parse_hardware_profile(path)  # reports the unreadable file
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    cached = _LOADED.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    spec = _parse_hardware_profile(path)
    _LOADED[path] = (stamp, spec)
    return spec


def _parse_hardware_profile(path: Path) -> HardwareSpec:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read hardware profile {path}: {str(exc).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"hardware profile {path}: expected a mapping of HardwareSpec fields")
    data.pop("profile", None)
    unknown = sorted(set(data) - set(HW_FIELDS))
    if unknown:
        raise ConfigError(f"hardware profile {path}: unknown keys {', '.join(unknown)}")
    cal = data.get("calibration")
    if cal is not None:
        valid = {f.name for f in fields(CostCoefficients)}
        bad = sorted(set(cal) - valid)
        if bad:
            raise ConfigError(f"hardware profile {path}: unknown calibration keys {', '.join(bad)}")
        CostCoefficients(**cal)  # validates ranges
    try:
        return HardwareSpec(**data)
    except TypeError as exc:
        raise ConfigError(f"hardware profile {path}: {exc}") from None


def load_profiles_dir(directory: str | Path, on_error: Callable[[Path, ConfigError], None] | None = None
                      ) -> list[str]:
    """Register every `*.yaml` hardware profile in `directory` not registered yet. Returns the names
    added. A profile whose name equals an already registered one with the same content is skipped;
    a different one under a table GPU's name is refused by `register_hardware`. With `on_error`,
    a file that cannot be loaded is reported to it and skipped (one broken file must not break
    every command); without, its ConfigError propagates."""
    d = Path(directory)
    added = []
    if not d.is_dir():
        return added
    for p in sorted(d.glob("*.yaml")):
        try:
            spec = load_hardware_profile(p)
        except ConfigError as exc:
            if on_error is None:
                raise
            on_error(p, exc)
            continue
        have = HARDWARE.get(spec.name)
        if have is not None:
            if have == spec:
                continue
            if have.calibration is not None:  # a re-saved profile: the newest file wins
                HARDWARE[spec.name] = spec
                added.append(spec.name)
                continue
        try:
            register_hardware(spec)
        except ConfigError as exc:
            if on_error is None:
                raise
            on_error(p, exc)
            continue
        added.append(spec.name)
    return added
