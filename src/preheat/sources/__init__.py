"""Where checkpoint bytes come from: a local/NFS/Lustre path, HTTP(S) or S3 (a warm peer is a source too, in
``preheat.peer``, which stands above this package).

Every kind implements the two small protocols in ``preheat.sources.base``; the loader and the cache never care which.
``preheat.sources.open.open_origin`` is the one place that picks the kind for a location.
"""

from preheat.sources.base import Origin, Source, is_uri
from preheat.sources.open import open_origin

__all__ = ["Origin", "Source", "is_uri", "open_origin"]
