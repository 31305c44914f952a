"""Signed version manifests (``preheat.refit.protocol`` + ``preheat.refit.trust``) are outside bytes: any input either
parses or raises ``RefitError`` (never another exception), within memory proportional to its size; a manifest that
verifies is exactly the one its publisher signed (any change to what is signed is refused); and the order of
versions, the jump bound and the start rule say what a follower may apply."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from preheat.artifacts.signing import SigningKey, TrustedKeys
from preheat.core.errors import ConfigError, RefitError, VerificationError
from preheat.refit.protocol import TensorEntry, VersionManifest
from preheat.refit.trust import (
    CONTEXT,
    behind,
    check_signature,
    holder_allowed,
    refusal,
    require_trust,
    sign,
)
from strategies import FUZZ, json_values

WHERE = "http://127.0.0.1:9/refit/v1/epochs/1/versions/2"


def _key() -> SigningKey:
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return SigningKey(pem, where="test key")


TRAINER, ROGUE = _key(), _key()
TRUSTED = TrustedKeys(frozenset({TRAINER.public}))

digests = st.text("0123456789abcdef", min_size=32, max_size=32).map(lambda h: "xxh3-128:" + h)
entries = st.builds(
    lambda name, n, digest, changed: TensorEntry(name, "F32", (n,), 4 * n, digest, changed),
    st.from_regex(r"[a-z][a-z0-9_.]{0,20}", fullmatch=True),
    st.integers(0, 1 << 20),
    digests,
    st.booleans(),
)
manifests = st.builds(
    VersionManifest,
    st.just("policy"),
    st.integers(0, 2**62 - 1),
    st.lists(entries, max_size=6, unique_by=lambda e: e.name).map(tuple),
    st.integers(0, 2**62 - 1),
)
SIGNED = sign(VersionManifest("policy", 2, tuple(TensorEntry(f"w{i}", "BF16", (3, i), 6 * i, "xxh3-128:" + f"{i:032x}")
                                              for i in range(4)), epoch=1_700_000_000_000), TRAINER)  # fmt: skip
WIRE = SIGNED.to_json()


def test_a_signed_manifest_travels_and_verifies() -> None:
    parsed = VersionManifest.from_json(WIRE, where=WHERE)
    assert parsed == SIGNED
    check_signature(parsed, TRUSTED, where=WHERE)
    assert json.loads(WIRE)["manifest"]["epoch"] == 1_700_000_000_000


def test_unsigned_or_foreign_signatures_are_refused_only_when_keys_are_trusted() -> None:
    unsigned = replace(SIGNED, signature=None)
    with pytest.raises(VerificationError, match="not signed"):
        check_signature(unsigned, TRUSTED, where=WHERE)
    with pytest.raises(VerificationError, match="not a --refit-trust-key"):
        check_signature(sign(unsigned, ROGUE), TRUSTED, where=WHERE)
    check_signature(unsigned, TrustedKeys(), where=WHERE)  # no key trusted: loopback holders only, nothing to check
    # The rogue's signature, made over the trainer's manifest, on a copy claiming the trainer as its signer.
    assert SIGNED.signature is not None
    forged = sign(unsigned, ROGUE)
    assert forged.signature is not None
    mixed = replace(SIGNED, signature=replace(forged.signature, signer=TRAINER.public))
    with pytest.raises(VerificationError, match="does not match"):
        check_signature(mixed, TRUSTED, where=WHERE)


def test_an_artifact_signature_never_passes_for_a_version() -> None:
    """The context string: the trainer's signature of the bare manifest bytes (what another use of the same key
    might sign) is not a version's signature."""
    bare = TRAINER.sign(SIGNED.signed_bytes())
    assert SIGNED.signature is not None
    with pytest.raises(VerificationError, match="does not match"):
        check_signature(replace(SIGNED, signature=replace(SIGNED.signature, value=bare)), TRUSTED, where=WHERE)
    assert TRUSTED.verifies(
        TRAINER.public, TRAINER.sign(CONTEXT + SIGNED.signed_bytes()), CONTEXT + SIGNED.signed_bytes()
    )


@FUZZ
@given(manifest=manifests, data=st.data())
def test_any_change_to_what_is_signed_is_refused(manifest: VersionManifest, data: st.DataObject) -> None:
    signed = sign(manifest, TRAINER)
    check_signature(VersionManifest.from_json(signed.to_json(), where=WHERE), TRUSTED, where=WHERE)
    field = data.draw(st.sampled_from(["version", "epoch", "name", "tensor"]))
    if field == "tensor" and not manifest.tensors:
        field = "version"
    if field == "version":
        changed = replace(signed, version=data.draw(st.integers(0, 2**62 - 1).filter(lambda v: v != manifest.version)))
    elif field == "epoch":
        changed = replace(signed, epoch=data.draw(st.integers(0, 2**62 - 1).filter(lambda e: e != manifest.epoch)))
    elif field == "name":
        changed = replace(signed, name="policy2")
    else:
        i = data.draw(st.integers(0, len(manifest.tensors) - 1))
        old = manifest.tensors[i]
        new = data.draw(digests.filter(lambda d: d != old.digest))
        tensors = (*manifest.tensors[:i], replace(old, digest=new), *manifest.tensors[i + 1 :])
        changed = replace(signed, tensors=tensors)
    with pytest.raises(VerificationError):
        check_signature(VersionManifest.from_json(changed.to_json(), where=WHERE), TRUSTED, where=WHERE)


