"""docs/ stays true: the module inventory is generated from the code, the architecture map shows every package and
fits one screen, every environment variable the code reads is documented, and the examples in the packages'
docstrings name functions that exist."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "preheat"
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
MODULES = sorted(SRC.rglob("*.py"))


def test_the_module_inventory_is_what_the_code_says() -> None:
    # docs/modules.md is generated from the modules' docstrings; a new, moved or undocumented module makes it stale.
    script = ROOT / "scripts" / "module_map.py"
    check = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, check=False)
    assert check.returncode == 0, check.stderr


def test_architecture_names_every_top_level_package() -> None:
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    missing = [name for name in packages if f"{name}/" not in ARCHITECTURE]
    assert not missing, f"docs/architecture.md's map does not show {missing}"


def test_architecture_fits_one_screen() -> None:
    assert len(ARCHITECTURE.splitlines()) <= 60


# Every environment variable the code reads is declared in core/env.py and listed in docs/environment.md, a table
# generated from those declarations: tests/unit/test_env.py checks both.


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
