"""Packaging: the lock file is one of the sets pyproject.toml allows, and nothing undeclared is imported."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]

# Import names that differ from the distribution's name on PyPI.
IMPORT_NAMES = {"yaml": "pyyaml", "psycopg2": "psycopg2-binary"}


def declared(extra: str | None = None) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in (project["optional-dependencies"][extra] if extra else project["dependencies"])]


def locked() -> dict[str, str]:
    pins = {}
    for line in (REPO / "requirements.lock").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_every_declared_dependency_is_locked_at_a_version_it_allows():
    pins = locked()
    for req in declared() + declared("test") + declared("cluster"):
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is declared but not in requirements.lock"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock pins {req.name}=={pins[name]}, outside {req}"


def test_torch_and_mlflow_stay_pinned():
    exact = {canonicalize_name(r.name): str(r.specifier) for r in declared()}
    assert exact["torch"] == "==2.13.0"
    assert exact["mlflow"] == "==3.17.2"


def third_party_imports(folder: Path) -> set[str]:
    names = set()
    for path in folder.rglob("*.py"):
        if "presets" in path.relative_to(folder).parts:
            continue  # data shipped with the package (a measuring script among it), not its code
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "phaze_opt"}


def test_the_package_declares_exactly_what_it_imports():
    imported = {canonicalize_name(IMPORT_NAMES.get(n, n)) for n in third_party_imports(REPO / "phaze_opt")}
    # an optional extra is imported only where its feature runs (runs/cluster.py: `distributed`)
    names = {canonicalize_name(r.name) for r in declared() + declared("cluster")}
    # pyarrow is imported by pandas for Parquet (export --format parquet); cmaes by optuna's CmaEsSampler
    indirect = {"pyarrow", "cmaes"}
    assert imported - names == set(), "imported but not declared"
    assert names - imported - indirect == set(), "declared but never imported"


def test_the_tests_import_only_declared_packages():
    imported = {canonicalize_name(IMPORT_NAMES.get(n, n)) for n in third_party_imports(REPO / "tests")}
    names = {canonicalize_name(r.name) for r in declared() + declared("test")}
    local = {canonicalize_name(p.stem) for p in (REPO / "tests").rglob("*.py")}  # the tests' own helpers
    assert imported - names - local == set()
