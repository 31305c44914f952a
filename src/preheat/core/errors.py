"""One typed error tree for everything preheat raises on purpose.

Catch by meaning: ``CheckpointError`` for bad or missing weights, ``SourceError`` when bytes cannot be fetched,
``CacheError``/``KVError`` for caches (which normally degrade to misses instead of raising), ``ConfigError`` for
settings that make no sense. Every message names the file, tensor, URL or key involved, and says what to do.
"""

from __future__ import annotations


class PreheatError(Exception):
    """Base of every error preheat raises deliberately."""


class ConfigError(PreheatError, ValueError):
    """A setting, flag or argument is invalid (for example an unknown mode or a malformed size)."""


class CheckpointError(PreheatError):
    """A checkpoint is missing, malformed, truncated or fails an integrity check.

    ``path`` and ``tensor`` name what was wrong, when known, so callers can report it without parsing the message.
    """

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class SourceError(PreheatError):
    """Bytes could not be fetched from a source (a path, an HTTP(S) or S3 origin, a peer)."""


class SourceNotFoundError(SourceError):
    """The file or object does not exist (HTTP 404/410, S3 NoSuchKey/NoSuchBucket): retrying will not help."""


class SourceAccessError(SourceError):
    """The source refused access (HTTP 401/403, S3 AccessDenied): the credentials or token are missing or wrong."""


class SourceChangedError(SourceError):
    """The origin's file changed while it was being read (another ETag, Last-Modified, size or inode than the one the
    read started with, or HTTP 412): bytes of two versions must never be mixed, so the read starts over."""


class PeerError(SourceError):
    """A peer or the peer registry failed: unreachable, stalled, refused the token, or sent bytes that do not match
    the manifest. Pulls treat it as a lost source and carry on with the others (other peers, then the origin)."""


class RegistryError(PeerError):
    """The peer registry (Redis, or a shared directory) cannot be read or written; pulls fall back to the cache and
    the origin with a warning."""


class ArtifactTrustError(PeerError):
    """Compiled artifacts were refused because no trusted key vouches for them (unsigned, signed by a key not passed
    to ``--trust-key``, or a signature that does not match). The message says how to sign and trust them."""


class RefitError(PeerError):
    """A live weight update (``preheat.refit``) could not be applied: no holder of the version answered, a tensor
    did not match its digest, or a newer version superseded it. The replica stays on the version it serves."""


class CacheError(PreheatError):
    """The node-local model cache failed in a way that cannot be treated as a miss, or has no entry for a key or URI
    named on purpose (``preheat cache rm``)."""


class KVError(PreheatError):
    """The KV cache failed in a way that cannot be treated as a miss."""


class DeviceError(PreheatError):
    """A requested device or device feature (CUDA, GPUDirect Storage) is not available."""


class RequestError(PreheatError):
    """A generation request cannot be served as given (prompt too long, bad sampling parameters, bad messages).

    Recoverable: the engine is unharmed and a server answers 400; the message says what to change.
    """


class ProcessError(PreheatError):
    """A child process (``preheat serve`` as a child, ``preheat up``'s replicas and router) would not start, exited,
    or did not answer as it should; the message names the process or its URL and shows its last output."""


class RouterError(PreheatError):
    """The router cannot start or reach any replica (bad replica URL, no tokenizer for a cache-aware policy)."""


class PlanError(PreheatError):
    """A planning input (a request trace, a cold-start timeline) cannot be used; the message names the file and line."""
