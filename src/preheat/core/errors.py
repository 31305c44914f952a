"""One typed error tree for everything preheat raises on purpose.

Catch by meaning: ``CheckpointError`` for bad or missing weights, ``SourceError`` when bytes cannot be fetched,
``CacheError``/``KVError`` for caches (which normally degrade to misses instead of raising), ``ConfigError`` for
settings that make no sense. Every message names the file, tensor, URL or key involved, and says what to do.

Every exception class of preheat is defined here, and every ``PreheatError`` is importable from ``preheat`` itself
(tests/unit/test_errors.py keeps both so). The tree, a subclass indented under its base::

    PreheatError
        ConfigError                 (also a ValueError)
        CheckpointError
        SourceError
            SourceNotFoundError
            SourceAccessError
            SourceChangedError
            TransientError          retried; callers see SourceError when the attempts run out
            PeerError
                RegistryError
                ArtifactTrustError
                NixlError
                RefitError
                    SupersededError
                    VerificationError
        CacheError
        KVError
            CorruptChunkError
                MacError
        DeviceError
        RequestError
        ProcessError
            ChildGoneError
        RouterError
            UpstreamError
            ColdStartError
            EngineEventError
        PlanError
        JSONInputError              (also a ValueError)
        HTTPClientError
            ConnectError
            ResponseTimeoutError
            ExchangeError
            AnswerTooLargeError
            RedirectError
        UnsatisfiableRangeError
        APIError
        QueueFullError
        WorkerPausedError
        ClientGoneError
        GoneError
        ForbiddenPathError

    Signals, not errors (below PreheatError's tree, never exported, never seen outside the path that raises them):
        Reframe                     the KV file tier
        _NoRoomError                the KV file tier
        DirectIOUnsupported         the loader's O_DIRECT reads
        _LookedError                the router's chat skeletons (text/skeleton.py)
"""

from __future__ import annotations


class PreheatError(Exception):
    """Base of every error preheat raises deliberately."""


# -- settings, checkpoints, devices ----------------------------------------------------------------------------------


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


class DeviceError(PreheatError):
    """A requested device or device feature (CUDA, GPUDirect Storage) is not available."""


# -- sources and peers -----------------------------------------------------------------------------------------------


class SourceError(PreheatError):
    """Bytes could not be fetched from a source (a path, an HTTP(S) or S3 origin, a peer)."""


class SourceNotFoundError(SourceError):
    """The file or object does not exist (HTTP 404/410, S3 NoSuchKey/NoSuchBucket): retrying will not help."""


class SourceAccessError(SourceError):
    """The source refused access (HTTP 401/403, S3 AccessDenied): the credentials or token are missing or wrong."""


class SourceChangedError(SourceError):
    """The origin's file changed while it was being read (another ETag, Last-Modified, size or inode than the one the
    read started with, or HTTP 412): bytes of two versions must never be mixed, so the read starts over."""


class TransientError(SourceError):
    """A failure worth retrying (network error, timeout, 5xx, 429) in one attempt of a remote read.

    ``sources.net.retrying`` retries it and raises a ``SourceError`` naming the URL once the attempts run out, so
    callers normally never see it; it is a ``SourceError`` so that one that ever escapes a retry loop is still caught
    as the failed fetch it is.
    """


class PeerError(SourceError):
    """A peer or the peer registry failed: unreachable, stalled, refused the token, or sent bytes that do not match
    the manifest. Pulls treat it as a lost source and carry on with the others (other peers, then the origin)."""


class RegistryError(PeerError):
    """The peer registry (Redis, or a shared directory) cannot be read or written; pulls fall back to the cache and
    the origin with a warning."""


class ArtifactTrustError(PeerError):
    """Compiled artifacts were refused because no trusted key vouches for them (unsigned, signed by a key not passed
    to ``--trust-key``, or a signature that does not match). The message says how to sign and trust them."""


class NixlError(PeerError):
    """NIXL could not be set up or a transfer failed; the caller falls back to TCP."""


class RefitError(PeerError):
    """A live weight update (``preheat.refit``) could not be applied: no holder of the version answered, a tensor
    did not match its digest, or a newer version superseded it. The replica stays on the version it serves."""


class SupersededError(RefitError):
    """A newer version appeared while this one was being pulled: the pull was abandoned."""


class VerificationError(RefitError):
    """A holder sent bytes that do not match the manifest (length or digest): it is not asked again."""


# -- caches ----------------------------------------------------------------------------------------------------------


class CacheError(PreheatError):
    """The node-local model cache failed in a way that cannot be treated as a miss, or has no entry for a key or URI
    named on purpose (``preheat cache rm``)."""


class KVError(PreheatError):
    """The KV cache failed in a way that cannot be treated as a miss."""


class CorruptChunkError(KVError):
    """A stored chunk failed a check (torn, flipped, foreign, too large): the tier treats it as a miss and removes
    it."""


class MacError(CorruptChunkError):
    """A chunk's keyed tag is wrong or missing (forged, written under another secret, or unkeyed while this replica
    requires a MAC), or the chunk is keyed and this replica has no secret."""


# -- processes, serving, routing -------------------------------------------------------------------------------------


class RequestError(PreheatError):
    """A generation request cannot be served as given (prompt too long, bad sampling parameters, bad messages).

    Recoverable: the engine is unharmed and a server answers 400; the message says what to change.
    """


