"""preheat: take an LLM replica from cold to serving in seconds.

>>> import preheat
>>> weights = preheat.load("path/to/model")           # doctest: +SKIP
>>> print(weights.report.summary())                   # doctest: +SKIP
"""

from preheat.errors import (
    CacheError,
    CheckpointError,
    ConfigError,
    DeviceError,
    KVError,
    PreheatError,
    SourceAccessError,
    SourceError,
    SourceNotFoundError,
)
from preheat.loader import LoadReport, LoadResult, load

__version__ = "0.1.0"
__all__ = [
    "CacheError",
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "KVError",
    "LoadReport",
    "LoadResult",
    "PreheatError",
    "SourceAccessError",
    "SourceError",
    "SourceNotFoundError",
    "__version__",
    "load",
]
