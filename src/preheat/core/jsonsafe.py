"""JSON from outside the process, parsed within stated bounds: size, nesting depth, and nothing but JSON.

``json.loads`` recurses once per nesting level, so a body of 100,000 ``[`` raises ``RecursionError`` (deep in a
thread it could exhaust the stack); it guesses UTF-16/32 from the first bytes, raises a plain ``ValueError`` for
integers of more than 4,300 digits, and accepts ``NaN`` and ``Infinity``. Every JSON document that arrives from the
network or from a file someone else wrote (request bodies, KV events, manifests, safetensors headers, index files)
goes through ``loads_bounded`` instead, which refuses all of that with one error, ``JSONInputError``. It is a
``ValueError``, so code that caught ``json.JSONDecodeError``/``ValueError`` around ``json.loads`` keeps working; the
caller adds the file, URL or request it came from and maps it to its own answer (a 400, a ``CheckpointError``...).
``load_object`` is the same for a document that must be an object, ``read_bounded``/``read_object`` for a file.
This module is the only place ``json.loads``/``json.load`` are called (tests/unit/test_json_home.py keeps it so).

Bounds, for a document of n bytes: time O(n) before ``json.loads`` runs; memory: four temporary copies of at most n
bytes for the depth check (escapes removed twice, strings removed, then only the brackets; only for documents with
more than ``max_depth`` brackets), then whatever ``json.loads`` builds.

>>> loads_bounded(b'{"a": [1, 2]}', max_bytes=100)
{'a': [1, 2]}
>>> loads_bounded(b"[" * 100_000, max_bytes=1 << 20)
Traceback (most recent call last):
...
preheat.core.errors.JSONInputError: nested deeper than 64 levels
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from preheat.core.errors import JSONInputError

# Real documents nest a handful of levels (a chat message's content parts: 4; a manifest's config: ~6). 64 leaves
# room for any of them while keeping json.loads far from the interpreter's recursion limit (~1,000 frames).
MAX_DEPTH = 64

# A JSON string once its escaped backslashes and quotes are gone, or an unterminated one running to the end: one
# character class and an end that always matches, so the scan never backtracks (Python 3.10 has no possessive
# quantifiers) and stays linear even for '"' followed by a million '\"'.
_STRING = re.compile(rb'"[^"]*(?:"|\Z)')
_OPEN = ord("[")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SAME_BRACKETS = bytes.maketrans(b"{}", b"[]")
_SMALL = 64 * 1024  # skeletons up to this many brackets are measured in Python; longer ones with numpy
_CHUNK = 1 << 20  # numpy measures in chunks of this many brackets, so its temporaries stay a few MiB
_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}  # names in refusals


def loads_bounded(
    data: bytes | bytearray | memoryview | str,
    *,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    max_containers: int | None = None,
    allow_constants: bool = False,
) -> object:
    """Parse ``data`` (UTF-8 JSON) if it has at most ``max_bytes`` bytes and ``max_depth`` nested arrays/objects.

    ``max_containers`` bounds how many arrays and objects it may hold in all: ``json.loads`` builds 16 million empty
    lists (~1 GB, seconds of CPU) from 32 MiB of ``[],``. ``NaN``/``Infinity``/``-Infinity`` are refused unless
    ``allow_constants``. Raises ``JSONInputError`` (a ``ValueError``) saying which bound or rule the document broke;
    never ``RecursionError``.

    >>> loads_bounded("[[1]]", max_bytes=10, max_depth=1)
    Traceback (most recent call last):
    ...
    preheat.core.errors.JSONInputError: nested deeper than 1 levels
    """
    if isinstance(data, str):
        raw = data.encode("utf-8", "surrogatepass")
        text = data
    else:
        raw = bytes(data)
        text = ""
    if len(raw) > max_bytes:
        raise JSONInputError(f"{len(raw)} bytes of JSON, over the limit of {max_bytes}")
    if not text:
        try:
            # Decoded here, not by json.loads: it would guess UTF-16/32 from the first bytes, which the depth check
            # below (over UTF-8 bytes) would then read differently.
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise JSONInputError(f"not UTF-8 ({exc})") from None
    if depth_exceeds(raw, max_depth):
        raise JSONInputError(f"nested deeper than {max_depth} levels")
    if max_containers is not None and containers_exceed(raw, max_containers):
        raise JSONInputError(f"more than {max_containers} arrays and objects")
    try:
        return (_LENIENT if allow_constants else _STRICT).decode(text)
    except RecursionError:  # unreachable within MAX_DEPTH unless the caller is already ~900 frames deep
        raise JSONInputError("nested too deeply to parse here") from None
    except ValueError as exc:  # JSONDecodeError, and integers of more than 4,300 digits
        raise JSONInputError(f"not valid JSON: {exc}") from None


def load_object(
    data: bytes | bytearray | memoryview | str,
    *,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    max_containers: int | None = None,
    allow_constants: bool = False,
) -> dict[str, Any]:  # Any: JSON values, whose shape the caller checks
    """``loads_bounded`` for a document that must be a JSON object (a record, an answer, a header): anything else,
    an array or a string included, is refused with ``JSONInputError`` too.

    >>> load_object(b"[1]", max_bytes=10)
    Traceback (most recent call last):
    ...
    preheat.core.errors.JSONInputError: a JSON array, not an object
    """
    value = loads_bounded(
        data, max_bytes=max_bytes, max_depth=max_depth, max_containers=max_containers, allow_constants=allow_constants
    )
    if not isinstance(value, dict):
        raise JSONInputError(f"a JSON {_KINDS.get(type(value), 'null')}, not an object")
    return value


def read_bounded(
    path: str | os.PathLike[str], *, max_bytes: int, max_depth: int = MAX_DEPTH, allow_constants: bool = False
) -> object:
    """The JSON document in the file ``path``, read no further than one byte past ``max_bytes`` (so a larger file
    is refused unread); ``OSError`` as ``open`` raises it, ``JSONInputError`` for the document."""
    return loads_bounded(
        read_head(path, max_bytes), max_bytes=max_bytes, max_depth=max_depth, allow_constants=allow_constants
    )


def read_object(
    path: str | os.PathLike[str], *, max_bytes: int, max_depth: int = MAX_DEPTH
) -> dict[str, Any]:  # Any: JSON values, whose shape the caller checks
    """``read_bounded`` for a file that must hold a JSON object (``load_object``'s rule)."""
    return load_object(read_head(path, max_bytes), max_bytes=max_bytes, max_depth=max_depth)


def read_head(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The first ``max_bytes + 1`` bytes of the file ``path``, for a parser bounded at ``max_bytes`` (``loads_bounded``,
    ``Manifest.from_json``): a larger file is refused without being read further. ``OSError`` as ``open`` raises it."""
    with open(path, "rb") as handle:
        return handle.read(max_bytes + 1)  # one byte more: enough to see the file is too large, no more


def depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """Whether the UTF-8 JSON text ``raw`` nests arrays/objects more than ``max_depth`` deep; linear time.

    Brackets inside strings do not count. For text that is not JSON the answer is still safe: ``json.loads`` stops
    at its first error, and up to there it tells strings from brackets exactly as this scan does.
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:  # most documents: too few brackets to nest that deep
        return False
    skeleton = brackets(raw)
    if skeleton.count(b"[") <= max_depth:
        return False
    if b"[" * (max_depth + 1) in skeleton:  # the common attack: a long run of openers
        return True
    return nesting_depth(skeleton) > max_depth


def containers_exceed(raw: bytes, limit: int) -> bool:
    """Whether the UTF-8 JSON text ``raw`` holds more than ``limit`` arrays and objects (not counting strings)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return brackets(raw).count(b"[") > limit


def brackets(raw: bytes) -> bytes:
    """The structural brackets of JSON text ``raw`` with ``{}`` written as ``[]``: strings and everything else gone."""
    # Escapes read left to right: every '\\' pair goes first, so a '\' left before '"' escapes that quote.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _STRING.sub(b"", unescaped).translate(_SAME_BRACKETS, _NOT_BRACKETS)


def nesting_depth(skeleton: bytes) -> int:
    """The deepest level a ``[``/``]`` string reaches (the most openers not yet closed at any point)."""
    if len(skeleton) <= _SMALL:
        level = best = 0
        for byte in skeleton:
            level += 1 if byte == _OPEN else -1
            best = max(best, level)
        return best
    import numpy as np  # a long skeleton: a Python loop would take seconds; numpy is a dependency anyway

    steps = np.frombuffer(skeleton, dtype=np.uint8)
    level = best = 0
    for start in range(0, len(steps), _CHUNK):
        # '[' (0x5B) -> +1, ']' (0x5D) -> -1
        levels = np.cumsum(0x5C - steps[start : start + _CHUNK].astype(np.int32)) + level
        best = max(best, int(levels.max()))
        level = int(levels[-1])
    return best


def _refuse_constant(token: str) -> object:
    raise ValueError(f"{token} is not JSON")


# One decoder each, made once: ``json.loads`` with any keyword builds a new decoder and scanner on every call (~2 us,
# a third of parsing a small request body).
_STRICT = json.JSONDecoder(parse_constant=_refuse_constant)
_LENIENT = json.JSONDecoder()
