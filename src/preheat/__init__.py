"""preheat: take an LLM replica from cold to serving in seconds.

>>> import preheat
>>> weights = preheat.load("path/to/model")           # doctest: +SKIP
>>> print(weights.report.summary())                   # doctest: +SKIP
"""

from preheat.errors import CheckpointError, ConfigError, DeviceError, PreheatError, SourceError
from preheat.loader import LoadReport, LoadResult, load

__version__ = "0.1.0"
__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "LoadReport",
    "LoadResult",
    "PreheatError",
    "SourceError",
    "__version__",
    "load",
]
