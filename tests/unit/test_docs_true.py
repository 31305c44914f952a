"""docs/architecture.md stays true: it names every module, every environment variable the code reads, and the
examples in the packages' docstrings name functions that exist."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "preheat"
ARCHITECTURE = (SRC.parent.parent / "docs" / "architecture.md").read_text()
MODULES = sorted(SRC.rglob("*.py"))


def test_architecture_names_every_module() -> None:
    # A package by its folder (`engine/`), a module by its path below preheat/ (`engine/kv.py`, `config.py`).
    names = [p.relative_to(SRC).as_posix().removesuffix("__init__.py") for p in MODULES]
    missing = [name for name in names if name and name not in ARCHITECTURE]
    assert not missing, f"docs/architecture.md does not mention {missing}"


def test_architecture_names_every_environment_variable_read() -> None:
    read = {
        (node.value, path.relative_to(SRC).as_posix())
        for path in MODULES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if re.fullmatch(r"PREHEAT_[A-Z0-9_]*[A-Z0-9]", node.value)
    }
    assert read  # the scan finds the variables at all
    missing = sorted((name, where) for name, where in read if f"`{name}`" not in ARCHITECTURE)
    assert not missing, f"docs/architecture.md, *Environment variables*, does not name {missing}"


def _docstring_imports() -> list[tuple[str, str, str]]:
    """(package, module, name) of every ``from preheat... import name`` in a ``>>>`` line of a package docstring."""
    found = []
    for init in sorted(SRC.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for line in doc.splitlines():
            match = re.match(r"\s*>>> from (preheat[\w.]*) import ([\w, ]+)", line)
            if match:
                package = init.parent.relative_to(SRC.parent).as_posix()
                found += [(package, match[1], name.strip()) for name in match[2].split(",")]
    return found


def test_package_docstrings_show_examples() -> None:
    assert {"preheat/server", "preheat/engine"} <= {package for package, _, _ in _docstring_imports()}


@pytest.mark.parametrize(("package", "module", "name"), _docstring_imports())
def test_package_docstring_examples_name_what_exists(package: str, module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{package}/__init__.py: {module} has no {name}"
