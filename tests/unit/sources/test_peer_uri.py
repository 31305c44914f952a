"""``preheat://NAME`` has one home (``preheat.sources.peer_uri``): its grammar, and the only comparison with it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import preheat
from codescan import literal_tests
from preheat.core.errors import ConfigError
from preheat.server.allow import refusal
from preheat.sources.open import open_origin
from preheat.sources.peer_uri import SCHEME, format_peer_uri, is_peer_uri, parse_peer_uri, peer_name
from preheat.store.cache import source_name

SRC = Path(preheat.__file__).parent
HOME = SRC / "sources" / "peer_uri.py"


@pytest.mark.parametrize("name", ["llama-3-8b", "xxh3-128:" + "0" * 32, "org.model@v2"])
def test_a_name_formats_and_parses_back(name: str) -> None:
    uri = format_peer_uri(name)
    assert is_peer_uri(uri)
    assert peer_name(uri) == name
    assert str(parse_peer_uri(uri)) == uri


def test_other_locations_are_no_peer_names() -> None:
    for location in ("s3://models/llama", "/models/llama", "https://host/preheat://x"):
        assert not is_peer_uri(location)
        assert peer_name(location) is None
        with pytest.raises(ConfigError, match="is not a preheat:// name"):
            parse_peer_uri(location)


def test_every_layer_reads_the_name_the_same_way() -> None:
    with pytest.raises(ConfigError, match=r"preheat:// names are pulled from peers"):
        open_origin("preheat://smollm2")  # the source picker refuses a name: it is pulled first
    assert source_name("preheat://smollm2") == "smollm2"  # the node cache names the entry after it
    assert refusal("preheat://smollm2", ["preheat://*"]) is None  # --allow-model matches it as a URI
    assert refusal("ftp://host/x", ["*"]) == "model 'ftp://host/x': unknown scheme (use a directory, http(s)://, " \
        "s3:// or preheat://)"


def _peer_scheme_uses(path: Path) -> list[str]:
    """Where ``path`` tests a location against the scheme itself: a ``"preheat://..."`` literal (or the bare name
    ``"preheat"``), or a second constant for it."""
    bare = SCHEME.removesuffix("://")
    found = [f"{path.relative_to(SRC)}:{n}" for n in literal_tests(path, lambda t: t.startswith(SCHEME) or t == bare)]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value == SCHEME:
            found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_only_the_home_module_spells_the_scheme_in_code() -> None:
    found = [hit for path in sorted(SRC.rglob("*.py")) if path != HOME for hit in _peer_scheme_uses(path)]
    assert found == [], "use preheat.sources.peer_uri (is_peer_uri, peer_name, SCHEME)"
    assert _peer_scheme_uses(HOME)  # the check sees what it looks for
