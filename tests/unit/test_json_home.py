"""JSON has one home: ``preheat.core.jsonsafe``. Anywhere else, ``json.loads`` on bytes from outside raised
``RecursionError`` on 64 KiB of ``[`` (no ``ValueError``: it went past the callers' except clauses and ended, e.g.,
a replica's refit follower thread). This walks src/preheat and fails on a parse outside jsonsafe, and checks that
jsonsafe's helpers refuse what ``json.loads`` would crash on with the one error callers catch."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from preheat.core.errors import JSONInputError
from preheat.core.jsonsafe import load_object, loads_bounded, read_bounded, read_object

SRC = Path(__file__).resolve().parents[2] / "src" / "preheat"
HOME = "core/jsonsafe.py"
# Modules that may parse JSON themselves, each with why (a format module that bounds nesting on its own, say).
# None today: every format (KV chunks, artifact blobs, manifests, safetensors headers) parses through jsonsafe.
ALLOWED: dict[str, str] = {}
PARSERS = {"load", "loads", "JSONDecoder", "decoder", "scanner"}  # what a module may not take from json
OTHER_PARSERS = {"simplejson", "ujson", "orjson", "rapidjson"}  # none of them bounds nesting either


def parses(source: str) -> list[str]:
    """Where ``source`` parses JSON itself: ``json.loads``/``json.load``/``JSONDecoder`` however json was imported
    (``import json as j``, ``from json import loads as l``), or another JSON parser; as ``line: what``."""
    tree = ast.parse(source)
    modules = set()  # local names bound to the json module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if alias.name == "json" or (top == "json" and alias.asname is None):  # import json.x binds json too
                    modules.add(alias.asname or "json")
                if alias.name.startswith("json.") or top in OTHER_PARSERS:
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            top = node.module.split(".")[0]
            taken = [a.name for a in node.names if node.module != "json" or a.name in PARSERS or a.name == "*"]
            if (top == "json" or top in OTHER_PARSERS) and taken:
                found.append(f"{node.lineno}: from {node.module} import {', '.join(taken)}")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr in PARSERS
        ):
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
    return sorted(found, key=lambda f: int(f.split(":")[0]))


def test_json_is_parsed_only_in_jsonsafe() -> None:
    outside = {}
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        if name == HOME or name in ALLOWED:
            continue
        found = parses(path.read_text(encoding="utf-8"))
        if found:
            outside[name] = found
    assert not outside, (
        "JSON parsed outside preheat.core.jsonsafe (use loads_bounded/load_object/read_bounded/read_object, or add "
        f"the module to ALLOWED with the reason it bounds nesting itself): {outside}"
    )


def test_the_allow_list_names_modules_that_exist_and_parse() -> None:
    for name, why in ALLOWED.items():
        assert why, f"{name}: say why it may parse JSON itself"
        assert parses((SRC / name).read_text(encoding="utf-8")), f"{name} no longer parses JSON: drop it from ALLOWED"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import json\njson.loads(b)", ["2: json.loads"]),
        ("import json\nwith open(p) as f:\n    json.load(f)", ["3: json.load"]),
        ("import json as j\nj.loads(b)", ["2: j.loads"]),
        ("import json\nparse = json.loads\n", ["2: json.loads"]),  # taken, not called: still a parse
        ("import json\njson.JSONDecoder().raw_decode(s)", ["2: json.JSONDecoder"]),
        ("from json import loads\n", ["1: from json import loads"]),
        ("from json import loads as parse, dumps\n", ["1: from json import loads"]),
        ("import json.decoder\n", ["1: import json.decoder"]),
        ("import orjson\n", ["1: import orjson"]),
        ("import json\njson.dumps(x)\nfrom json import dumps, JSONDecodeError\n", []),  # writing JSON is fine
    ],
)
def test_the_walk_finds_every_spelling_of_a_parse(source: str, expected: list[str]) -> None:
    assert parses(source) == expected


# -- the home itself: what json.loads crashes on is one JSONInputError (a ValueError), never a RecursionError ------
HOSTILE = b"[" * 65536  # what a hostile holder, advert or timeline server answered in issue 27


def test_a_generous_depth_bound_still_refuses_rather_than_recurse() -> None:
    with pytest.raises(JSONInputError, match="nested too deeply"):
        loads_bounded(HOSTILE + b"]" * 65536, max_bytes=1 << 20, max_depth=10**6)


def test_load_object_refuses_deep_nesting_and_anything_but_an_object() -> None:
    with pytest.raises(JSONInputError, match="nested deeper"):
        load_object(HOSTILE, max_bytes=1 << 20)
    kinds = [(b"[1]", "array"), (b'"x"', "string"), (b"1.5", "number"), (b"true", "boolean"), (b"null", "null")]
    for raw, kind in kinds:
        with pytest.raises(JSONInputError, match=f"a JSON {kind}, not an object"):
            load_object(raw, max_bytes=100)
    assert load_object('{"a": [1]}', max_bytes=100) == {"a": [1]}


def test_files_are_read_no_further_than_the_bound(tmp_path: Path) -> None:
    deep, big, good = tmp_path / "deep.json", tmp_path / "big.json", tmp_path / "good.json"
    deep.write_bytes(HOSTILE)
    big.write_bytes(b'{"pad": "' + b"x" * 4096 + b'"}')
    good.write_bytes(b'{"identity": "x", "nan": NaN}')
    for read in (read_bounded, read_object):
        with pytest.raises(JSONInputError, match="nested deeper"):
            read(deep, max_bytes=1 << 20)
        with pytest.raises(JSONInputError, match="over the limit of 1024"):
            read(big, max_bytes=1024)
        with pytest.raises(JSONInputError, match="NaN is not JSON"):
            read(good, max_bytes=1024)
        with pytest.raises(FileNotFoundError):
            read(tmp_path / "absent.json", max_bytes=1024)
    parsed = read_bounded(good, max_bytes=1024, allow_constants=True)  # Python's json.dumps writes NaN
    assert isinstance(parsed, dict)
    assert math.isnan(parsed["nan"])
