"""The fleet secret of the L2 chunks (``--kv-secret-file``) and the keyed BLAKE2b tag made with it.

A chunk's XXH3 checksum catches accidents (a torn write, a flipped bit), not an adversary: chunk keys are public
(docs/kv-keys.md) and XXH3 is not a cryptographic hash, so anyone who can write the shared store could plant K/V of
their choosing. With a secret that every replica of a fleet shares, each chunk also carries a BLAKE2b-256 tag keyed
with it (docs/kv-cache.md, format version 2), and a replica loads only chunks whose tag it can recompute: writing
the store is no longer enough to make a replica serve chosen K/V; reading the secret file is.

Torch-free: ``preheat serve`` checks the file before it imports the engine.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat

from preheat.core.errors import ConfigError

log = logging.getLogger("preheat.kv")

TAG_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_SECRET_FILE_BYTES = 4096  # a secret file holds one secret; anything larger is the wrong file
_KEY_PERSON = b"preheat kv key"  # BLAKE2b personalisation (at most 16 bytes): keys and tags never collide
_TAG_PERSON = b"preheat kv chunk"
_HOW = "create one with `openssl rand -hex 32 > FILE; chmod 600 FILE` and give every replica the same file"


def derive_key(secret: bytes) -> bytes:
    """The 32-byte MAC key for ``secret`` (any length from ``MIN_SECRET_BYTES`` on: BLAKE2b keys stop at 64)."""
    return hashlib.blake2b(secret, digest_size=32, person=_KEY_PERSON).digest()


def tagger(key: bytes) -> hashlib.blake2b:  # hashlib.blake2b is the class of the hash object
    """A keyed BLAKE2b-256 to ``update`` with a chunk's bytes; ``digest()`` is its tag."""
    return hashlib.blake2b(key=key, digest_size=TAG_BYTES, person=_TAG_PERSON)


def read_secret_file(path: str, *, warn: bool = True) -> bytes:
    """The secret in ``path`` (surrounding whitespace removed, so an editor's final newline does not change it),
    or ``ConfigError`` saying what is wrong. ``warn``: log a warning when every user of the machine can read it.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w") as f:
    ...     _ = f.write("0123456789abcdef0123456789abcdef\\n"); f.flush()
    ...     read_secret_file(f.name, warn=False)
    b'0123456789abcdef0123456789abcdef'
    """
    flag = f"--kv-secret-file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # O_NONBLOCK: a FIFO cannot hang start-up
    except FileNotFoundError:
        raise ConfigError(f"{flag}: no such file; {_HOW}") from None
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read it ({exc.strerror or exc})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{flag}: not a regular file; {_HOW}")
        if info.st_size > MAX_SECRET_FILE_BYTES:
            raise ConfigError(
                f"{flag}: {info.st_size} bytes, more than a secret file holds ({MAX_SECRET_FILE_BYTES}): is it the "
                "right file?"
            )
        raw = os.read(fd, MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    secret = raw.strip()
    if not secret:
        raise ConfigError(f"{flag}: the file is empty; {_HOW}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{flag}: the secret is {len(secret)} bytes, too short to resist guessing (at least {MIN_SECRET_BYTES}); "
            f"{_HOW}"
        )
    if warn and info.st_mode & stat.S_IROTH:
        log.warning(
            "%s is readable by every user of this machine (mode %o): whoever reads it can forge KV chunks for the "
            "whole fleet; chmod 600 it",
            flag,
            stat.S_IMODE(info.st_mode),
        )
    return secret
