"""A measured cold-start timeline (``preheat timeline --json`` or ``/v1/preheat/timeline``) as simulator phases.

The simulator's phases, and the timeline stages that fill them:

==========  =====================================================  =========================================
phase       timeline stages                                        removed or shortened by
==========  =====================================================  =========================================
provision   none (a node is not ours to time): ``--provision-s``   warm node pool
image       ``platform`` (PREHEAT_T0 to process start) or          --
            ``--image-s`` when the timeline has no such stage
start       ``imports``, ``config``, ``engine_imports``            --
download    ``fetch`` (a remote model pulled into the node cache)  node-local model cache (gone); quantized
load        ``weight_load``, ``model_build``                       quantized weights (x ``load_factor``)
warmup      ``tokenizer``, ``warmup``                              --
other       any other stage with a duration                        --
==========  =====================================================  =========================================

Instants (``ready``, ``first_request_ttft``) have no duration and are not phases. The total of the phases is the
time from asking for a replica to its ``ready``.
"""

from __future__ import annotations

from dataclasses import dataclass

from preheat.errors import PlanError, PreheatError
from preheat.timeline_report import Waterfall

PHASES = ("provision", "image", "start", "download", "load", "warmup", "other")
STAGE_PHASE = {
    "platform": "image",
    "imports": "start",
    "config": "start",
    "engine_imports": "start",
    "fetch": "download",
    "download": "download",
    "weight_load": "load",
    "model_build": "load",
    "tokenizer": "warmup",
    "warmup": "warmup",
}
DEFAULT_PROVISION_S = 90.0  # the seed: node provisioning takes 60-120 s
DEFAULT_IMAGE_S = 45.0  # the seed: container image pull takes 30-60 s


@dataclass(frozen=True)
class ColdStart:
    """Seconds per phase of one replica's cold start (``PHASES``)."""

    phases: dict[str, float]

    @classmethod
    def from_timeline(
        cls,
        data: object,
        *,
        where: str = "timeline",
        provision_s: float = DEFAULT_PROVISION_S,
        image_s: float = DEFAULT_IMAGE_S,
        download_s: float | None = None,
    ) -> ColdStart:
        """Phases from a parsed timeline JSON; ``PlanError`` naming ``where`` when it is not one.

        ``provision_s`` is always added (no timeline sees the node being made); ``image_s`` only when the timeline
        has no ``platform`` stage; ``download_s`` replaces the measured ``fetch`` (a timeline recorded on a node
        that already had the model shows a cache hit, not a download).
        """
        try:
            waterfall = Waterfall.from_dict(data, where=where)
        except PreheatError as exc:
            raise PlanError(str(exc)) from None
        phases = dict.fromkeys(PHASES, 0.0)
        for row in waterfall.rows:
            if row.duration < 0:
                raise PlanError(f"{where}: stage {row.name!r} ends before it starts ({row.start} > {row.end})")
            phases[STAGE_PHASE.get(row.name, "other")] += row.duration
        phases["provision"] = provision_s
        if not any(row.name == "platform" for row in waterfall.rows):
            phases["image"] = image_s
        if download_s is not None:
            phases["download"] = download_s
        if any(value < 0 for value in phases.values()):
            raise PlanError(f"{where}: phase durations must not be negative: {phases}")
        return cls(phases)

    def seconds(self, *, provision: bool = True, download: bool = True, load_factor: float = 1.0) -> float:
        """Duration of a cold start without provisioning (warm node), without download (node cache), and with
        download and load scaled by ``load_factor`` (quantized weights move fewer bytes)."""
        p = self.phases
        total = p["image"] + p["start"] + p["warmup"] + p["other"] + p["load"] * load_factor
        if provision:
            total += p["provision"]
        if download:
            total += p["download"] * load_factor
        return total

    def to_dict(self) -> dict[str, float]:
        return {**self.phases, "total": sum(self.phases.values())}