@FUZZ
@given(position=st.integers(0, len(WIRE) - 1), value=st.integers(0, 255))
def test_any_byte_of_the_document_changed_is_refused_or_means_the_same(position: int, value: int) -> None:
    """One byte of the served document changed (a key, a digit, a quote, the signature): the manifest is refused by
    the parser or by the signature check, or it is the very manifest that was signed (a change JSON does not see)."""
    mutated = bytearray(WIRE)
    mutated[position] = value
    try:
        parsed = VersionManifest.from_json(bytes(mutated), where=WHERE)
        check_signature(parsed, TRUSTED, where=WHERE)
    except RefitError:
        return
    assert parsed == SIGNED


@FUZZ
@given(position=st.integers(0, len(CONTEXT + SIGNED.signed_bytes()) * 8 - 1))
def test_any_bit_of_the_signed_bytes_flipped_fails_the_signature(position: int) -> None:
    message = bytearray(CONTEXT + SIGNED.signed_bytes())
    message[position // 8] ^= 1 << (position % 8)
    assert SIGNED.signature is not None
    assert not TRUSTED.verifies(TRAINER.public, SIGNED.signature.value, bytes(message))


def _within_memory(data: bytes) -> None:
    tracemalloc.start()
    try:
        VersionManifest.from_json(data, where=WHERE)
    except RefitError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= (1 << 20) + 16 * len(data), f"{peak} bytes allocated for a {len(data)}-byte document"


@FUZZ
@given(doc=json_values())
def test_any_json_document_parses_or_is_refused_within_bounds(doc: object) -> None:
    _within_memory(json.dumps(doc).encode())
    _within_memory(json.dumps({"manifest": doc, "signature": doc}).encode())


@FUZZ
@given(raw=st.binary(max_size=512))
def test_any_bytes_parse_or_are_refused(raw: bytes) -> None:
    _within_memory(raw)


def test_hostile_shapes_are_refused_before_they_cost_anything() -> None:
    for raw in (b"[" * 100_000, b'{"manifest": ' * 50_000, b"{}" * 10, WIRE + b" " * (65 << 20)):
        with pytest.raises(RefitError, match=WHERE):
            VersionManifest.from_json(raw, where=WHERE)
    doc = json.loads(WIRE)
    for bad in ({**doc, "extra": 1}, {**doc, "signature": {"signer": "00" * 32}},
                {**doc, "signature": {"signer": "AB" * 32, "value": "00" * 64}},
                {**doc, "manifest": {**doc["manifest"], "epoch": -1}},
                {**doc, "manifest": {**doc["manifest"], "version": 2**62}},
                {**doc, "manifest": {**doc["manifest"], "epoch": True}}):  # fmt: skip
        with pytest.raises(RefitError, match="not a version manifest"):
            VersionManifest.from_json(json.dumps(bad).encode(), where=WHERE)


def test_versions_are_ordered_by_epoch_then_number() -> None:
    assert behind(None, None) == 0
    assert behind(None, (5, 3)) == 3
    assert behind((5, 3), (5, 7)) == 4
    assert behind((5, 7), (5, 7)) == 0
    assert behind((5, 500), (6, 1)) == 1  # a restarted trainer counting from 1 again: one behind, not -499
    assert behind((5, 500), (6, 800)) == 300
    now = 1_700_000_000_000
    assert refusal((5, 2), (5, 1_000_002), max_jump=1_000_000, now_ms=now) is None
    assert "more than --refit-max-jump" in str(refusal((5, 2), (5, 1_000_003), max_jump=1_000_000, now_ms=now))
    assert "more than --refit-max-jump" in str(refusal(None, (5, 10**17), max_jump=1_000_000, now_ms=now))
    assert refusal((5, 500), (6, 1), max_jump=10, now_ms=now) is None
    assert "ahead of this replica's clock" in str(refusal(None, (now + 2 * 86_400_000, 1), max_jump=10, now_ms=now))


def test_without_a_trusted_key_only_this_machine_is_followed() -> None:
    none = TrustedKeys()
    assert holder_allowed("127.0.0.1:9000", none)
    assert holder_allowed("[::1]:9000", none)
    assert not holder_allowed("10.0.0.7:9000", none)
    assert holder_allowed("10.0.0.7:9000", TRUSTED)
    require_trust("redis://127.0.0.1:6379", "127.0.0.1", [])
    require_trust("file:///shared/registry", "127.0.0.1", [])
    require_trust("redis://reg.cluster:6379", "0.0.0.0", ["trainer.key.pub"])
    for registry, host in (("redis://reg.cluster:6379", "127.0.0.1"), ("file:///shared/registry", "0.0.0.0")):
        with pytest.raises(ConfigError, match="preheat artifacts keygen") as refused:
            require_trust(registry, host, [])
        assert "--refit-trust-key" in str(refused.value)
