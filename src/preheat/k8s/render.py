"""Valid deployment values -> a ``kustomization.yaml`` over ``manifests/kustomize/base`` (shipped in this package:
``k8s/bundle.py``). Pure: a dict in, a dict out.

The overlay adds the components the values ask for (the L2 backend, CUDA, KEDA, vLLM replicas and standbys for
``engine: vllm``) and JSON patches for the numbers (replicas, resources, scale-down delay...). Kustomize does the
rest, so what is applied is always the reviewed base plus a patch you can read in the generated file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TypedDict

from preheat.k8s.values import Values

BASE_IMAGE = "ghcr.io/preheat-dev/preheat"  # the image name after manifests/kustomize/base's own images entry
_REDIS_MEMORY_ARG = 6  # index of --maxmemory's value in components/redis-l2/redis.yaml's args
_INIT = "/spec/template/spec/initContainers"
TRUST_DIR = "/etc/preheat/trust"  # where compile.trustKeysSecret's files are mounted
VLLM_IMAGE = "preheat-vllm"  # the image name of components/vllm's containers, replaced by vllm.image
VLLM_STANDBY = "preheat-vllm-standby"  # components/vllm's StatefulSet and its headless Service
VLLM_MODEL = "/run/preheat/model"  # the link to the node-cache entry (components/vllm's init containers make it)
VLLM_PORT = 8000
REFIT_TRUST_DIR = "/etc/preheat/refit-trust"  # where vllm.follow.trustKeysSecret's files are mounted
REFIT_WORKER = "preheat.integrations.vllm.follow_worker.RefitWorker"  # vLLM's worker extension for following
_UNITS = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024}


# The overlay's parts: JSON patch operations (RFC 6902: add and replace carry a value, copy a "from", a keyword in
# Python, hence the second spelling) and Kustomize's patches of one target.
class PatchOp(TypedDict):
    op: str
    path: str
    value: object


CopyOp = TypedDict("CopyOp", {"op": str, "from": str, "path": str})


class Target(TypedDict):
    kind: str
    name: str


class Patch(TypedDict):
    target: Target
    patch: str  # the operations as JSON text, one per line; empty: nothing to patch


class Kustomization(TypedDict):
    """The generated ``kustomization.yaml`` (key order as written)."""

    apiVersion: str
    kind: str
    namespace: str
    resources: list[str]
    components: list[str]
    images: list[dict[str, str]]
    patches: list[Patch]


def components(values: Values) -> list[str]:
    """The components (under manifests/kustomize/components) these values need, in the order Kustomize applies
    them."""
    out = []
    if engine(values) == "vllm":  # first: it swaps the replica's containers, which the others then patch
        out.append("vllm")
    if values["device"] == "cuda":
        out.append("cuda")
    backend = values["l2"]["backend"]
    if backend in ("redis", "fs"):
        out.append(f"{backend}-l2")
    if values["autoscaler"] == "keda":
        out.append("scale-to-zero")
    return out


def engine(values: Values) -> str:
    """What serves: ``preheat`` (``preheat serve`` replicas, the default) or ``vllm``."""
    return str(values.get("engine", "preheat"))


def served_name(values: Values) -> str:
    """``model.servedName``, else the URI's last part: ``s3://models/llama-3-8b/`` -> ``llama-3-8b``."""
    name = values["model"].get("servedName")
    return str(name) if name else values["model"]["uri"].rstrip("/").rsplit("/", 1)[-1]


