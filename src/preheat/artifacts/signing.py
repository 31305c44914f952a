"""Ed25519 keys: who may vouch for code another replica will run, and for weights it will serve.

The one home of signing in preheat: sign bytes with a private key (``SigningKey.sign``), check bytes against the keys
an operator trusts (``TrustedKeys.verifies``). Two callers, each with its own context string in what it signs, so a
signature made for one can never pass for the other:

- compiled artifacts (``preheat.artifacts.blobs``): a blob is code (generated Python, shared objects, pickled
  graphs), so a replica installs one from elsewhere only when a key its operator trusts signed it (``--trust-key``);
- weights versions (``preheat.refit.trust``): a trainer signs each version's manifest (``Publisher(signing_key=)``,
  ``preheat refit publish --signing-key``), and ``--follow`` replicas apply only versions a ``--refit-trust-key``
  signed.

Keys are ordinary PEM files, readable by OpenSSL:

- private key: PKCS#8 ``-----BEGIN PRIVATE KEY-----``, written 0600 by ``preheat artifacts keygen OUT``;
- public key: SubjectPublicKeyInfo ``-----BEGIN PUBLIC KEY-----``, written beside it as ``OUT.pub``, and what
  ``--trust-key`` (``PREHEAT_TRUST_KEY``) and ``--refit-trust-key`` (``PREHEAT_REFIT_TRUST_KEY``) name.

Public keys are parsed here without ``cryptography`` (an Ed25519 SubjectPublicKeyInfo is a fixed 44-byte DER), so
``preheat serve`` checks ``--trust-key`` before it binds without importing a crypto library; ``cryptography`` is
imported only to make keys, sign, and verify a signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from preheat.core import env as envs
from preheat.core.errors import ConfigError

# DER of SubjectPublicKeyInfo{ algorithm: id-Ed25519 (1.3.101.112), subjectPublicKey: BIT STRING of 32 bytes }.
_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")
_PUBLIC_PEM = ("-----BEGIN PUBLIC KEY-----", "-----END PUBLIC KEY-----")
_MAX_KEY_FILE = 64 * 1024  # a PEM key is ~120 bytes; anything this large is not one
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64


def fingerprint(public: bytes) -> str:
    """``ed25519:<16 hex digits>``: the first 8 bytes of the SHA-256 of the raw public key (for messages)."""
    return "ed25519:" + hashlib.sha256(public).hexdigest()[:16]


def public_key_from_pem(text: str, *, where: str) -> bytes:
    """The raw 32-byte Ed25519 public key in a PEM ``PUBLIC KEY`` block; ``ConfigError`` naming ``where`` otherwise."""
    if "PRIVATE KEY" in text:
        raise ConfigError(f"{where}: this is a private key; trust the public key beside it ({where}.pub)")
    lines = [line.strip() for line in text.strip().splitlines()]
    if len(lines) < 3 or (lines[0], lines[-1]) != _PUBLIC_PEM:
        raise ConfigError(f"{where}: not a PEM public key (make one with `preheat artifacts keygen`)")
    try:
        der = base64.b64decode("".join(lines[1:-1]), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"{where}: the PEM body is not base64") from None
    if len(der) != len(_SPKI_PREFIX) + PUBLIC_KEY_BYTES or not der.startswith(_SPKI_PREFIX):
        raise ConfigError(f"{where}: not an Ed25519 public key (make one with `preheat artifacts keygen`)")
    return der[len(_SPKI_PREFIX) :]


def public_key_pem(public: bytes) -> str:
    """The PEM text of a raw Ed25519 public key (what ``keygen`` writes to ``OUT.pub``)."""
    body = base64.b64encode(_SPKI_PREFIX + public).decode()
    return f"{_PUBLIC_PEM[0]}\n{body}\n{_PUBLIC_PEM[1]}\n"


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(_MAX_KEY_FILE + 1)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the key file ({exc})") from None
    if len(text) > _MAX_KEY_FILE:
        raise ConfigError(f"{path}: too large to be a key file")
    return text


def read_public_key(path: str) -> bytes:
    """The raw Ed25519 public key in the PEM file at ``path``."""
    return public_key_from_pem(_read_small(path), where=path)


def trust_key_files(given: Sequence[str] | None, env: Mapping[str, str] | None = None) -> list[str]:
    """The trusted public key files: ``given`` (``--trust-key``, even empty), else ``PREHEAT_TRUST_KEY``
    (comma-separated), as ``preheat serve`` reads them."""
    if given is not None:
        return list(given)
    files: tuple[str, ...] = envs.get(envs.TRUST_KEY, env)
    return list(files)


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys whose signatures make another replica's artifacts installable (empty: none are)."""

    keys: frozenset[bytes] = frozenset()

    @classmethod
    def from_files(cls, paths: Iterable[str]) -> TrustedKeys:
        """Read every ``--trust-key`` file; ``ConfigError`` naming the first that is not an Ed25519 public key."""
        return cls(frozenset(read_public_key(path) for path in paths))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __contains__(self, public: object) -> bool:
        return public in self.keys

    def describe(self) -> str:
        return ", ".join(sorted(fingerprint(k) for k in self.keys)) or "none"

    def verifies(self, signer: bytes, signature: bytes, message: bytes) -> bool:
        """Whether ``signer`` is one of these keys and ``signature`` is its signature of ``message``."""
        return signer in self.keys and verify_signature(signer, signature, message)


def verify_signature(public: bytes, signature: bytes, message: bytes) -> bool:
    """Whether ``signature`` is ``public``'s Ed25519 signature of ``message``."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


class SigningKey:
    """An Ed25519 private key read from a PEM file (``preheat artifacts sign --key``)."""

    def __init__(self, pem: bytes, *, where: str) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as exc:  # not PEM, encrypted, or an unsupported key
            raise ConfigError(f"{where}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"{where}: not an Ed25519 key (make one with `preheat artifacts keygen`)")
        self._key = key
        self.public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @classmethod
    def read(cls, path: str) -> SigningKey:
        return cls(_read_small(path).encode(), where=path)

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)


def generate(out: str, *, force: bool = False) -> tuple[str, str, bytes]:
    """Write a new key pair: ``out`` (private, mode 0600) and ``out.pub`` (public). Returns both paths and the raw
    public key. Existing files are kept unless ``force``: overwriting a fleet's key by accident would orphan every
    signature made with it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    public_path = f"{out}.pub"
    for path in (out, public_path):
        if os.path.lexists(path) and not force:
            raise ConfigError(f"{path} exists; choose another name or pass --force to replace it")
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    try:
        if os.path.lexists(out):  # only with --force (checked above)
            os.unlink(out)
        # O_EXCL: the file is created here with mode 0600, never an existing file's mode or a symlink's target.
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(private_pem)
        with open(public_path, "w", encoding="utf-8") as handle:
            handle.write(public_key_pem(public))
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write the key pair ({exc.strerror})") from None
    return out, public_path, public
