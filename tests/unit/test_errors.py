"""The typed error tree: every class users can catch is importable from ``preheat`` itself."""

from __future__ import annotations

import inspect

import preheat
from preheat.core import errors


def _error_classes() -> dict[str, type[BaseException]]:
    return {
        name: cls
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    }


def test_every_error_class_is_exported_from_preheat() -> None:
    classes = _error_classes()
    assert classes, "preheat.core.errors defines no error classes"
    for name, cls in classes.items():
        assert name in preheat.__all__, f"preheat.{name} is not in __all__"
        assert getattr(preheat, name) is cls


def test_every_error_is_a_preheat_error_so_one_except_catches_them_all() -> None:
    assert all(issubclass(cls, preheat.PreheatError) for cls in _error_classes().values())
