"""What a doctor check is: the options every check is given (``DoctorOptions``) and a check's record (``Check``).

Below both the checks (``node``, ``reads``, ``replica``, ``origin``, ``gpu``), which each list theirs, and the runner
(``run``), which collects and runs them: so the runner imports the checks and no check imports the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from preheat.doctor.findings import Area, Finding

DEFAULT_BUDGET_S = 30.0


@dataclass(frozen=True)
class DoctorOptions:
    """What to examine. Only the node (and CUDA, when present) is checked when nothing else is given.

    ``model``: a model directory (or one file): its filesystem, size and read speed; ``url``: a running replica
    (``preheat serve``) whose /health, /metrics and /v1/preheat/timeline are read; ``timeline``: a timeline JSON
    file (``/v1/preheat/timeline``'s document); ``origin``: an HTTP(S) URL of a file, or of a directory (ending in
    ``/``) holding the model's files, to probe; ``registry``: the peer registry (``redis://...`` or
    ``file:///dir``); ``io``: run the read, download and bandwidth probes (off: only cheap, read-only checks);
    ``gpu``: run the CUDA checks.
    """

    model: str | None = None
    url: str | None = None
    timeline: str | None = None
    origin: str | None = None
    registry: str | None = None
    gpu_cost_per_hour: float = 0.0
    budget_s: float = DEFAULT_BUDGET_S
    io: bool = True
    cache_dir: str | None = None
    threads: int | None = None
    api_key: str | None = None
    # What peers announce the model as (identity or served name); default: the model's preheat.json identity.
    name: str | None = None
    gpu: bool = True
    # Bytes the read and origin probes may move at most each (they also stop at their time bound).
    probe_bytes: int = 256 * 1024 * 1024


CheckFn = Callable[[DoctorOptions, float], list[Finding]]


@dataclass(frozen=True)
class Check:
    """A named check with the most seconds it may take; ``fn(options, bound_s)`` must itself honour ``bound_s``."""

    id: str
    area: Area
    bound_s: float
    fn: CheckFn
