"""S3 origins (``s3://bucket/prefix``) through boto3: ranged ``GetObject`` streamed into the loader's buffers.

One boto3 client per origin, shared by every reader thread (boto3 clients are thread-safe), with its connection pool
sized for the loader's threads. The endpoint comes from ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``), which
boto3 reads itself, so MinIO, Ceph, R2 or a local moto server work unchanged; credentials come from the usual places
(environment, ``~/.aws``, instance roles). With no credentials at all, requests go unsigned, which is what public
buckets want.

Retries are preheat's own (``preheat.sources.net``), not botocore's, so a dead endpoint fails after the same few short
backoffs as HTTP and a connection dropped mid-body resumes from the bytes already received. A ``ContentRange`` that is
not exactly the range asked for is refused. botocore's stream copies each block once (urllib3 reads, then copies into
the buffer); blocks are bounded to 1 MiB so that copy never needs a large temporary.

Versions: ``HeadObject``'s ``ETag`` and ``LastModified`` are the object's validator; after ``require(validator)``
every ranged ``GetObject`` carries ``IfMatch`` and a replaced object raises ``SourceChangedError``.

Install with ``pip install 'preheat[s3]'``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypedDict, TypeVar

from preheat.core.errors import (
    ConfigError,
    SourceAccessError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
    TransientError,
)
from preheat.http.ranges import parse_content_range, range_header
from preheat.sources.base import Validator, check_name, strong_etag, too_large
from preheat.sources.net import NetSettings, retrying
from preheat.sources.remote import Cursor, RemoteFile
from preheat.sources.stats import TOTALS, TransferStats

if TYPE_CHECKING:
    from datetime import datetime

T = TypeVar("T")


# boto3's S3 client as this module uses it (boto3 ships no types): two calls, their answers' keys that are read, and
# the body's three methods. Requests are keyword arguments named as the S3 API names them (Bucket, Key, Range, IfMatch).
class _Body(Protocol):
    """botocore's ``StreamingBody``."""

    def read(self, amt: int | None = None) -> bytes: ...

    def readinto(self, buffer: memoryview) -> int: ...

    def close(self) -> None: ...


class HeadObjectAnswer(TypedDict, total=False):
    ContentLength: int
    ETag: str
    LastModified: datetime


class GetObjectAnswer(HeadObjectAnswer, total=False):
    Body: _Body
    ContentRange: str


class S3Client(Protocol):
    def head_object(self, **request: str) -> HeadObjectAnswer: ...

    def get_object(self, **request: str) -> GetObjectAnswer: ...
_BLOCK = 1 << 20
POOL_CONNECTIONS = 64  # at least the loader's remote thread count (16), with room for concurrent loads and pulls

