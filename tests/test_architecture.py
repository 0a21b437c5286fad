"""Import direction between the packages, checked on the source with `ast` (no imports run).

    engine/    the bottom: imports nothing from testbed/, policies/, workloads/
    policies/  may import engine/, never testbed/ or workloads/
    workloads/ may import engine/, never testbed/ or policies/
    testbed/   the top: may import everything
Besides: engine/ and policies/ never import optuna or mlflow (tuning and tracking live in
testbed/), and engine/ outside engine/torch_exec/ and policies/ never import torch (the
controller, the simulator and every policy run without it). Function-local imports count too.

Inside engine/, sub-packages are floors (`ENGINE_FLOORS`, `test_engine_layering`): base, then
pricing, then core, then the simulator and the torch engine (whose tensors, kernels and graphs
sit below the rest of it); a module imports only its own floor and the floors it lists. Inside
testbed/, the folders are floors too (`TESTBED_FLOORS`, `test_testbed_layering`): a folder
imports only the folders before it, so a lower folder never calls back into a command, not even
from inside a function.

No import cycles between modules, in any package (`test_no_import_cycles`): every import counts,
at module level, inside a function, under `if TYPE_CHECKING:` or `try:`. A package's `__init__`
is a module too: `from pkg import x` runs and reads `pkg/__init__.py` (an edge to `pkg`, besides
`pkg.x` when that is a submodule), and importing `a.b.c` from outside `a.b` runs the `__init__`
of each package above it. A deferred import hides a
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


# --- floors inside engine/ and testbed/ -----------------------------------------------------------
# engine/: each sub-package -> the sub-packages it may import (besides itself). Every module of
# engine/ (but its empty __init__) sits in one of them.
ENGINE_FLOORS: dict[str, set[str]] = {
    "engine.base": set(),  # errors, units, typed settings, the registry
    "engine.pricing": {"engine.base"},  # the cost model and its tables
    "engine.core": {"engine.base", "engine.pricing"},  # a micro-batch's shape is what pricing reads
    "engine.simulator": {"engine.base", "engine.pricing", "engine.core"},
    "engine.torch_exec.tensors": set(),
    "engine.torch_exec.kernels": {"engine.torch_exec.tensors"},
    "engine.torch_exec.graphs": {"engine.torch_exec.tensors", "engine.torch_exec.kernels"},
    # the real engine by process: the wire and the weights import neither side; a stage never
    # imports the driver's side; the driver reaches a stage only through its entry point (STAGE_ENTRY)
    "engine.torch_exec.settings": {"engine.base"},  # the executor.* keys, torch-free, read by every process
    "engine.torch_exec.weights": {"engine.base", "engine.pricing"},
    "engine.torch_exec.wire": {"engine.base", "engine.core", "engine.torch_exec.weights"},
    "engine.torch_exec.shared": {"engine.base", "engine.torch_exec.wire", "engine.torch_exec.graphs"},
    "engine.torch_exec.stage": {"engine.base", "engine.pricing", "engine.core", "engine.torch_exec.settings",
                                "engine.torch_exec.weights", "engine.torch_exec.wire", "engine.torch_exec.shared",
                                "engine.torch_exec.tensors", "engine.torch_exec.kernels", "engine.torch_exec.graphs"},
    "engine.torch_exec.driver": {"engine.base", "engine.pricing", "engine.core", "engine.torch_exec.settings",
                                 "engine.torch_exec.weights", "engine.torch_exec.wire", "engine.torch_exec.shared",
                                 "engine.torch_exec.stage"},
    "engine.torch_exec": {"engine.core", "engine.torch_exec.settings", "engine.torch_exec.driver"},  # registers it
}
# testbed/: its parts bottom-up; each imports only itself and the parts before it (the commands
# reach each other sideways only downwards: capacity's live probe is `bench serve`, reproduce runs
# capacity studies). `testbed` is the package's own empty __init__.
TESTBED_FLOORS = ("testbed", "signals", "linkbench", "config", "cluster", "tracking", "run", "sweep", "tune", "bench",
                  "serve", "calibrate", "capacity", "reproduce", "studies", "cli")


def _named(targets: dict[str, int]) -> list[tuple[str, int]]:
    """The imported modules, less the packages only run on the way to one of them (one line each)."""
    return sorted((t, line) for t, line in targets.items() if not any(o.startswith(t + ".") for o in targets))


def _floor_of(module: str, floors) -> str | None:
    return max((f for f in floors if module == f or module.startswith(f + ".")), key=len, default=None)


def climbing_in_engine(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        if not mod.startswith("engine.") or mod.count(".") == 0:
            continue
        own = _floor_of(mod, ENGINE_FLOORS)
        if own is None:
            bad.append(f"{mod} is in no engine sub-package ({', '.join(ENGINE_FLOORS)})")
            continue
        for target, line in _named(targets):
            floor = _floor_of(target, ENGINE_FLOORS)
            if floor is not None and floor != own and floor not in ENGINE_FLOORS[own]:
                bad.append(f"{mod}:{line} imports {target} ({own} may import {sorted(ENGINE_FLOORS[own])})")
    return bad


def part_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "testbed"


def climbing_in_testbed(graph: dict[str, dict[str, int]]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        if mod.split(".")[0] != "testbed":
            continue
        part = part_of(mod)
        if part not in TESTBED_FLOORS:
            bad.append(f"{mod}: testbed/{part} is not in TESTBED_FLOORS")
            continue
        for target, line in _named(targets):
            if target.split(".")[0] == "testbed" and \
                    TESTBED_FLOORS.index(part_of(target)) > TESTBED_FLOORS.index(part):
                bad.append(f"{mod}:{line} imports {target}: testbed/{part_of(target)} is above testbed/{part}")
    return bad


def write_tree(root: Path, files: dict[str, str]) -> None:
    """Source files for the self-tests: {relative path: text}."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_engine_layering():
    assert climbing_in_engine(import_graph()) == []


