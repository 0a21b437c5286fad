"""Scheduling policies: every module in this folder is imported, and each registers its policy
class in `engine.core.policy.POLICIES` with `@register_policy("name")`.

Adding a policy is one new file here (`policies/mypolicy.py`); `policy=mypolicy` then works in
`run`, `tune`, `compare` and both executors. Out-of-tree packages register theirs through the
`testbed.policies` entry-point group (`[project.entry-points."testbed.policies"]` in their
pyproject.toml, `mypolicy = "mypkg.mypolicy"`): each entry names a module to import.
Modules whose name starts with `_` are skipped.
"""
from __future__ import annotations

import pkgutil
import warnings
from importlib import import_module
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "testbed.policies"


def discover(package: str = __name__, path=None) -> list[str]:
    """Import every public module of `package` (default: this folder); returns their names."""
    names = sorted(m.name for m in pkgutil.iter_modules(path if path is not None else __path__)
                   if not m.name.startswith("_"))
    for name in names:
        import_module(f"{package}.{name}")
    return names


def load_entry_points(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """Import the modules that installed packages declare under `group`."""
    loaded = []
    for ep in entry_points(group=group):
        try:
            import_module(ep.value.split(":")[0])
        except Exception as exc:  # a broken plug-in must not break every command
            warnings.warn(f"policy plug-in {ep.name!r} ({ep.value}) failed to import and is skipped: "
                          f"{type(exc).__name__}: {exc}", stacklevel=2)
            continue
        loaded.append(ep.name)
    return loaded


discover()
load_entry_points()