_NOT_FOUND = frozenset({"404", "NoSuchKey", "NoSuchBucket", "NotFound"})
_DENIED = frozenset(
    {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "AllAccessDisabled"}
)
_TRANSIENT = frozenset(
    {"SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "503", "500"}
)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix/`` -> ``("bucket", "some/prefix")``."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"{uri}: not an s3:// URI")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not bucket:
        raise ConfigError(f"{uri}: no bucket name (expected s3://bucket/prefix)")
    return bucket, prefix.strip("/")


def make_client(settings: NetSettings, *, max_connections: int = POOL_CONNECTIONS) -> S3Client:
    """A boto3 S3 client with preheat's timeouts, botocore's own retries off, and a pool for many threads."""
    try:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        raise ConfigError("s3:// sources need boto3: pip install 'preheat[s3]'") from None
    session = boto3.session.Session()
    options: dict[str, object] = {
        "max_pool_connections": max_connections,
        "connect_timeout": settings.connect_timeout,
        "read_timeout": settings.read_timeout,
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    }
    if session.get_credentials() is None:
        options["signature_version"] = UNSIGNED  # public buckets; a private one answers AccessDenied, named below
    # A region is needed to sign; any works for path-style endpoints such as MinIO or moto.
    client: S3Client = session.client("s3", region_name=session.region_name or "us-east-1", config=Config(**options))
    return client


class S3Origin:
    """A bucket prefix holding a checkpoint's files.

    >>> origin = S3Origin("s3://models/llama-3-8b")                        # doctest: +SKIP
    >>> origin.exists("model.safetensors.index.json")                      # doctest: +SKIP
    """

    def __init__(self, uri: str, *, client: S3Client | None = None, settings: NetSettings | None = None) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.settings = settings if settings is not None else NetSettings.from_env()
        self.stats = TransferStats(parent=TOTALS)
        self.client = client if client is not None else make_client(self.settings)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def key(self, name: str) -> str:
        name = check_name(name)
        return f"{self.prefix}/{name}" if self.prefix else name

    def join(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def exists(self, name: str) -> bool:
        """HeadObject: a missing key is False; AccessDenied raises ``SourceAccessError``."""
        key, url = self.key(name), self.join(name)

        def attempt() -> bool:
            try:
                self.request(url, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
            except SourceNotFoundError:
                return False
            return True

        return retrying(attempt, settings=self.settings, what=f"HeadObject {url}", stats=self.stats)

    def read_bytes(self, name: str) -> bytes:
        """GetObject of a small file, whole: at most ``settings.whole_file_limit`` bytes (``SourceError`` beyond)."""
        key, url = self.key(name), self.join(name)
        limit = self.settings.whole_file_limit

        def attempt() -> bytes:
            response = self.request(url, lambda: self.client.get_object(Bucket=self.bucket, Key=key))
            body = response["Body"]
            try:
                announced = response.get("ContentLength")
                if isinstance(announced, int) and announced > limit:
                    raise too_large(url, announced, limit)
                data = bytes(_stream_call(partial(body.read, limit + 1)))
            finally:
                body.close()
            self.stats.add(nbytes=len(data))
            if len(data) > limit:
                raise too_large(url, None, limit)
            return data

        return retrying(attempt, settings=self.settings, what=f"GetObject {url}", stats=self.stats)

    def open(self, name: str) -> S3Object:
        return S3Object(self, self.key(name), self.join(name))

    def close(self) -> None:
        """Nothing to release: the client's pool is closed when the origin is garbage-collected."""

    def request(self, url: str, call: Callable[[], T]) -> T:
        """Run one boto3 request about ``url``, counting it and mapping its failures to preheat's errors."""
        self.stats.add(requests=1)
        return _client_call(url, call)


class S3Object(RemoteFile):
    """One object; ``readv`` sends a ranged GetObject and is safe from many threads (the client is thread-safe)."""

    verbs = ("HeadObject", "GetObject")
    changed = "was replaced"

    def __init__(self, origin: S3Origin, key: str, url: str) -> None:
        super().__init__(url, settings=origin.settings, stats=origin.stats)
        self._origin = origin
        self._key = key

    def _probe_size(self) -> int:
        origin = self._origin
        response = origin.request(self._url, lambda: origin.client.head_object(Bucket=origin.bucket, Key=self._key))
        size = int(response["ContentLength"])
        modified = response.get("LastModified")
        self._seen = Validator(
            size,
            etag=strong_etag(response.get("ETag")),
            modified=modified.isoformat() if modified is not None else None,
        )
        return size

    def _attempt(self, offset: int, cursor: Cursor, size: int) -> None:
        origin = self._origin
        first, last = offset + cursor.done, offset + cursor.total - 1
        what = f"GetObject {self._url} bytes {first}-{last}"
        conditions = {"IfMatch": self._pinned.etag} if self._pinned is not None and self._pinned.etag else {}
        response = origin.request(  # a replaced object: 412 PreconditionFailed -> SourceChangedError
            self._url,
            lambda: origin.client.get_object(
                Bucket=origin.bucket, Key=self._key, Range=range_header(first, last), **conditions
            ),
        )
        body = response["Body"]
        received = 0
        try:
            etag = strong_etag(response.get("ETag"))
            if self._pinned is not None and self._pinned.etag and etag and etag != self._pinned.etag:
                raise SourceChangedError(f"{what}: the object was replaced (ETag {etag}, was {self._pinned.etag})")
            got = parse_content_range(response.get("ContentRange"))
            if got is None or (got.first, got.last) != (first, last):
                raise SourceError(
                    f"{what}: the endpoint answered ContentRange {response.get('ContentRange')!r}; refusing bytes "
                    "that may not be the ones asked for"
                )
            if got.total is not None and got.total != size:
                raise SourceChangedError(f"{what}: the object is now {got.total} bytes, was {size}; it was replaced")
            while cursor.remaining:
                n = _stream_call(partial(body.readinto, cursor.next_view(_BLOCK)))
                if n == 0:
                    raise TransientError(f"connection closed after {received} of {last - first + 1} bytes")
                cursor.advance(n)
                received += n
        finally:
            body.close()
            origin.stats.add(nbytes=received)


def _client_call(url: str, request: Callable[[], T]) -> T:
    """Map botocore's failures: missing -> ``SourceNotFoundError``, denied -> ``SourceAccessError``, throttling, 5xx
    and network errors -> ``TransientError``; anything else -> ``SourceError``, all naming ``url``."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    try:
        return request()
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        message = error.get("Message") or code
        if code == "PreconditionFailed" or status == 412:
            raise SourceChangedError(f"{url}: replaced since it was first read ({code}: {message})") from None
        if code in _NOT_FOUND or status == 404:
            raise SourceNotFoundError(f"{url}: not found ({code}: {message})") from None
        if code in _DENIED or status in (401, 403):
            raise SourceAccessError(
                f"{url}: access denied ({code}: {message}); check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or "
                "AWS_PROFILE) and that they may read this bucket (S3 also answers 403 for a missing key when "
                "the credentials may not list the bucket)"
            ) from None
        if code in _TRANSIENT or status >= 500 or status == 429:
            raise TransientError(f"{code or status}: {message}") from exc
        raise SourceError(f"{url}: {code or status}: {message}") from None
    except (NoCredentialsError, PartialCredentialsError) as exc:
        raise SourceAccessError(f"{url}: {exc}; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE") from None
    except (BotoCoreError, OSError) as exc:
        raise TransientError(str(exc) or type(exc).__name__) from exc


def _stream_call(read: Callable[[], T]) -> T:
    """Read from a response body, turning a dropped connection or a timeout into ``TransientError``."""
    from botocore.exceptions import BotoCoreError

    try:
        return read()
    except (BotoCoreError, OSError) as exc:
        raise TransientError(str(exc) or type(exc).__name__) from exc
    except Exception as exc:
        # urllib3's ProtocolError/ReadTimeoutError can escape botocore's wrappers on some versions; they are network
        # failures like the others. Anything that is not from the network stack is re-raised untouched.
        if type(exc).__module__.startswith(("urllib3", "http.client")):
            raise TransientError(str(exc) or type(exc).__name__) from exc
        raise