def kustomization(values: Values, kustomize_dir: str) -> Kustomization:
    """The overlay for ``values`` (already validated); ``kustomize_dir`` is manifests/kustomize relative to the overlay.

    >>> v = {"namespace": "llm", "image": {"repository": "r/preheat", "tag": "1"}, "model": {"uri": "s3://m/x"},
    ...      "device": "cpu", "replicas": {"min": 1, "max": 4}, "autoscaler": "hpa", "router": {},
    ...      "l2": {"backend": "redis"}, "resources": {"replica": {"cpu": "4", "memory": "16Gi"}}}
    >>> kustomization(v, "../manifests/kustomize")["components"]
    ['../manifests/kustomize/components/redis-l2']
    """
    cuda = values["device"] == "cuda"
    image = values["image"]
    images = [{"name": BASE_IMAGE, "newName": image["repository"], "newTag": image["tag"] + ("-cuda" if cuda else "")}]
    patches = [
        _patch("ConfigMap", "preheat-fleet", _fleet_config(values)),
        _patch("Deployment", "preheat-replica", _replica(values, cuda)),
        _patch("Deployment", "preheat-warm-pool", _warm_pool(values, cuda)),
        _patch("Deployment", "preheat-router", [_replace("/spec/replicas", values["router"].get("replicas", 1))]),
        _patch("Deployment", "preheat-replica", _compile(values)),
        *_autoscaler(values),
        *_node_cache(values),
        *_l2(values),
    ]
    if engine(values) == "vllm":
        vllm_image = values["vllm"]["image"]  # the user's own: vLLM and preheat in one image, any variant
        images.append({"name": VLLM_IMAGE, "newName": vllm_image["repository"], "newTag": vllm_image["tag"]})
        patches += _vllm(values, cuda)
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": values["namespace"],
        "resources": [f"{kustomize_dir}/base"],
        "components": [f"{kustomize_dir}/components/{name}" for name in components(values)],
        "images": images,
        "patches": [p for p in patches if p["patch"]],
    }


def _patch(kind: str, name: str, ops: Sequence[PatchOp | CopyOp]) -> Patch:
    # A JSON patch is YAML too; one operation per line keeps the generated file readable and diffable.
    text = "[\n" + ",\n".join(json.dumps(op) for op in ops) + "\n]" if ops else ""
    return {"target": {"kind": kind, "name": name}, "patch": text}


def _replace(path: str, value: object) -> PatchOp:
    return {"op": "replace", "path": path, "value": value}


def _fleet_config(values: Values) -> list[PatchOp]:
    data = {
        "model": values["model"]["uri"],
        "served-model-name": served_name(values),
        "device": values["device"],
        "kv-l1": values.get("kvL1", "2GiB"),
        "router-policy": values["router"].get("policy", "least-load"),
    }
    l2 = values["l2"]
    if l2["backend"] == "external":
        data.update({"kv-l2": l2["url"], "registry": l2["registry"]})
    ops = [_replace(f"/data/{key}", value) for key, value in data.items()]
    if l2["backend"] == "fs":
        # The quota leaves 10% of the volume for the registry and the file system (fs:// counts chunk bytes only).
        ops.append(_replace("/data/kv-l2-max-bytes", f"{int(_mebibytes(l2.get('size', '500Gi')) * 0.9)}MiB"))
    return ops


def _resources(values: Values, cuda: bool) -> dict[str, dict[str, str]]:  # requests and limits
    want = values["resources"]["replica"]
    limits: dict[str, str] = {"memory": want["memory"]}
    if cuda:
        limits["nvidia.com/gpu"] = str(values.get("gpusPerReplica", 1))
    return {"requests": {"cpu": want["cpu"], "memory": want["memory"]}, "limits": limits}


def _replica(values: Values, cuda: bool) -> list[PatchOp]:
    # No /spec/replicas: the autoscaler owns the count, and an apply must not reset it.
    return [_replace("/spec/template/spec/containers/0/resources", _resources(values, cuda))]


def _warm_pool(values: Values, cuda: bool) -> list[PatchOp]:
    # A placeholder asks for exactly a replica's room, so the node it keeps up fits the replica that preempts it.
    return [
        _replace("/spec/replicas", values.get("warmPool", {}).get("size", 0)),
        _replace("/spec/template/spec/containers/0/resources", _resources(values, cuda)),
    ]


def _compile(values: Values) -> list[PatchOp]:
    """``compile.enabled``: ``PREHEAT_COMPILE=1``; with ``trustKeys``, their Secret mounted read-only (group-readable
    only) and ``PREHEAT_TRUST_KEY`` naming the files: compiled artifacts are code (docs/security.md)."""
    settings = values.get("compile", {})
    if not settings.get("enabled"):
        return []
    container = "/spec/template/spec/containers/0"
    compiled = {"name": "PREHEAT_COMPILE", "value": "1"}
    ops: list[PatchOp] = [{"op": "add", "path": f"{container}/env/-", "value": compiled}]
    keys = settings.get("trustKeys", [])
    if keys:
        files = ",".join(f"{TRUST_DIR}/{key}" for key in keys)
        secret = {"secretName": settings["trustKeysSecret"], "defaultMode": 0o440}
        ops += [
            {"op": "add", "path": f"{container}/env/-", "value": {"name": "PREHEAT_TRUST_KEY", "value": files}},
            {"op": "add", "path": "/spec/template/spec/volumes/-", "value": {"name": "trust-keys", "secret": secret}},
            {
                "op": "add",
                "path": f"{container}/volumeMounts/-",
                "value": {"name": "trust-keys", "mountPath": TRUST_DIR, "readOnly": True},
            },
        ]
    return ops