TORCH_SIDES = ("engine.torch_exec.driver", "engine.torch_exec.stage")
STAGE_ENTRY = {"engine.torch_exec.stage", "engine.torch_exec.stage.worker"}  # `stage_main`, what a process runs


def driver_reaching_into_stage(graph: dict[str, dict[str, int]]) -> list[str]:
    """The driver's side starts stage processes and nothing more: it imports the stage's side only
    at its entry point, so nothing of a stage's internals runs in the controller's process."""
    return [f"{mod}:{line} imports {target}" for mod, targets in sorted(graph.items())
            if _floor_of(mod, ENGINE_FLOORS) == TORCH_SIDES[0]
            for target, line in _named(targets)
            if _floor_of(target, ENGINE_FLOORS) == TORCH_SIDES[1] and target not in STAGE_ENTRY]


def test_the_driver_reaches_a_stage_only_through_its_entry_point():
    assert driver_reaching_into_stage(import_graph()) == []


def test_the_torch_engine_layering_can_fail(tmp_path):
    """The checks can fail: a stage importing the driver's diagnosis, the wire importing a stage's
    model, the weights importing the wire, the driver importing a stage's sampler are each found."""
    pkgs = ["engine", "engine/torch_exec", "engine/torch_exec/stage", "engine/torch_exec/driver",
            "engine/torch_exec/wire", "engine/torch_exec/weights"]
    write_tree(tmp_path, {**{f"{p}/__init__.py": "" for p in pkgs},
                          "engine/torch_exec/stage/worker.py": "from engine.torch_exec.driver.diagnosis import X\n",
                          "engine/torch_exec/stage/sampling.py": "",
                          "engine/torch_exec/driver/diagnosis.py": "X = 1\n",
                          "engine/torch_exec/driver/stage_processes.py":
                              "def f():\n    from engine.torch_exec.stage.worker import stage_main\n"
                              "    from engine.torch_exec.stage.sampling import Sampler\n",
                          "engine/torch_exec/wire/messages.py": "import engine.torch_exec.stage.sampling\n",
                          "engine/torch_exec/weights/checkpoint.py": "import engine.torch_exec.wire.messages\n"})
    graph = import_graph(tmp_path, ("engine",))
    assert climbing_in_engine(graph) == [
        "engine.torch_exec.stage.worker:1 imports engine.torch_exec.driver.diagnosis (engine.torch_exec.stage may "
        f"import {sorted(ENGINE_FLOORS['engine.torch_exec.stage'])})",
        "engine.torch_exec.weights.checkpoint:1 imports engine.torch_exec.wire.messages (engine.torch_exec.weights "
        f"may import {sorted(ENGINE_FLOORS['engine.torch_exec.weights'])})",
        "engine.torch_exec.wire.messages:1 imports engine.torch_exec.stage.sampling (engine.torch_exec.wire may "
        f"import {sorted(ENGINE_FLOORS['engine.torch_exec.wire'])})"]
    assert driver_reaching_into_stage(graph) == [
        "engine.torch_exec.driver.stage_processes:3 imports engine.torch_exec.stage.sampling"]


