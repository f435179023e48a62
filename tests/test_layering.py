"""The import direction of DESIGN.md, checked from the AST of every module.

scheduler -> standard library only; predictor -> no project package and never mlflow;
engine -> scheduler and predictor; training -> anything but the HTTP app. Only the CLI entry
(training/cli.py, which names modules as strings) and the server's own package start the app.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"scheduler", "predictor", "engine", "training"}
ALLOWED_PROJECT_IMPORTS = {
    "scheduler": {"scheduler"},
    "predictor": {"predictor"},
    "engine": {"engine", "scheduler", "predictor"},
    "training": {"training", "engine", "scheduler", "predictor"},
}
HTTP_APP = "engine.server"


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _package_of(path: Path) -> str:
    """The dotted package a module under ROOT belongs to (a package's __init__ is its own)."""
    return ".".join(path.resolve().relative_to(ROOT).parts[:-1])


def _imported_names(path: Path, package: str | None = None) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: `from .server import app` inside engine/ is engine.server
                base = (package if package is not None else _package_of(path)).split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([module] if module else []))
            if not module:
                continue
            # The module, and each name as a possible submodule: `from engine import server`
            # imports engine.server.
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("package", sorted(PROJECT))
def test_project_imports_follow_the_layering(package: str) -> None:
    for path in _modules(package):
        for name in _imported_names(path):
            top = name.split(".")[0]
            if top in PROJECT:
                assert top in ALLOWED_PROJECT_IMPORTS[package], f"{path.relative_to(ROOT)} imports {name}"


def test_scheduler_imports_only_the_standard_library() -> None:
    for path in _modules("scheduler"):
        for name in _imported_names(path):
            top = name.split(".")[0]
            assert top in sys.stdlib_module_names or top == "scheduler" or top == "__future__", (
                f"{path.relative_to(ROOT)} imports {name}"
            )


def test_predictor_never_imports_mlflow() -> None:
    for path in _modules("predictor"):
        assert not any(n.split(".")[0] == "mlflow" for n in _imported_names(path)), path


def test_nothing_outside_the_server_imports_the_http_app() -> None:
    for package in PROJECT:
        for path in _modules(package):
            if path.relative_to(ROOT).as_posix().startswith(HTTP_APP.replace(".", "/") + "/"):
                continue
            for name in _imported_names(path):
                assert not (name == HTTP_APP or name.startswith(HTTP_APP + ".")), (
                    f"{path.relative_to(ROOT)} imports {name}")


def test_the_checks_see_a_violation(tmp_path: Path) -> None:
    """Guards the guard: the AST walk must find an import hidden inside a function."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from engine.server.app import build_app\n    import torch\n"
                   "    from engine import server\n")
    assert _imported_names(bad, package="engine") == ["engine.server.app", "engine.server.app.build_app", "torch",
                                                      "engine", "engine.server"]
    relative = tmp_path / "relative.py"
    relative.write_text("from .server.app import build_app\nfrom . import server\nfrom .. import training\n")
    assert _imported_names(relative, package="engine.kernels") == [
        "engine.kernels.server.app", "engine.kernels.server.app.build_app", "engine.kernels",
        "engine.kernels.server", "engine", "engine.training"]
    assert _imported_names(relative, package="engine")[:2] == ["engine.server.app", "engine.server.app.build_app"]


def test_every_package_import_is_a_main_dependency() -> None:
    """`pip install .` without [dev] must run every command (httpx was dev-only, and `bench serve`
    imports it)."""
    import ast
    import importlib.metadata
    import re
    import sys
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~\[; ]", spec)[0].lower().replace("_", "-") for spec in project["dependencies"]}
    ours = {"scheduler", "predictor", "engine", "training", "__future__"}
    imported = set()
    for package in ("scheduler", "predictor", "engine", "training"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    imported.add(node.module.split(".")[0])
    third_party = imported - ours - set(sys.stdlib_module_names) - {"pydantic", "starlette"}  # fastapi's own
    distributions = importlib.metadata.packages_distributions()
    undeclared = sorted(name for name in third_party
                        if not {d.lower().replace("_", "-") for d in distributions.get(name, [name])} & declared)
    assert undeclared == []