def _vllm(values: Values, cuda: bool) -> list[Patch]:
    """``engine: vllm``: the ``vllm serve`` arguments of the replicas and standbys, the standby count, and the
    router told where the standbys are (``--standby``, one stable name per StatefulSet pod) and how to activate
    them (``standby-key``, the one credential that opens their load route)."""
    settings = values["vllm"]
    container = "/spec/template/spec/containers/0"
    words = [*(["--load-format", settings["loadFormat"]] if settings.get("loadFormat") else []), *settings["args"]]
    env: list[dict[str, object]] = []
    volumes: list[dict[str, object]] = []
    mounts: list[dict[str, object]] = []
    follow = settings.get("follow")
    if follow:
        # Live weight updates (docs/integrations.md, *vLLM: live weight updates*): the versions are found through
        # the fleet's registry and pulled from peers with the peer token.
        words += ["--worker-extension-cls", REFIT_WORKER]
        env += [
            {"name": "PREHEAT_VLLM_FOLLOW", "value": follow["name"]},
            _from_config("PREHEAT_REGISTRY", "registry"),
            _from_secret("PREHEAT_PEER_TOKEN", "peer-token"),
        ]
        keys = follow.get("trustKeys", [])
        if keys:
            files = ",".join(f"{REFIT_TRUST_DIR}/{key}" for key in keys)
            env.append({"name": "PREHEAT_VLLM_REFIT_TRUST_KEY", "value": files})
            secret = {"secretName": follow["trustKeysSecret"], "defaultMode": 0o440}
            volumes.append({"name": "refit-trust-keys", "secret": secret})
            mounts.append({"name": "refit-trust-keys", "mountPath": REFIT_TRUST_DIR, "readOnly": True})
    ops = [
        *_append(f"{container}/args", words),
        *_append(f"{container}/env", env),
        *_append("/spec/template/spec/volumes", volumes),
        *_append(f"{container}/volumeMounts", mounts),
    ]
    count = settings.get("standbys", 0)
    standby = [
        _replace("/spec/replicas", count),
        _replace(f"{container}/resources", _resources(values, cuda)),
        *ops,
    ]
    return [
        _patch("Deployment", "preheat-replica", ops),
        _patch("StatefulSet", VLLM_STANDBY, standby),
        _patch("Deployment", "preheat-router", _router_standbys(values, count)),
    ]


def standby_urls(namespace: str, count: int) -> list[str]:
    """The address of each vLLM standby: its StatefulSet pod's name under the headless Service.

    >>> standby_urls("llm", 2)[1]
    'http://preheat-vllm-standby-1.preheat-vllm-standby.llm.svc:8000'
    """
    return [f"http://{VLLM_STANDBY}-{i}.{VLLM_STANDBY}.{namespace}.svc:{VLLM_PORT}" for i in range(count)]


def _router_standbys(values: Values, count: int) -> list[PatchOp]:
    if not count:
        return []
    container = "/spec/template/spec/containers/0"
    words = [word for url in standby_urls(values["namespace"], count) for word in ("--standby", url)]
    # What a standby is told to load is the path its own --allow-model names (the link in its pod), served under
    # the fleet's name; the router resolves neither, it only sends them.
    words += ["--standby-model", VLLM_MODEL, "--served-model-name", "$(PREHEAT_SERVED_MODEL_NAME)"]
    env = [
        _from_config("PREHEAT_SERVED_MODEL_NAME", "served-model-name"),
        # standby-key: sent only on the router's own activations (it forwards no control route); it opens nothing
        # on the replicas, whose load route is closed.
        _from_secret("PREHEAT_ROUTER_REPLICA_ADMIN_KEY", "standby-key"),
    ]
    return [*_append(f"{container}/args", words), *_append(f"{container}/env", env)]