def test_each_torch_engine_part_says_which_process_runs_it():
    """Every sub-package of engine/torch_exec/ opens with a one-line docstring naming its process."""
    words = ("driver", "stage", "process")
    for init in sorted((ROOT / "engine/torch_exec").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and "\n" not in doc and any(w in doc for w in words), init.relative_to(ROOT).as_posix()


def test_testbed_layering():
    assert climbing_in_testbed(import_graph()) == []


def test_the_layering_checks_see_function_level_imports(tmp_path):
    """The checks can fail: an import inside a function that climbs a floor is found, in engine/
    (pricing -> core) and in testbed/ (config -> a command); one going down is not."""
    write_tree(tmp_path, {"engine/__init__.py": "", "engine/core/__init__.py": "", "engine/pricing/__init__.py": "",
                          "engine/core/batch.py": "from engine.pricing.costmodel import BatchShape\n",
                          "engine/pricing/costmodel.py": "def f():\n    from engine.core.batch import MicroBatch\n",
                          "testbed/__init__.py": "", "testbed/config/__init__.py": "", "testbed/run/__init__.py": "",
                          "testbed/config/composer.py": "def g():\n    import testbed.run.plots\n",
                          "testbed/run/plots.py": "from testbed.config.composer import g\n"})
    graph = import_graph(tmp_path, ("engine", "testbed"))
    assert climbing_in_engine(graph) == [
        "engine.pricing.costmodel:2 imports engine.core.batch (engine.pricing may import ['engine.base'])"]
    assert climbing_in_testbed(graph) == [
        "testbed.config.composer:2 imports testbed.run.plots: testbed/run is above testbed/config"]


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
        if isinstance(node, ast.ImportFrom) and base in modules:
            targets.append(base)  # `from pkg import x` runs and reads pkg/__init__.py
        for target in targets:
            found = _resolve(target, modules)
            if found:
                targets_with_packages = [found] + _packages_above(found, name, modules)
                for t in targets_with_packages:
                    if t != name:
                        out.setdefault(t, node.lineno)
    return out


def _packages_above(target: str, importer: str, modules: set[str]) -> list[str]:
    """The packages whose `__init__` importing `target` runs, less the importer's own packages
    (already initialised before the importer runs, so no new edge)."""
    parts = target.split(".")
    own = {".".join(importer.split(".")[:i]) for i in range(1, importer.count(".") + 2)}
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
            if p in modules and p not in own]


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
    write_tree(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import x\n",
                          "pkg/b.py": "def f():\n    from pkg import a\n",
                          "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import y\n",
                          "pkg/d.py": "import pkg.c\n", "pkg/e.py": "import pkg.a\nimport os\n"})
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg": 2, "pkg.a": 2} and graph["pkg.c"] == {"pkg.d": 3}
    assert sorted(sorted(c) for c in cycles(graph)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def test_the_cycle_check_sees_package_init_files(tmp_path):
    """The check can fail: a package whose `__init__` imports (even lazily) a module that reads the
    package (`from pkg import sibling`) is a cycle; `import pkg.sibling` inside the package is
    not."""
    write_tree(tmp_path, {"pkg/__init__.py": "def make():\n    from pkg.driver import run\n",
                          "pkg/driver.py": "from pkg import wire\n", "pkg/wire.py": "",
                          "pkg/other.py": "import pkg.wire\n"})
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.driver"] == {"pkg": 1, "pkg.wire": 1} and graph["pkg.other"] == {"pkg.wire": 1}
    assert cycles(graph) == [frozenset({"pkg", "pkg.driver"})]
