"""Open an ``Origin`` for a location: a local directory, an ``http(s)://`` prefix or an ``s3://bucket/prefix``.

The one place that knows every kind of source, so that ``base.py`` stays the protocols alone and importing it (as
every implementation does) pulls in no HTTP or S3 code. The kinds are imported on first use: a local load never
imports ``http.client`` or boto3.
"""

from __future__ import annotations

from preheat.core.errors import ConfigError
from preheat.sources.base import Origin


def open_origin(location: str) -> Origin:
    """The origin for a local directory, an ``http(s)://`` prefix or an ``s3://bucket/prefix``."""
    if location.startswith("preheat://"):  # a name peers resolve, not a place: it is pulled, then loaded locally
        raise ConfigError(
            f"{location}: preheat:// names are pulled from peers into the node cache first: run "
            "'preheat pull preheat://NAME --registry URL' (or preheat.peer.pull.pull_from_peers) and load the entry "
            "it prints"
        )
    if location.startswith(("http://", "https://")):
        from preheat.sources.http import HTTPOrigin

        return HTTPOrigin(location)
    if location.startswith("s3://"):
        from preheat.sources.s3 import S3Origin

        return S3Origin(location)
    from preheat.sources.local import LocalOrigin

    return LocalOrigin(location)