def _append(path: str, items: Sequence[object]) -> list[PatchOp]:
    """Operations that add ``items`` at the end of the list at ``path``, in order."""
    return [{"op": "add", "path": f"{path}/-", "value": item} for item in items]


def _from_config(variable: str, key: str) -> dict[str, object]:
    return {"name": variable, "valueFrom": {"configMapKeyRef": {"name": "preheat-fleet", "key": key}}}


def _from_secret(variable: str, key: str) -> dict[str, object]:
    # By reference only: the manifests never hold a secret (docs/security.md).
    return {"name": variable, "valueFrom": {"secretKeyRef": {"name": "preheat-secrets", "key": key}}}


def _autoscaler(values: Values) -> list[Patch]:
    replicas, delay = values["replicas"], values.get("scaleDownDelaySeconds", 300)
    target = str(values.get("targetInFlightPerReplica", 11))
    if values["autoscaler"] == "hpa":
        ops = [
            _replace("/spec/minReplicas", replicas["min"]),
            _replace("/spec/maxReplicas", replicas["max"]),
            _replace("/spec/metrics/0/external/target/averageValue", target),
            _replace("/spec/behavior/scaleDown/stabilizationWindowSeconds", delay),
        ]
        return [_patch("HorizontalPodAutoscaler", "preheat-replica", ops)]
    prometheus = values.get("prometheusUrl", "http://prometheus-operated.monitoring.svc:9090")
    ops = [
        _replace("/spec/minReplicaCount", replicas["min"]),
        _replace("/spec/maxReplicaCount", replicas["max"]),
        _replace("/spec/cooldownPeriod", delay),
        _replace("/spec/advanced/horizontalPodAutoscalerConfig/behavior/scaleDown/stabilizationWindowSeconds", delay),
        _replace("/spec/triggers/0/metadata/threshold", target),
        _replace("/spec/triggers/0/metadata/serverAddress", prometheus),
        _replace("/spec/triggers/1/metadata/serverAddress", prometheus),
    ]
    return [_patch("ScaledObject", "preheat-replica", ops)]


def _node_cache(values: Values) -> list[Patch]:
    """One more init container per extra model: a copy of the first, warming another URI."""
    ops: list[PatchOp | CopyOp] = []
    for i, uri in enumerate(values["model"].get("extraCached", []), start=1):
        ops += [
            {"op": "copy", "from": f"{_INIT}/0", "path": f"{_INIT}/-"},
            _replace(f"{_INIT}/{i}/name", f"warm-model-{i}"),
            _replace(f"{_INIT}/{i}/args/2", uri),
        ]
    return [_patch("DaemonSet", "preheat-node-cache", ops)]


def _l2(values: Values) -> list[Patch]:
    l2 = values["l2"]
    size = l2.get("size")
    if l2["backend"] == "redis" and size:
        mib = _mebibytes(size)
        # Redis's "mb" is MiB. The container gets a quarter more than maxmemory: keys, buffers, fragmentation.
        ops = [
            _replace(f"/spec/template/spec/containers/0/args/{_REDIS_MEMORY_ARG}", f"{mib}mb"),
            _replace("/spec/template/spec/containers/0/resources/requests/memory", f"{int(mib * 1.25)}Mi"),
            _replace("/spec/template/spec/containers/0/resources/limits/memory", f"{int(mib * 1.25)}Mi"),
        ]
        return [_patch("StatefulSet", "preheat-redis", ops)]
    if l2["backend"] == "fs":
        ops = [_replace("/spec/resources/requests/storage", size or "500Gi")]
        if l2.get("storageClassName"):
            ops.append({"op": "add", "path": "/spec/storageClassName", "value": l2["storageClassName"]})
        return [_patch("PersistentVolumeClaim", "preheat-kv", ops)]
    return []


def _mebibytes(quantity: str) -> int:
    """A Kubernetes quantity with a binary suffix (the schema allows only those) in MiB: ``6Gi`` -> 6144."""
    match = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti)", quantity)
    if match is None:  # the schema rules this out; a caller that skipped validation gets a clear error
        from preheat.core.errors import ConfigError

        raise ConfigError(f"size {quantity!r}: write it as a number with Ki, Mi, Gi or Ti")
    return int(int(match.group(1)) * _UNITS[match.group(2)])
