"""Every ``args.NAME`` a benchmark script reads is an option its own parser declares.

argparse's Namespace is untyped, so mypy cannot see a renamed flag (``--chunk-tokens`` became ``--kv-chunk-tokens``
and ``bench/router.py`` failed only when run, after minutes of setup). This reads each script's syntax tree: the
destinations of its ``add_argument`` calls against the attributes read off a name ``args``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _dest(call: ast.Call) -> str:
    """argparse's rule: ``dest=`` if given, else the first long option (else the first name), dashes as ``_``."""
    for keyword in call.keywords:
        if keyword.arg == "dest" and isinstance(keyword.value, ast.Constant):
            return str(keyword.value.value)
    names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    longs = [name for name in names if name.startswith("--")]
    return (longs or names or [""])[0].lstrip("-").replace("-", "_")


def declared_and_read(source: str) -> tuple[set[str], dict[str, int]]:
    """The option destinations a script declares, and each ``args.X`` it reads with its first line."""
    declared: set[str] = set()
    read: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            declared.add(_dest(node))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            read.setdefault(node.attr, node.lineno)
    return declared, read


SCRIPTS = sorted(path for path in BENCH.glob("*.py") if "add_argument" in path.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_option_read_is_declared(script: Path) -> None:
    declared, read = declared_and_read(script.read_text())
    undeclared = {name: line for name, line in read.items() if name not in declared}
    assert not undeclared, f"{script.name} reads options its parser does not declare (name: line): {undeclared}"


def test_the_check_sees_a_renamed_flag() -> None:
    source = (
        "import argparse\n"
        "parser = argparse.ArgumentParser()\n"
        "parser.add_argument('--kv-chunk-tokens', type=int)\n"
        "args = parser.parse_args()\n"
        "print(args.chunk_tokens)\n"
    )
    declared, read = declared_and_read(source)
    assert declared == {"kv_chunk_tokens"}
    assert read == {"chunk_tokens": 5}
