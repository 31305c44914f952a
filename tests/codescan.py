"""Finding, in source code, the places that test a string literal themselves: the checks that a concern (a URL
scheme, ...) is spelled in one module only (tests/unit/kv/test_kv_backends.py, tests/unit/sources/test_peer_uri.py)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

# What cuts or tests a string by a literal: "x".startswith(LIT), url[len(LIT):], url.partition(LIT)...
_TESTS = ("startswith", "endswith", "removeprefix", "len", "partition", "split")


def literal_tests(path: Path, matches: Callable[[str], bool]) -> list[int]:
    """The lines of ``path`` where a string literal ``matches`` accepts (alone or in a tuple, list or set) is
    compared (``==``, ``in``...) or passed to ``startswith``/``endswith``/``removeprefix``/``len``/``partition``/
    ``split``. Docstrings, messages and f-strings are not tests, and are not reported."""

    def is_match(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return matches(node.value)
        return isinstance(node, ast.Tuple | ast.List | ast.Set) and any(is_match(e) for e in node.elts)

    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(is_match(n) for n in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and any(is_match(a) for a in node.args):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in _TESTS:
                lines.append(node.lineno)
    return sorted(lines)
