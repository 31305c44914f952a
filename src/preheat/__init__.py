"""preheat: take an LLM replica from cold to serving in seconds.

>>> import preheat
>>> weights = preheat.load("path/to/model")           # doctest: +SKIP
>>> print(weights.report.summary())                   # doctest: +SKIP
"""

from typing import TYPE_CHECKING, Any

from preheat.core.errors import (
    AnswerTooLargeError,
    APIError,
    ArtifactTrustError,
    CacheError,
    CheckpointError,
    ChildGoneError,
    ClientGoneError,
    ColdStartError,
    ConfigError,
    ConnectError,
    CorruptChunkError,
    DeviceError,
    EngineEventError,
    ExchangeError,
    ForbiddenPathError,
    GoneError,
    HTTPClientError,
    JSONInputError,
    KVError,
    MacError,
    NixlError,
    PeerError,
    PlanError,
    PreheatError,
    ProcessError,
    QueueFullError,
    RedirectError,
    RefitError,
    RegistryError,
    RequestError,
    ResponseTimeoutError,
    RouterError,
    SourceAccessError,
    SourceChangedError,
    SourceError,
    SourceNotFoundError,
    SupersededError,
    TransientError,
    UnsatisfiableRangeError,
    UpstreamError,
    VerificationError,
    WorkerPausedError,
)

if TYPE_CHECKING:
    from preheat.loader.load import LoadReport, LoadResult, load

__version__ = "0.1.0"
__all__ = [
    "APIError",
    "AnswerTooLargeError",
    "ArtifactTrustError",
    "CacheError",
    "CheckpointError",
    "ChildGoneError",
    "ClientGoneError",
    "ColdStartError",
    "ConfigError",
    "ConnectError",
    "CorruptChunkError",
    "DeviceError",
    "EngineEventError",
    "ExchangeError",
    "ForbiddenPathError",
    "GoneError",
    "HTTPClientError",
    "JSONInputError",
    "KVError",
    "LoadReport",
    "LoadResult",
    "MacError",
    "NixlError",
    "PeerError",
    "PlanError",
    "PreheatError",
    "ProcessError",
    "QueueFullError",
    "RedirectError",
    "RefitError",
    "RegistryError",
    "RequestError",
    "ResponseTimeoutError",
    "RouterError",
    "SourceAccessError",
    "SourceChangedError",
    "SourceError",
    "SourceNotFoundError",
    "SupersededError",
    "TransientError",
    "UnsatisfiableRangeError",
    "UpstreamError",
    "VerificationError",
    "WorkerPausedError",
    "__version__",
    "load",
]


def __getattr__(name: str) -> Any:  # Any: whichever loader object was asked for
    # The loader imports torch (~1.5 s); `preheat serve` must bind its socket before paying that, so the loader's
    # names are imported on first use instead of with the package.
    if name in ("LoadReport", "LoadResult", "load"):
        from preheat.loader import load as loader

        return getattr(loader, name)
    raise AttributeError(f"module 'preheat' has no attribute {name!r}")
