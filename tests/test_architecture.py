"""The import graph of phaze_opt: packages point one way, no package imports itself in a circle.

Every module under phaze_opt is parsed with `ast`; its imports (at module level and inside
functions alike) are resolved to phaze_opt modules, and so are modules loaded by name
(`importlib.import_module("phaze_opt.x...")`, an f-string's fixed prefix naming the package). The
checks, and docs/architecture.md, use the layer order below: a unit (a top-level module or a
subpackage) may import units of a lower layer, and inside its own layer only the units listed before
it (so two units of one layer never import each other both ways); never a unit above it. And no
module uses another module's private (underscore) name: what two modules share is public in one.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent / "phaze_opt"

# Lowest first. Keep in step with docs/architecture.md.
LAYERS = (
    ("errors", "activity", "interrupt", "jsonable", "cache", "configs", "training", "torus", "system", "figures"),
    ("workload", "hardware"),
    ("solve",),
    ("design",),
    ("runs",),
    ("search",),
    ("experiments", "validation"),
    ("commands",),
    ("cli", "study", "compare", "__main__", "cli_reference"),
)
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}
RANK = {unit: (i, j) for i, units in enumerate(LAYERS) for j, unit in enumerate(units)}

# Packages in which no function may import a phaze_opt module (an import inside a function there
# would only hide a cycle). Elsewhere such imports are listed with their reason.
NO_LAZY_IMPORTS = ("design", "runs", "search", "experiments")
LAZY_IMPORTS_ALLOWED = {
    # The commands import their work when they run, so `phaze-opt --help` and every other command
    # start without torch, the solvers or MLflow.
    "phaze_opt.commands.*": "a command imports its work when it runs (fast start-up)",
    # torch is imported only when a graph is really traced (a disk-cached graph needs none of it).
    "phaze_opt.workload.graphs": "the layers and the tracer import torch; only an extraction needs them",
    # `import phaze_opt` stays light: optuna and pandas load when a notebook asks for a study's table.
    "phaze_opt": "phaze_opt.results imports the study reader when it is called",
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "phaze_opt"]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if target.split(".")[0] != "phaze_opt":
        return []
    out = []
    for alias in node.names:  # `from pkg import module` imports the module
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in known else target)
    return out


def _loaded_by_name(node: ast.Call) -> str | None:
    """The phaze_opt module (or, for an f-string, the package its fixed prefix names) that an
    `importlib.import_module(...)` call loads; None for any other call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    if name != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = arg.value
    elif isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        text = str(arg.values[0].value).rstrip(".")
    else:
        return None
    return text if text.split(".")[0] == "phaze_opt" else None


def import_graph(root: Path = ROOT) -> tuple[nx.DiGraph, list[tuple[str, str, int]]]:
    """(module -> imported module graph, [(module, imported, line) of imports inside functions])."""
    # presets/ is data shipped with the package (a measuring script among it), not a module of it
    modules = {_module_name(p, root): p for p in sorted(root.rglob("*.py")) if "presets" not in p.relative_to(root).parts}
    known = set(modules)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    lazy = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        in_function: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                in_function.update(id(n) for n in ast.walk(node) if n is not node)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                target = _loaded_by_name(node)
                if target is not None:
                    while target not in known and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target in known and target != name:
                        graph.add_edge(name, target)
                continue
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _resolve(name, is_package, node, known):
                if target in known and target != name:
                    graph.add_edge(name, target)
                    if id(node) in in_function:
                        lazy.append((name, target, node.lineno))
    return graph, lazy


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package(module: str) -> str:
    """The package a module belongs to."""
    return module.rsplit(".", 1)[0]


def layering_violations(graph: nx.DiGraph) -> list[str]:
    out = []
    for a, b in graph.edges:
        ua, ub = _unit(a), _unit(b)
        if ua == ub or ua == "phaze_opt" or ub == "phaze_opt":
            continue
        if ua not in LAYER or ub not in LAYER:
            out.append(f"{a} -> {b}: unit {ua if ua not in LAYER else ub} has no layer; add it to LAYERS")
        elif LAYER[ub] > LAYER[ua]:
            out.append(f"{a} -> {b}: {ua} (layer {LAYER[ua]}) imports {ub} (layer {LAYER[ub]}) above it")
        elif RANK[ub] > RANK[ua]:
            out.append(f"{a} -> {b}: {ua} imports {ub}, listed after it in layer {LAYER[ua]} (one way only)")
    units = nx.DiGraph()
    units.add_edges_from((_unit(a), _unit(b)) for a, b in graph.edges if _unit(a) != _unit(b))
    out += [f"units import each other in a circle: {' -> '.join(c + [c[0]])}" for c in nx.simple_cycles(units)]
    return out