class ProcessError(PreheatError):
    """A child process (``preheat serve`` as a child, ``preheat up``'s replicas and router) would not start, exited,
    or did not answer as it should; the message names the process or its URL and shows its last output."""


class ChildGoneError(ProcessError):
    """The tokenizer process closed its end (it died, or was let go): the server builds the tokenizer itself."""


class APIError(PreheatError):
    """A request the server refuses, carrying the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, object]:
        """``{"error": {"message", "type", "param", "code"}}``, the shape OpenAI clients parse."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class QueueFullError(PreheatError):
    """The waiting line is full; the request should be retried later (HTTP 429)."""


class WorkerPausedError(PreheatError):
    """The worker takes no new requests: the replica is going to sleep (HTTP 503)."""


class ClientGoneError(PreheatError):
    """The client closed the connection; its generation was cancelled."""


class RouterError(PreheatError):
    """The router cannot start or reach any replica (bad replica URL, no tokenizer for a cache-aware policy)."""


class UpstreamError(RouterError):
    """A replica could not be reached, or failed before sending a response (``before_first_byte``: safe to retry)."""

    def __init__(self, message: str, *, before_first_byte: bool) -> None:
        super().__init__(message)
        self.before_first_byte = before_first_byte


class ColdStartError(RouterError):
    """A cold start that did not end with a serving replica; ``refused``: the replica may never load this model."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class EngineEventError(RouterError):
    """A frame or payload that is not an engine KV-event batch (the message says what and where). ``oversized``:
    refused for a size past its bound (a payload, a block hash), which the router counts apart."""

    def __init__(self, message: str, *, oversized: bool = False) -> None:
        super().__init__(message)
        self.oversized = oversized


class GoneError(PreheatError):
    """A Kubernetes watch cannot resume from its version (410 Gone): the watcher lists again."""


class PlanError(PreheatError):
    """A planning input (a request trace, a cold-start timeline) cannot be used; the message names the file and line."""


# -- bytes on the wire -----------------------------------------------------------------------------------------------


# A ValueError too: code that caught json.JSONDecodeError/ValueError around json.loads keeps working unchanged, and
# callers (manifest and safetensors readers, the router's body parsers) catch it as one.
class JSONInputError(PreheatError, ValueError):
    """A JSON document from outside was refused: too large, nested too deeply, not UTF-8, or not JSON."""


class HTTPClientError(PreheatError):
    """A request to ``url`` failed before a whole answer came back."""

    def __init__(self, url: str, message: str) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url


class ConnectError(HTTPClientError):
    """No connection: nothing was sent. ``refused``: the host is up and nothing listens on the port."""

    def __init__(self, url: str, message: str, *, refused: bool, cause: OSError | None = None) -> None:
        super().__init__(url, message)
        self.refused = refused
        self.cause = cause  # the socket or TLS failure, for callers that tell a rejected certificate apart


class ResponseTimeoutError(HTTPClientError):
    """The request was sent and no answer came within the read timeout."""


class ExchangeError(HTTPClientError):
    """The connection broke during the exchange (reset, closed early) or the answer was not valid HTTP."""


class AnswerTooLargeError(HTTPClientError):
    """The answer's body is larger than the caller accepts (the connection was closed: the rest is unread)."""


class RedirectError(HTTPClientError):
    """A redirect the ``Redirects`` policy refuses to follow: too many, or to a scheme other than http(s)."""


class UnsatisfiableRangeError(PreheatError):
    """The requested range starts at or past the end of the file (answer 416 with ``Content-Range: bytes */size``)."""


class ForbiddenPathError(PreheatError):
    """The request names a path outside the served root (the test file server answers 403)."""


# -- signals ---------------------------------------------------------------------------------------------------------
# Not errors: nothing failed. Each tells a read path to read a file another way, is raised and caught inside that path
# (the KV file tier: kv/fs.py, kv/blob_reads.py; the loader: io/reads.py, loader/load.py; the router's chat skeletons:
# text/skeleton.py) and never reaches a caller of
# preheat. So they are no PreheatError (an `except PreheatError`/`except KVError` meant for failures must never swallow
# one) and not exported.


class Reframe(Exception):  # noqa: N818  # a signal to read the file another way, not an error
    """A value's header is valid but not where ``blob_frame`` predicted it (a file of another writer), or no frame
    fits the file: read its header first (``FileTier.read_framed`` falls back to ``read_split``)."""


class _NoRoomError(Exception):  # private to the KV file tier, whose read path counts it as a miss
    """``read_split``'s caller had no memory for the value: a miss, nothing wrong with the file."""


class DirectIOUnsupported(Exception):  # noqa: N818  # a signal to read the file without O_DIRECT, not an error
    """The filesystem refused O_DIRECT for ``path`` (EINVAL when opening it, or at a page-aligned read into page-aligned
    memory: ramfs, some FUSE mounts). Raised by the readers for direct jobs only; the loader reads the checkpoint again
    with buffered reads and says so in the report."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path}: the filesystem does not support O_DIRECT")
        self.path = path


class _LookedError(Exception):  # private to text/skeleton, which renders the chat by its template instead
    """A skeleton render touched a content beyond writing it out: this shape must be rendered by the template."""
