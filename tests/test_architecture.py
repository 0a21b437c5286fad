"""Import direction between the packages, checked on the source with `ast` (no imports run).

    engine/    the bottom: imports nothing from testbed/, policies/, workloads/
    policies/  may import engine/, never testbed/ or workloads/
    workloads/ may import engine/, never testbed/ or policies/
    testbed/   the top: may import everything
Besides: engine/ and policies/ never import optuna or mlflow (tuning and tracking live in
testbed/), and engine/ outside engine/torch_exec/ and policies/ never import torch (the
controller, the simulator and every policy run without it). Function-local imports count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FORBIDDEN = {  # package -> top-level modules it must not import
    "engine": {"testbed", "policies", "workloads", "optuna", "mlflow", "ray"},  # Ray: testbed/cluster/ only
    "policies": {"testbed", "workloads", "optuna", "mlflow", "torch", "ray"},
    "workloads": {"testbed", "policies"},
}
TORCH_FREE_EXCEPT = "engine/torch_exec/"  # the only part of engine/ that may import torch
# Known debt, listed so that nothing new slips in and so that the entry must go once it is fixed
# (test_known_violations_still_exist fails then). Empty: TD-Pipe's history readers moved to
# workloads/history.py and reach the policy through `view.history` (engine/policy.py).
KNOWN: set[tuple[str, str]] = set()


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in the file, also inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def violations(package: str, known=frozenset()) -> list[str]:
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        forbidden = set(FORBIDDEN[package])
        if package == "engine" and not rel.startswith(TORCH_FREE_EXCEPT):
            forbidden.add("torch")
        for line, mod in imported_modules(path):
            if mod in forbidden and (rel, mod) not in known:
                bad.append(f"{rel}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    assert violations(package, KNOWN) == []


def test_known_violations_still_exist():
    """Each KNOWN entry is real; delete it from KNOWN when its import is gone."""
    found = {(v.split(":")[0], v.rsplit(" ", 1)[1]) for pkg in FORBIDDEN for v in violations(pkg)}
    assert KNOWN <= found, f"fixed, remove from KNOWN: {sorted(KNOWN - found)}"


def test_the_checker_sees_function_local_and_from_imports(tmp_path):
    """The check can fail: a nested `from testbed.x import y` and `import torch.nn` are found."""
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from testbed.runner import run\n    import torch.nn as nn\n"
                   "from . import sibling\n")
    assert sorted(imported_modules(src)) == [(1, "os"), (4, "testbed"), (5, "torch")]