def package_cycles(graph: nx.DiGraph) -> list[list[str]]:
    cycles = []
    for pkg in sorted({_package(m) for m in graph.nodes}):
        members = [m for m in graph.nodes if _package(m) == pkg]
        cycles += [sorted(c) for c in nx.simple_cycles(graph.subgraph(members))]
    return cycles


# Packages with a public face (`__init__` and its `__all__`): the units above them import its names,
# never its modules, so the modules inside may be split or renamed without touching their callers.
FACES = ("runs", "search")


def face_violations(graph: nx.DiGraph) -> list[str]:
    out = []
    for a, b in graph.edges:
        ua, ub = _unit(a), _unit(b)
        if ub in FACES and ua != ub and ua in LAYER and LAYER[ua] > LAYER["search"] and b != f"phaze_opt.{ub}":
            out.append(f"{a} -> {b}: import it from phaze_opt.{ub} (its __all__), not from the module")
    return out


def lazy_violations(lazy) -> list[str]:
    out = []
    for module, target, line in lazy:
        unit = _unit(module)
        allowed = module in LAZY_IMPORTS_ALLOWED or f"phaze_opt.{unit}.*" in LAZY_IMPORTS_ALLOWED
        if unit in NO_LAZY_IMPORTS or not allowed:
            out.append(f"{module}:{line} imports {target} inside a function")
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of attributes on a name; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def private_imports(root: Path = ROOT) -> list[str]:
    """Every place a phaze_opt module takes a private name from another phaze_opt module: `from m
    import _x`, or `m._x` (or `pkg.m._x`) on a module it imported whole."""
    modules = {_module_name(p, root): p for p in sorted(root.rglob("*.py")) if "presets" not in p.relative_to(root).parts}
    known = set(modules)
    out = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        bound: dict[str, str] = {}  # local name -> the phaze_opt module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "phaze_opt":
                        local = alias.asname or alias.name.split(".")[0]
                        bound[local] = alias.name if alias.asname else "phaze_opt"
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    target = _resolve(name, is_package, ast.ImportFrom(node.module, [alias], node.level), known)
                    if not target or target[0] not in known:
                        continue
                    if target[0].endswith(f".{alias.name}"):  # a module imported by name
                        bound[alias.asname or alias.name] = target[0]
                    elif _private(alias.name):
                        out.append(f"{name}:{node.lineno} imports {alias.name} from {target[0]}")
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            chain = _dotted(node.value)
            if chain is None:
                continue
            head, _, rest = chain.partition(".")
            module = ".".join(filter(None, [bound.get(head, ""), rest]))
            if head in bound and module in known and module != name:
                out.append(f"{name}:{node.lineno} uses {module}.{node.attr}")
    return sorted(out)


@pytest.fixture(scope="module")
def graph_and_lazy():
    return import_graph()


def test_every_unit_has_a_layer(graph_and_lazy):
    graph, _ = graph_and_lazy
    units = {_unit(m) for m in graph.nodes} - {"phaze_opt"}
    assert units <= set(LAYER), f"units without a layer: {sorted(units - set(LAYER))}"


def test_no_package_imports_a_package_above_it(graph_and_lazy):
    graph, _ = graph_and_lazy
    assert layering_violations(graph) == []


def test_no_import_cycle_inside_a_package(graph_and_lazy):
    graph, _ = graph_and_lazy
    assert package_cycles(graph) == []


def test_packages_above_search_use_the_faces_of_search_and_runs(graph_and_lazy):
    graph, _ = graph_and_lazy
    assert face_violations(graph) == []


def test_every_face_exports_what_it_lists():
    import importlib

    for unit in FACES:
        package = importlib.import_module(f"phaze_opt.{unit}")
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert missing == [], f"phaze_opt.{unit}.__all__ lists names it lacks: {missing}"


def test_no_import_inside_a_function_to_dodge_a_cycle(graph_and_lazy):
    _, lazy = graph_and_lazy
    assert lazy_violations(lazy) == []


def test_the_schedule_and_placement_solvers_import_nothing_of_each_other(graph_and_lazy):
    """solve/'s two wings meet only in design/ (the schedules' makespans become the placement's
    layer costs there), so either can be read, tested and changed alone."""
    graph, _ = graph_and_lazy
    wing = {"phaze_opt.solve.schedule": "schedule", "phaze_opt.solve.placement": "placement"}

    def side(module):
        return next((w for prefix, w in wing.items() if module == prefix or module.startswith(prefix + ".")), None)

    crossing = [(a, b) for a, b in graph.edges if side(a) and side(b) and side(a) != side(b)]
    assert crossing == []


