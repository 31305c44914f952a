"""Open an ``Origin`` for a location: a local directory, an ``http(s)://`` prefix or an ``s3://bucket/prefix``.

The one place that knows every kind of source, so that ``base.py`` stays the protocols alone and importing it (as
every implementation does) pulls in no HTTP or S3 code. Like the KV storage registry (``kv/backends.py``), a table
by scheme names each kind as a ``"module:class"`` string imported on first use: a local load never imports
``http.client`` or boto3. A location of no scheme in the table is a local directory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from preheat.core.errors import ConfigError
from preheat.sources.base import Origin
from preheat.sources.peer_uri import SCHEME, is_peer_uri

# scheme -> the Origin class of its locations; ``base.REMOTE_SCHEMES`` names the same schemes (a test holds them so).
ORIGINS = {
    "http": "preheat.sources.http:HTTPOrigin",
    "https": "preheat.sources.http:HTTPOrigin",
    "s3": "preheat.sources.s3:S3Origin",
}


def open_origin(location: str) -> Origin:
    """The origin for a local directory, an ``http(s)://`` prefix or an ``s3://bucket/prefix``."""
    if is_peer_uri(location):  # a name peers resolve, not a place: it is pulled, then loaded locally
        raise ConfigError(
            f"{location}: {SCHEME} names are pulled from peers into the node cache first: run "
            f"'preheat pull {SCHEME}NAME --registry URL' (or preheat.peer.pull.pull_from_peers) and load the entry "
            "it prints"
        )
    scheme, sep, _ = location.partition("://")
    target = ORIGINS.get(scheme) if sep else None
    if target is None:
        from preheat.sources.local import LocalOrigin

        return LocalOrigin(location)
    module, _, name = target.partition(":")
    kind = cast(Callable[[str], Origin], getattr(importlib.import_module(module), name))
    return kind(location)
