"""Artifact blobs are outside bytes: any input either parses or raises ``PeerError`` (never another exception), its
parsing holds memory proportional to its size, and an installed payload writes only plain files and directories
inside the target directory, whatever a (trusted but careless, or compromised) builder put in the tar."""

from __future__ import annotations

import io
import os
import struct
import tarfile
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from artifactkit import KEY
from preheat.artifacts import blobs as artifacts
from preheat.artifacts.signing import SigningKey, TrustedKeys
from preheat.core.errors import PeerError
from strategies import json_values

_PRIVATE = Ed25519PrivateKey.generate()
SIGNER = SigningKey(
    _PRIVATE.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    where="fuzz key",
)
TRUSTED = TrustedKeys(frozenset({SIGNER.public}))
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_payload() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (("fxgraph/ab/entry", b"graph" * 40), ("aa/kernel.so", bytes(range(256)))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


VALID = artifacts.sign(artifacts.encode(KEY, _valid_payload()), SIGNER, where="fuzz")
VALID_BODY = artifacts.parse(VALID, where="fuzz").body_sha256


def _within_memory_bound(action: Callable[[], object], size: int) -> None:
    """Run ``action`` (which must return or raise PeerError) and check its peak allocations stay within a small
    multiple of the input: a length field cannot make it allocate what the input does not hold."""
    tracemalloc.start()
    try:
        action()
    except PeerError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= (1 << 20) + 8 * size, f"{peak} bytes allocated for a {size}-byte input"


@FUZZ
@given(st.binary(max_size=4096))
def test_any_bytes_parse_or_raise_peer_error(raw: bytes) -> None:
    _within_memory_bound(lambda: artifacts.parse(raw, where="fuzz"), len(raw))
    _within_memory_bound(lambda: artifacts.check_payload(raw, where="fuzz"), len(raw))


@st.composite
def mutated(draw: st.DrawFn, base: bytes = VALID) -> bytes:
    """``base`` with a few flips, truncations, insertions, or a rewritten header-length field."""
    blob = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "length", "overwrite"]))
        at = draw(st.integers(0, max(len(blob) - 1, 0)))
        if op == "flip" and blob:
            blob[at] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del blob[at:]
        elif op == "insert":
            blob[at:at] = draw(st.binary(min_size=1, max_size=64))
        elif op == "length" and len(blob) >= len(artifacts.MAGIC) + 8:
            struct.pack_into("<Q", blob, len(artifacts.MAGIC), draw(st.integers(0, 2**64 - 1)))
        elif op == "overwrite":
            chunk = draw(st.binary(min_size=1, max_size=32))
            blob[at : at + len(chunk)] = chunk
    return bytes(blob)


@FUZZ
@given(mutated())
def test_a_mutated_blob_verifies_or_raises_peer_error(raw: bytes) -> None:
    def check() -> None:
        verified = artifacts.verify(raw, KEY, TRUSTED, where="fuzz")
        event("verified")  # only when the mutations left the signed body as it was
        assert verified.body_sha256 == VALID_BODY

    _within_memory_bound(check, len(raw))


_JSON = json_values(20)


@FUZZ
@given(
    header=st.one_of(
        _JSON,
        st.fixed_dictionaries({"key": _JSON, "size": _JSON, "sha256": _JSON}),
        st.just("[" * 50_000),  # deeper than the JSON parser recurses
    ),
    payload=st.binary(max_size=1024),
)
def test_any_header_parses_or_raises_peer_error(header: object, payload: bytes) -> None:
    import json

    text = header if isinstance(header, str) and header.startswith("[[") else json.dumps(header)
    data = text.encode()
    raw = artifacts.MAGIC + struct.pack("<Q", len(data)) + data + payload
    _within_memory_bound(lambda: artifacts.verify(raw, KEY, TRUSTED, where="fuzz"), len(raw))


_SAFE_PART = st.sampled_from(["a", "b", "fxgraph", "x" * 120])
_PARTS = st.one_of(_SAFE_PART, _SAFE_PART, _SAFE_PART, st.sampled_from(["..", ".", ""]))
_NAMES = st.lists(_PARTS, min_size=1, max_size=4).map("/".join) | st.sampled_from(
    ["/etc/passwd", "/", "a/../../b", "./a", "a//b"]
)
_TYPES = st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE]) | st.sampled_from(
    [
        tarfile.REGTYPE,
        tarfile.AREGTYPE,
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.BLKTYPE,
        tarfile.FIFOTYPE,
        tarfile.CONTTYPE,
        tarfile.GNUTYPE_SPARSE,
    ]
)


_PAX_KEYS = st.sampled_from(
    ["GNU.sparse.map", "GNU.sparse.offset", "GNU.sparse.numbytes", "GNU.sparse.major", "GNU.sparse.minor",
     "GNU.sparse.name", "GNU.sparse.size", "GNU.sparse.realsize", "size", "mtime", "uid", "path", "linkpath",
     "hdrcharset"]
)  # fmt: skip
_PAX_VALUES = st.sampled_from(["0", "1", "x,y", "1,2,3", "-5", "99999999999999999999", "BINARY", "../x", ""])


@st.composite
def tar_payloads(draw: st.DrawFn) -> bytes:
    """Tars of arbitrary members (names with ``..`` and ``/``, links, devices, odd modes), sometimes mutated."""
    out = io.BytesIO()
    fmt = draw(st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]))
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for _ in range(draw(st.integers(0, 5))):
            info = tarfile.TarInfo(draw(_NAMES) or "a")
            info.type = draw(_TYPES)
            info.linkname = draw(_NAMES)
            info.mode = draw(st.integers(0, 0o7777))
            if fmt == tarfile.PAX_FORMAT:  # pax records tarfile itself parses, with numbers or not
                info.pax_headers = draw(st.dictionaries(_PAX_KEYS, _PAX_VALUES, max_size=3))
            data = draw(st.binary(max_size=64)) if info.type in (tarfile.REGTYPE, tarfile.AREGTYPE) else b""
            info.size = len(data)
            try:
                tar.addfile(info, io.BytesIO(data))
            except ValueError:  # a name the chosen format cannot hold: leave the member out
                continue
    payload = out.getvalue()
    return draw(mutated(payload)) if payload and draw(st.integers(0, 3)) == 0 else payload


@settings(FUZZ, max_examples=200)
@given(tar_payloads())
def test_an_installed_payload_stays_plain_files_inside_its_directory(payload: bytes) -> None:
    raw = artifacts.sign(artifacts.encode(KEY, payload), SIGNER, where="fuzz")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        target, outside = root / "a" / "target", root / "outside"
        outside.mkdir()
        try:
            verified = artifacts.verify(raw, KEY, TRUSTED, where="fuzz")
            artifacts.install(verified, str(target), where="fuzz")
            event("installed")
        except PeerError as exc:
            event(f"refused: {str(exc).split(': ', 2)[-1][:40]}")
        assert list(outside.iterdir()) == []
        assert {p.name for p in root.iterdir()} <= {"a", "outside"}  # "a" exists once an install began
        assert {p.name for p in root.glob("a/*")} <= {"target"}
        for dirpath, dirnames, filenames in os.walk(root / "a"):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                assert not path.is_symlink(), path
                assert path.is_dir() or path.is_file(), path
                assert not path.stat().st_mode & 0o6002, path  # no setuid/setgid, not world-writable
