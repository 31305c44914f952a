"""A measured cold-start timeline (``preheat timeline --json`` or ``/v1/preheat/timeline``) as simulator phases.

The simulator's phases, and the timeline stages that fill them:

==========  =====================================================  =========================================
phase       timeline stages                                        removed or shortened by
==========  =====================================================  =========================================
provision   none (a node is not ours to time): ``--provision-s``   warm node pool
image       ``platform`` (PREHEAT_T0 to process start) or          --
            ``--image-s`` when the timeline has no such stage
start       ``imports``, ``config``, ``engine_imports``            standby replica (gone)
download    ``fetch`` (a remote model pulled into the node cache)  node-local model cache (gone); quantized
load        ``weight_load``, ``weight_handoff``, ``model_build``   quantized weights (x ``load_factor``)
warmup      ``tokenizer``, ``warmup``                              --
other       any other stage with a duration                        --
==========  =====================================================  =========================================

Instants (``ready``, ``first_request_ttft``) have no duration and are not phases. The total of the phases is the
time from asking for a replica to its ``ready``.

Stages may overlap (``preheat serve`` reads the config, tokenizer and pages while torch imports, and builds the
tokenizer while the weights load): each moment of the timeline counts once, for the stage that gates progress then,
the covering stage that ends last (the critical path). So an overlapped ``tokenizer`` costs its phase nothing while
``engine_imports`` still runs, and the phases still add up to the time to ``ready``.

A **standby** replica (``preheat serve --standby``) has provisioned, pulled its image and started already: its
activation pays ``download`` (unless the node cache has the model), ``load``, ``warmup`` and ``other``
(``ColdStart.standby_seconds``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from preheat.core.errors import PlanError, PreheatError
from preheat.timeline.waterfall import Waterfall

PHASES = ("provision", "image", "start", "download", "load", "warmup", "other")
STAGE_PHASE = {
    "platform": "image",
    # A replica on Kubernetes dates its timeline from pod creation (preheat.k8s.pod): the stages before the process.
    "scheduling": "provision",
    "pod_setup": "start",
    "image_pull": "image",
    "container_start": "start",
    "imports": "start",
    "config": "start",
    "engine_imports": "start",
    "fetch": "download",
    "download": "download",
    "weight_load": "load",
    "weight_handoff": "load",  # vLLM's --load-format preheat: the engine copying the mapped weights in
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

        ``provision_s`` is added unless the timeline has a ``scheduling`` stage (a pod's timeline measured it);
        ``image_s`` only when the timeline has neither a ``platform`` nor an ``image_pull`` stage; ``download_s``
        replaces the measured ``fetch`` (a timeline recorded on a node that already had the model shows a cache hit,
        not a download).
        """
        try:
            waterfall = Waterfall.from_dict(data, where=where)
        except PreheatError as exc:
            raise PlanError(str(exc)) from None
        phases = dict.fromkeys(PHASES, 0.0)
        for row in waterfall.rows:
            if row.duration < 0:
                raise PlanError(f"{where}: stage {row.name!r} ends before it starts ({row.start} > {row.end})")
        spans = [(row.start, row.end, STAGE_PHASE.get(row.name, "other")) for row in waterfall.rows if row.duration]
        for phase, seconds in critical_seconds(spans).items():
            phases[phase] += seconds
        names = {row.name for row in waterfall.rows}
        if "scheduling" not in names:
            phases["provision"] = provision_s
        if not names & {"platform", "image_pull"}:
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

    def standby_seconds(self, *, download: bool = True, load_factor: float = 1.0) -> float:
        """Activation of a standby replica: what is left once the process is up with its engine imported."""
        p = self.phases
        total = p["warmup"] + p["other"] + p["load"] * load_factor
        if download:
            total += p["download"] * load_factor
        return total

    def to_dict(self) -> dict[str, float]:
        return {**self.phases, "total": sum(self.phases.values())}


def critical_seconds(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Seconds per label of ``spans`` (``(start, end, label)``, overlapping or not), each moment counted once, for
    the span covering it that ends last (ties: the one that started last). Pure.

    >>> critical_seconds([(0, 10, "start"), (1, 3, "warmup"), (10, 12, "load")])
    {'start': 10.0, 'load': 2.0}
    """
    bounds = sorted({t for start, end, _ in spans for t in (start, end)})
    out: dict[str, float] = {}
    for left, right in itertools.pairwise(bounds):
        covering = [(end, start, label) for start, end, label in spans if start <= left and end >= right]
        if covering:
            label = max(covering)[2]
            out[label] = out.get(label, 0.0) + (right - left)
    return out
