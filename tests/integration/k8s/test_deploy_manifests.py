"""The shipped manifests (preheat/k8s/manifests): every profile renders manifests that the Kubernetes API of
1.30-1.33 accepts, that follow our policy (non-root, read-only root filesystem, requests, probes, pinned images,
secrets by reference), and whose preheat command lines the real ``preheat`` parser accepts."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import kubernetes_validate
import pytest

from deployrender import (
    CONTAINERFILE,
    DEPLOY,
    OVERLAYS,
    PROFILES,
    Doc,
    containers,
    expand,
    find,
    kustomize,
    needs_kubectl,
    pod_spec,
    sample_environment,
    secret_of,
    workloads,
)
from preheat.cli.main import _build_parser
from preheat.k8s.slices import parse_k8s_url

pytestmark = needs_kubectl
KUBERNETES_VERSIONS = ["1.30", "1.31", "1.32", "1.33"]
PREHEAT_IMAGE = re.compile(r"^ghcr\.io/preheat-dev/preheat:")
# The fields of KEDA's ScaledObject (keda.sh/v1alpha1) the scale-to-zero profile uses: the API server's schemas do
# not cover custom resources, so the test holds KEDA's own required fields and types for them.
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"]},
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "properties": {"metadata": {"type": "object", "additionalProperties": {"type": "string"}}},
                    },
                },
            },
        }
    },
}


@functools.cache
def render(profile: str) -> list[Doc]:
    return kustomize(OVERLAYS / profile)


@pytest.fixture(params=PROFILES)
def rendered(request: pytest.FixtureRequest) -> list[Doc]:
    return render(request.param)


def validate(doc: Doc, version: str) -> None:
    if doc["apiVersion"].startswith("keda.sh/"):
        jsonschema.validate(doc, SCALED_OBJECT)
        return
    kubernetes_validate.validate(doc, version, strict=True)


def assert_valid(docs: list[Doc], version: str) -> None:
    for doc in docs:
        try:
            validate(doc, version)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {exc}")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_of_every_profile_is_valid_for_the_kubernetes_api(version: str) -> None:
    # The profiles share most objects: each distinct one is checked once (a schema check takes ~10 ms).
    distinct = {json.dumps(doc, sort_keys=True): doc for profile in PROFILES for doc in render(profile)}
    assert_valid(list(distinct.values()), version)


def test_every_pod_runs_as_non_root_with_a_read_only_root(rendered: list[Doc]) -> None:
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True, workload["metadata"]["name"]
        assert spec["securityContext"].get("runAsUser", 0) != 0
        for container in containers(workload):
            context = container["securityContext"]
            where = f"{workload['metadata']['name']}/{container['name']}"
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert context.get("runAsUser", 1) != 0, where
            assert not context.get("privileged"), where


def test_every_container_requests_resources_and_caps_memory(rendered: list[Doc]) -> None:
    for workload in workloads(rendered):
        for container in containers(workload):
            resources = container["resources"]
            assert {"cpu", "memory"} <= set(resources["requests"]), container["name"]
            assert "memory" in resources["limits"], container["name"]


def test_every_long_running_service_has_probes(rendered: list[Doc]) -> None:
    replica = find(rendered, "Deployment", "preheat-replica")
    serve = pod_spec(replica)["containers"][0]
    assert serve["startupProbe"]["httpGet"]["path"] == "/health"
    assert serve["readinessProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in serve
    for workload in workloads(rendered):
        for container in pod_spec(workload)["containers"]:
            if container["image"].startswith("registry.k8s.io/pause:"):
                continue  # the placeholders hold a pod or a node; there is nothing to probe
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in container, f"{workload['metadata']['name']}/{container['name']} has no {probe}"


def test_no_image_floats(rendered: list[Doc]) -> None:
    for workload in workloads(rendered):
        for container in containers(workload):
            image = container["image"]
            name, _, tag = image.rpartition(":")
            assert name, f"{image} has no tag"
            assert tag != "latest", f"{image} floats"
            assert "/" not in tag, f"{image} has no tag"


def test_secrets_are_referenced_never_written_in(rendered: list[Doc]) -> None:
    assert not [d for d in rendered if d["kind"] == "Secret"]
    for workload in workloads(rendered):
        for container in containers(workload):
            for env in container.get("env", []):
                name = env["name"]
                if re.search(r"TOKEN|KEY|SECRET|PASSWORD", name):
                    assert "value" not in env, f"{name} is written in"
                    assert "secretKeyRef" in env["valueFrom"], f"{name} does not come from a Secret"
            joined = " ".join(container.get("args", []))
            secret_flags = r"--(api-key|admin-key|peer-token|replica-api-key|replica-admin-key)\b"
            assert not re.search(secret_flags, joined), joined


def test_clients_the_router_and_the_control_routes_hold_three_different_secrets(rendered: list[Doc]) -> None:
    # One key for clients and replicas let a client of the router talk to the replicas directly, control included.
    [router] = pod_spec(find(rendered, "Deployment", "preheat-router"))["containers"]
    serve = next(c for c in pod_spec(find(rendered, "Deployment", "preheat-replica"))["containers"]
                 if c["args"][0] == "serve")  # fmt: skip
    client = secret_of(router, "PREHEAT_ROUTER_API_KEY")
    replica = secret_of(serve, "PREHEAT_API_KEY")
    admin = secret_of(serve, "PREHEAT_ADMIN_KEY")
    assert client == ("client-key", False)  # the router binds 0.0.0.0: it refuses to start without a key
    assert replica == ("replica-key", False)
    assert secret_of(router, "PREHEAT_ROUTER_REPLICA_API_KEY") == replica
    assert admin == ("admin-key", True)  # optional: without it the control routes are closed
    assert secret_of(router, "PREHEAT_ROUTER_REPLICA_ADMIN_KEY") is None  # the router never controls the replicas


def test_replicas_spread_over_nodes_wait_for_the_node_cache_and_mount_it(rendered: list[Doc]) -> None:
    replica = pod_spec(find(rendered, "Deployment", "preheat-replica"))
    assert {c["topologyKey"] for c in replica["topologySpreadConstraints"]} >= {"kubernetes.io/hostname"}
    gate = replica["initContainers"][0]
    assert gate["args"][:2] == ["cache", "warm"]  # returns at once when the node cache has the model, else waits
    daemon = pod_spec(find(rendered, "DaemonSet", "preheat-node-cache"))
    assert daemon["initContainers"][0]["args"][:3] == ["cache", "warm", "$(PREHEAT_MODEL)"]
    host_paths = {v["hostPath"]["path"] for v in daemon["volumes"] if "hostPath" in v}
    assert host_paths == {v["hostPath"]["path"] for v in replica["volumes"] if "hostPath" in v}


def test_a_replica_being_deleted_stays_up_until_the_router_has_let_it_go(rendered: list[Doc]) -> None:
    # `preheat serve` stops at SIGTERM, which Kubernetes sends as the endpoint turns terminating: a preStop wait,
    # within the grace period, lets the router drop it and the requests on it finish first.
    replica = pod_spec(find(rendered, "Deployment", "preheat-replica"))
    serve = next(c for c in replica["containers"] if c["args"][0] == "serve")
    command = serve["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert 5 <= int(command[1]) < replica["terminationGracePeriodSeconds"]


def test_a_router_being_replaced_finishes_the_streams_it_proxies(rendered: list[Doc]) -> None:
    router = pod_spec(find(rendered, "Deployment", "preheat-router"))
    [container] = router["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert 5 <= int(command[1]) < router["terminationGracePeriodSeconds"]


def test_the_node_cache_runs_on_every_node_a_replica_may_run_on(rendered: list[Doc]) -> None:
    replica = pod_spec(find(rendered, "Deployment", "preheat-replica"))
    daemon = pod_spec(find(rendered, "DaemonSet", "preheat-node-cache"))
    for toleration in replica.get("tolerations", []):
        assert toleration in daemon.get("tolerations", []), f"the node cache does not tolerate {toleration}"


def test_secret_files_are_readable_by_the_pods_group_only(rendered: list[Doc]) -> None:
    for workload in workloads(rendered):
        spec = pod_spec(workload)
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                mode = volume["secret"].get("defaultMode", 0o644)
                assert mode & 0o007 == 0, f"{workload['metadata']['name']}: {volume['name']} is world-readable"
                assert spec["securityContext"].get("fsGroup") is not None  # the group the files are given to


def test_the_fleet_has_exactly_one_autoscaler(rendered: list[Doc]) -> None:
    scalers = [d for d in rendered if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    assert len(scalers) == 1
    assert scalers[0]["spec"]["scaleTargetRef"]["name"] == "preheat-replica"


def test_rbac_is_what_the_replica_and_router_need(rendered: list[Doc]) -> None:
    replica = find(rendered, "Role", "preheat-replica")["rules"]
    assert {(r["apiGroups"][0], res, verb) for r in replica for res in r["resources"] for verb in r["verbs"]} == {
        ("", "pods", "get"),
        ("", "events", "list"),
    }
    router = find(rendered, "Role", "preheat-router")["rules"]
    assert router == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]}]
    for binding in (d for d in rendered if d["kind"] == "RoleBinding"):
        assert binding["subjects"][0]["namespace"] == "preheat"  # the overlay's namespace, not "default"


def test_every_preheat_command_line_is_accepted_by_the_real_parser(rendered: list[Doc]) -> None:
    parser = _build_parser()
    checked = 0
    for workload in workloads(rendered):
        for container in containers(workload):
            if not PREHEAT_IMAGE.match(container["image"]):
                continue
            env = sample_environment(container, rendered)
            unknown = [m for arg in container["args"] for m in re.findall(r"\$\((\w+)\)", arg) if m not in env]
            assert not unknown, f"{container['name']} refers to variables it does not define: {unknown}"
            args = [expand(arg, env) for arg in container["args"]]
            try:
                parsed = parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{workload['metadata']['name']}/{container['name']}: preheat rejects {args}")
            assert parsed.command == args[0]
            checked += 1
    assert checked >= 4  # node cache, replica's gate and server, router


def test_the_router_discovers_the_replica_service(rendered: list[Doc]) -> None:
    router = pod_spec(find(rendered, "Deployment", "preheat-router"))["containers"][0]
    args = router["args"]
    target = args[args.index("--replicas-from") + 1]
    service = find(rendered, "Service", "preheat-replicas")
    ref = parse_k8s_url(expand(target, sample_environment(router, rendered)))
    assert (ref.namespace, ref.service, ref.port) == ("preheat", service["metadata"]["name"], "http")
    assert "http" in {p["name"] for p in service["spec"]["ports"]}


def test_the_overlays_on_disk_are_the_profiles(rendered: list[Doc]) -> None:
    assert sorted(p.name for p in OVERLAYS.iterdir()) == sorted(PROFILES)
    assert (DEPLOY / "values.schema.json").is_file()
    assert CONTAINERFILE.is_file()
