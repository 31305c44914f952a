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


class CacheError(PreheatError):
    """The node-local model cache failed in a way that cannot be treated as a miss."""


class KVError(PreheatError):
    """The KV cache failed in a way that cannot be treated as a miss."""


class DeviceError(PreheatError):
    """A requested device or device feature (CUDA, GPUDirect Storage) is not available."""


class RequestError(PreheatError):
    """A generation request cannot be served as given (prompt too long, bad sampling parameters, bad messages).

    Recoverable: the engine is unharmed and a server answers 400; the message says what to change.
    """
