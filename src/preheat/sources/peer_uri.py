"""``preheat://NAME``: a checkpoint named for peers to find, not a place to read from. The one spelling of the
scheme, and its grammar, for every layer that meets such a name (the source picker refuses it, the server and the
vLLM loader pull it from peers, ``preheat.peer`` resolves it). Pure.

>>> parse_peer_uri("preheat://llama-3-8b").name, is_peer_uri("s3://models/llama"), format_peer_uri("smollm2")
('llama-3-8b', False, 'preheat://smollm2')
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from preheat.core.errors import ConfigError

SCHEME = "preheat://"
IDENTITY = re.compile(r"^xxh3-128:[0-9a-f]{32}$")
_NAME = re.compile(r"^[A-Za-z0-9._:@+-]{1,200}$")


@dataclass(frozen=True)
class PeerURI:
    """``preheat://NAME``: NAME is a checkpoint identity (``xxh3-128:...``) or a name peers announce."""

    name: str

    @property
    def is_identity(self) -> bool:
        """Whether NAME is a content identity (then every manifest received is checked against it)."""
        return IDENTITY.match(self.name) is not None

    def __str__(self) -> str:
        return format_peer_uri(self.name)


def is_peer_uri(location: str) -> bool:
    """Whether ``location`` is a ``preheat://`` name to find among peers."""
    return location.startswith(SCHEME)


def format_peer_uri(name: str) -> str:
    """The ``preheat://`` name of ``name``."""
    return SCHEME + name


def peer_name(location: str) -> str | None:
    """NAME of ``preheat://NAME`` as written (unchecked: ``parse_peer_uri`` checks it), None for any other location."""
    return location[len(SCHEME) :] if is_peer_uri(location) else None


def parse_peer_uri(uri: str) -> PeerURI:
    """Parse ``preheat://NAME``; ``ConfigError`` for anything else (paths, queries, empty names)."""
    name = peer_name(uri)
    if name is None:
        raise ConfigError(f"{uri!r} is not a {SCHEME} name")
    name = name.rstrip("/")
    if not _NAME.match(name):
        raise ConfigError(
            f"{uri!r}: write {SCHEME}NAME with NAME a checkpoint identity (xxh3-128:<32 hex>) or a served name "
            "(letters, digits, . _ - : @ +)"
        )
    return PeerURI(name)
