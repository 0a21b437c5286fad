"""Import direction between the packages, checked on the source with `ast` (no imports run).

    engine/    the bottom: imports nothing from testbed/, policies/, workloads/
    policies/  may import engine/, never testbed/ or workloads/
    workloads/ may import engine/, never testbed/ or policies/
    testbed/   the top: may import everything
Besides: engine/ and policies/ never import optuna or mlflow (tuning and tracking live in
testbed/), and engine/ outside engine/torch_exec/ and policies/ never import torch (the
controller, the simulator and every policy run without it). Function-local imports count too.

No import cycles between modules, in any package (`test_no_import_cycles`): every import counts,
at module level, inside a function, under `if TYPE_CHECKING:` or `try:`. A deferred import hides a
cycle from Python, not from the reader: the two modules still cannot be understood, tested or
moved apart, so this check makes no exception for them. A cycle is reported as a strongly
connected component of the module graph with the imports that close it.
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
# workloads/history.py and reach the policy through `view.history` (engine/core/policy.py).
KNOWN: set[tuple[str, str]] = set()
# Known import cycles (module sets), listed so that no new one slips in and so that each entry must
# go once its cycle is broken (test_known_cycles_still_exist fails then). testbed/ is being split
# into folders by another change, which removes these.
KNOWN_CYCLES: set[frozenset[str]] = set()
CYCLE_PACKAGES = ("engine", "policies", "workloads", "testbed")


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
    src.write_text("import os\n\ndef f():\n    from testbed.run.runner import run\n    import torch.nn as nn\n"
                   "from . import sibling\n")
    assert sorted(imported_modules(src)) == [(1, "os"), (4, "testbed"), (5, "torch")]


# --- import cycles between modules ----------------------------------------------------------------
def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest prefix of a dotted name that is one of our modules (`engine.core.kv.BlockManager` ->
    `engine.core.kv`), None for a third-party or standard module."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def module_imports(path: Path, name: str, modules: set[str]) -> dict[str, int]:
    """{imported module of ours: first line} for one file, every import counted (see the module doc).
    `from pkg import sub` names the submodule `pkg.sub` when it is one, else `pkg` itself."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            found = _resolve(target, modules)
            if found and found != name:
                out.setdefault(found, node.lineno)
    return out


def import_graph(root: Path = ROOT, packages=CYCLE_PACKAGES) -> dict[str, dict[str, int]]:
    paths = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    names = set(paths)
    return {name: module_imports(path, name, names) for name, path in paths.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next((w for w in edges if w not in index or w in on_stack), None)
            if nxt is not None and nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt is not None:
                low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.add(w)
                        if w == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def describe(component: frozenset[str], graph: dict[str, dict[str, int]]) -> str:
    edges = [f"{a}:{line} -> {b}" for a in sorted(component) for b, line in sorted(graph[a].items())
             if b in component]
    return " <-> ".join(sorted(component)) + " (" + "; ".join(edges) + ")"


def test_no_import_cycles():
    graph = import_graph()
    new = [describe(c, graph) for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert new == [], "import cycles (break them: move what both need to a module below both):\n" + \
        "\n".join(new)


def test_known_cycles_still_exist():
    """Each KNOWN_CYCLES entry is real; delete it when its cycle is broken."""
    gone = KNOWN_CYCLES - set(cycles(import_graph()))
    assert not gone, f"fixed, remove from KNOWN_CYCLES: {sorted(sorted(c) for c in gone)}"


def test_the_cycle_check_sees_deferred_and_relative_imports(tmp_path):
    """The check can fail: a cycle closed by an import inside a function, one under
    `if TYPE_CHECKING:` and one relative import are all found; an acyclic chain is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    (pkg / "e.py").write_text("import pkg.a\nimport os\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg.a": 2} and graph["pkg.c"] == {"pkg.d": 3}
    assert sorted(sorted(c) for c in cycles(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
