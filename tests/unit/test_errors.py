"""The typed error tree: one file defines every exception of preheat, draws the tree in its docstring, and every class
users can catch is importable from ``preheat`` itself (as httpx keeps ``_exceptions.py`` and its exported members)."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import preheat
from preheat.core import errors

SRC = Path(preheat.__file__).parent
REPO = SRC.parent.parent
HOME = "preheat.core.errors"
# The signals of errors.py (see its last section): not errors, so neither PreheatError nor exported. Adding one here
# is a decision to write down there first.
SIGNALS = {"Reframe", "_NoRoomError", "DirectIOUnsupported", "_LookedError"}
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _defined_in_errors() -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == HOME
    }


def _every_module() -> list[ModuleType]:
    """Every module of preheat, imported; those that need an optional dependency missing here are left out (their
    classes are still seen by the ast checks below). ``__main__`` modules run a command when imported."""
    modules: list[ModuleType] = []
    for info in pkgutil.walk_packages(preheat.__path__, "preheat.", onerror=lambda name: None):
        if info.name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            modules.append(importlib.import_module(info.name))
        except ModuleNotFoundError as exc:
            if (exc.name or "preheat").split(".")[0] == "preheat":
                raise  # a module of ours that is missing is a bug, not an optional dependency
    return modules


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _python_files(*roots: str) -> Iterator[Path]:
    for root in roots:
        yield from sorted((REPO / root).rglob("*.py"))


def test_every_preheat_error_is_defined_in_core_errors_and_exported_from_preheat() -> None:
    _every_module()  # so that a subclass defined anywhere exists to be found
    found = set(_subclasses(preheat.PreheatError))
    assert len(found) > 30, "PreheatError's subclasses were not found"
    for cls in found:
        assert cls.__module__ == HOME, f"{cls.__module__}.{cls.__qualname__}: define it in {HOME}"
        assert cls.__name__ in preheat.__all__, f"preheat.{cls.__name__} is not in __all__"
        assert getattr(preheat, cls.__name__) is cls


def test_every_class_of_core_errors_is_a_preheat_error_except_the_signals() -> None:
    for name, cls in _defined_in_errors().items():
        if name in SIGNALS:
            assert not issubclass(cls, preheat.PreheatError), f"{name}: a signal no `except PreheatError` may catch"
            assert name not in preheat.__all__
        else:
            assert issubclass(cls, preheat.PreheatError), f"{name}: one `except PreheatError` must catch it"


def test_no_module_outside_core_errors_defines_an_exception() -> None:
    # At run time: catches a subclass of a subclass, whatever its name.
    for module in _every_module():
        if module.__name__ == HOME:
            continue
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                pytest.fail(f"{module.__name__}.{name} is an exception: define it in {HOME}")
    # In the source: also classes inside functions and modules that need an optional dependency, by their bases'
    # names (a builtin exception, a class of errors.py, or a name that says it is one).
    ours = set(_defined_in_errors())
    for path in _python_files("src/preheat"):
        if path == SRC / "core" / "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                last = ast.unparse(base).rsplit(".", 1)[-1]
                if last in BUILTIN_EXCEPTIONS | ours or last.endswith(("Error", "Exception")):
                    pytest.fail(
                        f"{path.relative_to(REPO)}:{node.lineno}: class {node.name}({ast.unparse(base)}) is an "
                        f"exception: define it in {HOME}"
                    )


def test_errors_are_imported_from_core_errors_or_preheat_only() -> None:
    """No old home left: ``from preheat.kv.chunkfile import CorruptChunkError`` works only while chunkfile imports it,
    and stops the day it does not."""
    ours = set(_defined_in_errors())
    for path in _python_files("src", "tests", "bench"):
        where = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.ImportFrom) and node.module not in (HOME, "preheat"):
                wrong = sorted(a.name for a in node.names if a.name in ours)
                assert not wrong, f"{where}:{node.lineno}: import {', '.join(wrong)} from {HOME}, not {node.module}"
            elif isinstance(node, ast.Attribute) and node.attr in ours:
                owner = ast.unparse(node.value)
                assert owner in ("errors", "preheat", HOME), f"{where}:{node.lineno}: {owner}.{node.attr}: use {HOME}"


def _drawn_tree() -> dict[str, str | None]:
    """The classes drawn in errors.py's docstring, each with the class it is drawn under (None at the left edge or
    under a heading that is no class)."""
    assert errors.__doc__ is not None
    drawing = errors.__doc__.split("::\n", 1)[1]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str | None]] = []
    for line in drawing.splitlines():
        match = re.match(r"( *)(\S+)", line)
        if match is None:
            continue
        depth, word = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        name = word if re.fullmatch(r"_?[A-Z]\w*", word) else None
        if name is not None:
            parents[name] = stack[-1][1] if stack else None
        stack.append((depth, name))
    return parents


def test_the_tree_drawn_in_the_docstring_is_the_tree() -> None:
    drawn = _drawn_tree()
    classes = _defined_in_errors()
    assert set(drawn) == set(classes), "draw every class of errors.py in its docstring, and only those"
    for name, parent in drawn.items():
        base = classes[name].__bases__[0]
        expected = None if base.__module__ == "builtins" else base.__name__
        assert parent == expected, f"{name} is drawn under {parent}, but its base is {base.__name__}"
