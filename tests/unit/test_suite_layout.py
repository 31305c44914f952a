"""The test suite's own layout (docs/development.md, "Where tests live"): pytest imports every test file and every
helper module by its bare name, so a name must be unique and a test module must never be what another imports.

- Shared helpers are modules at tests/ top level (or ``preheat.testing`` when a benchmark needs them too); shared
  fixtures are in the closest common conftest.py. A test module that imports another test module works only when
  pytest happens to have put that module's folder on ``sys.path`` first.
- Nothing imports a conftest.py: pytest loads each folder's under the one name ``conftest``.
- Neither the tests nor the benchmarks edit ``sys.path`` to reach into another folder.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
BENCH = ROOT / "bench"
# An import line inside a string: the code a test hands to a child ``python -c``.
_IMPORT_LINE = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))", re.MULTILINE)


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if ".venv" not in p.parts)


def suite_test_files() -> list[Path]:
    return [p for p in python_files(TESTS) if p.name.startswith("test_")]


@functools.cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in ``path``, and of every import line in its string constants (code run as
    ``python -c``)."""
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.lineno, node.module
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for found in _IMPORT_LINE.finditer(node.value):
                yield node.lineno, found.group(1) or found.group(2)


def offending_imports(paths: list[Path], refused: re.Pattern[str]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line}: imports {module}"
        for path in paths
        for line, module in imported_modules(path)
        if refused.search(module)
    ]


def test_no_test_module_imports_another_test_module() -> None:
    # "test_x", or "engines.test_x": the last part of the dotted name is a test module.
    found = offending_imports(python_files(TESTS) + python_files(BENCH), re.compile(r"(?:^|\.)test_\w+$"))
    assert not found, "move what is shared into a helper module at tests/ top level or a conftest.py fixture:\n" + (
        "\n".join(found)
    )


def test_nothing_imports_a_conftest() -> None:
    found = offending_imports(python_files(TESTS) + python_files(BENCH), re.compile(r"(?:^|\.)conftest$"))
    assert not found, "import helpers from their module at tests/ top level (checkpoints, ...):\n" + "\n".join(found)


def test_every_test_file_name_is_unique() -> None:
    counts = Counter(p.name for p in suite_test_files())
    twice = sorted(
        str(p.relative_to(ROOT)) for p in suite_test_files() if counts[p.name] > 1
    )  # pytest imports them by bare name: the second one collected fails
    assert not twice, "rename one of each pair:\n" + "\n".join(twice)


def test_no_helper_module_is_named_like_a_test_file_or_a_package_of_ours() -> None:
    # A helper at tests/ top level shares the bare namespace with the test files and with preheat's own packages.
    helpers = {p.stem for p in TESTS.glob("*.py") if p.name != "conftest.py"}
    assert not {h for h in helpers if h.startswith("test_")}
    assert not helpers & {p.stem for p in suite_test_files()}
    assert "preheat" not in helpers


def test_neither_tests_nor_benchmarks_edit_sys_path() -> None:
    # A script's own folder is on sys.path already; what bench shares with tests lives in preheat.testing.
    found = []
    for path in python_files(TESTS) + python_files(BENCH):
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Attribute) and ast.unparse(node) == "sys.path":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "import from preheat.testing (or a module beside the file) instead:\n" + "\n".join(found)


def test_the_checks_see_the_suite() -> None:
    # A guard on the checks above: a wrong root would make them pass without looking at anything.
    assert len(suite_test_files()) > 100
    assert (TESTS / "conftest.py").is_file()
    assert any(m == "preheat" or m.startswith("preheat.") for _, m in imported_modules(TESTS / "conftest.py"))
    child_code = [m for p in suite_test_files() for line, m in imported_modules(p) if m == "kvstorekit"]
    assert len(child_code) >= 2  # test_kv_store.py imports it and hands code importing it to child processes