def test_the_checks_see_a_cycle_and_an_upward_import(tmp_path):
    """The checks themselves: a made-up package with a cycle, an upward and a lazy import fails them."""
    pkg = tmp_path / "phaze_opt"
    (pkg / "search").mkdir(parents=True)
    (pkg / "solve").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "search" / "__init__.py").write_text("")
    (pkg / "solve" / "__init__.py").write_text("")
    (pkg / "search" / "a.py").write_text("from .b import x\n")
    (pkg / "search" / "b.py").write_text("def f():\n    from .a import y\n")
    (pkg / "solve" / "c.py").write_text("from ..search import a\n")
    (pkg / "commands").mkdir()
    (pkg / "commands" / "__init__.py").write_text("from ..search import a\n")  # a module, not the face
    (pkg / "workload").mkdir()
    (pkg / "workload" / "__init__.py").write_text("from ..hardware import h\n")  # hardware is after it in layer 1
    (pkg / "hardware").mkdir()
    (pkg / "hardware" / "__init__.py").write_text("")
    (pkg / "hardware" / "h.py").write_text("")
    (pkg / "errors.py").write_text("import importlib\nimportlib.import_module(f'phaze_opt.search.{1}')\n")
    graph, lazy = import_graph(pkg)
    assert package_cycles(graph) == [["phaze_opt.search.a", "phaze_opt.search.b"]]
    violations = layering_violations(graph)
    assert any("solve (layer 2) imports search (layer 5)" in v for v in violations)
    assert any("workload imports hardware, listed after it in layer 1" in v for v in violations)
    assert ("phaze_opt.errors", "phaze_opt.search") in graph.edges  # seen through importlib
    assert any(v.startswith("phaze_opt.errors -> phaze_opt.search") for v in violations)
    assert face_violations(graph) == ["phaze_opt.commands -> phaze_opt.search.a: import it from phaze_opt.search "
                                      "(its __all__), not from the module"]
    assert lazy_violations(lazy) == ["phaze_opt.search.b:2 imports phaze_opt.search.a inside a function"]


def test_no_module_uses_another_modules_private_name():
    assert private_imports() == []


def test_the_private_name_check_sees_both_forms(tmp_path):
    """The check itself: `from m import _x` and `m._x` fail it; a module's own private names, a
    dunder and a private name of a third-party module do not."""
    pkg = tmp_path / "phaze_opt"
    (pkg / "solve").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "solve" / "__init__.py").write_text("")
    (pkg / "solve" / "dp.py").write_text("def _kernel():\n    pass\n\n\ndef public():\n    return _kernel()\n")
    (pkg / "solve" / "expert.py").write_text("from .dp import _kernel, public\nfrom . import dp as dense\n"
                                             "import os\n\ndense._kernel()\nos._exit\ndense.__name__\n")
    (pkg / "errors.py").write_text("import phaze_opt.solve.dp\nimport phaze_opt.solve.dp as d\n"
                                   "phaze_opt.solve.dp._kernel()\nd._kernel\n")
    assert private_imports(pkg) == [
        "phaze_opt.errors:3 uses phaze_opt.solve.dp._kernel",
        "phaze_opt.errors:4 uses phaze_opt.solve.dp._kernel",
        "phaze_opt.solve.expert:1 imports _kernel from phaze_opt.solve.dp",
        "phaze_opt.solve.expert:5 uses phaze_opt.solve.dp._kernel",
    ]


def test_the_study_config_walk_enters_each_module_at_most_twice():
    # A reader following a study's settings from `run_study` to the first evaluation should not be
    # sent back into one module a third time (docs/architecture.md shows the walk).
    from config_walk import stops_of, walk

    stops = stops_of(walk())
    entries = Counter(module for module, _ in stops)
    assert stops[-1] == ("phaze_opt.search.objective", "evaluate_point")
    assert max(entries.values()) <= 2, entries


def test_a_study_process_never_imports_torch():
    """A study's parent and worker processes evaluate designs from cached or extracted graphs; only
    tracing a layer needs PyTorch (seconds of import per process on a loaded machine). The modules
    a study loads to run trials, in a fresh interpreter, must leave torch unloaded; fails if any of
    them imports `workload.layers` (torch) at module level."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import phaze_opt.cli, phaze_opt.study, phaze_opt.search.sampled, phaze_opt.design.evaluate\n"
            "import phaze_opt.design.parallel, phaze_opt.workload.stack, phaze_opt.validation.runner\n"
            "print(sorted(m for m in ('torch', 'mlflow') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
