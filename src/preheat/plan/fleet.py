"""``preheat simulate --emit-values``: the policy simulate recommends, as Kubernetes deployment values. Pure.

The recommendation is the cheapest policy whose p99 TTFT meets the target; when none does, the one with the lowest
p99. Its switches map onto ``k8s/manifests/values.yaml``: min/max replicas, the warm node pool (standby slots count as
pool nodes: the manifests keep nodes, not standby processes, warm), the idle timeout as the scale-down delay, and
the scale-out rule's slots x utilization as the autoscaler's in-flight target per replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: this module stays free of simulate's numpy
    from preheat.plan.simulate import PolicyRecord

MAX_SCALE_DOWN_DELAY_S = 3600  # the HPA's longest stabilization window


def recommend(docs: Sequence[PolicyRecord], ttft_p99_target_s: float) -> int:
    """Index of the cheapest policy with ``ttft_p99_s <= ttft_p99_target_s``, else of the lowest p99.

    >>> recommend([{"cost": 9.0, "ttft_p99_s": 0.5}, {"cost": 2.0, "ttft_p99_s": 40.0}], ttft_p99_target_s=2.0)
    0
    """
    meeting = [i for i, d in enumerate(docs) if float(d["ttft_p99_s"]) <= ttft_p99_target_s]
    if meeting:
        return min(meeting, key=lambda i: (float(docs[i]["cost"]), float(docs[i]["ttft_p99_s"])))
    return min(range(len(docs)), key=lambda i: (float(docs[i]["ttft_p99_s"]), float(docs[i]["cost"])))


def fleet_values(doc: PolicyRecord, *, slots: int, target_utilization: float) -> tuple[dict[str, object], list[str]]:
    """Deployment values for one policy's ``--json`` record, and notes on what the values cannot say."""
    policy = doc["settings"]
    low, high = int(policy["min_replicas"]), max(1, int(policy["max_replicas"]))
    delay = round(float(policy["idle_timeout_s"]))
    notes = []
    if delay > MAX_SCALE_DOWN_DELAY_S:
        notes.append(f"idle timeout {delay} s is above the autoscaler's {MAX_SCALE_DOWN_DELAY_S} s: capped")
        delay = MAX_SCALE_DOWN_DELAY_S
    if policy.get("standby"):
        notes.append(
            f"standby={policy['standby']}: kept as {policy['standby']} warm pool nodes (with the node cache); "
            "the manifests do not run `preheat serve --standby` processes yet"
        )
    if policy.get("quantized"):
        notes.append("quantized: set model.uri to the quantized checkpoint")
    if policy.get("spot_burst"):
        notes.append("spot: run replicas beyond the warm pool on a spot node pool (a Karpenter NodePool, say)")
    values: dict[str, object] = {
        "replicas": {"min": low, "max": max(low, high)},
        "autoscaler": "keda" if low == 0 else "hpa",
        "warmPool": {"size": int(policy.get("warm_pool", 0)) + int(policy.get("standby", 0))},
        "scaleDownDelaySeconds": delay,
        "targetInFlightPerReplica": max(1, math.floor(slots * target_utilization)),
    }
    return values, notes
