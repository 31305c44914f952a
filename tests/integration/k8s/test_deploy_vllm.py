"""``engine: vllm``: ``preheat deploy render`` deploys vLLM replicas (``preheat vllm-standby --load``, the way
``preheat up --engine vllm`` starts its replicas) and warm vLLM standbys the router activates. The rendered objects
are valid for the Kubernetes API, follow the fleet's policy, and their command lines are what the real parsers and
settings of preheat accept; bad values fail at render time naming the key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deployrender import (
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
from origins import make_origin
from preheat.cli.main import _build_parser, main
from preheat.core.errors import ConfigError
from preheat.integrations.vllm.standby import told_to_load
from preheat.integrations.vllm.standby_control import own_words
from preheat.integrations.vllm.standby_settings import VllmStandbySettings
from preheat.k8s.render import REFIT_WORKER, VLLM_MODEL, standby_urls
from preheat.router.settings import RouterSettings
from preheat.server.allow import refusal
from preheat.testing.synthetic import LlamaShape

VLLM_IMAGE = {"repository": "registry.internal/vllm-preheat", "tag": "0.32.0"}
FLEET: dict[str, Any] = {  # Any: YAML values
    "namespace": "llm",
    "model": {"uri": "s3://models/llama-3-8b", "servedName": "llama"},
    "engine": "vllm",
    "vllm": {"image": VLLM_IMAGE, "args": ["--dtype", "bfloat16", "--max-model-len", "8192"], "standbys": 2},
}
CACHE, LINK = "/var/cache/preheat", "/run/preheat/model"


def render(tmp_path: Path, values: dict[str, Any], *profiles: str) -> list[Doc]:  # Any: YAML values
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = tmp_path / "overlay"
    argv = ["deploy", "render", "--values", str(path), "-o", str(out)]
    for name in profiles:
        argv += ["--profile", name]
    assert main(argv) == 0
    return kustomize(out)


@pytest.fixture
def fleet(tmp_path: Path) -> list[Doc]:
    return render(tmp_path, FLEET)


def vllm_container(docs: list[Doc], kind: str, name: str) -> Doc:
    [container] = pod_spec(find(docs, kind, name))["containers"]
    assert container["name"] == "vllm"
    vllm: Doc = container
    return vllm


def environment(container: Doc, docs: list[Doc]) -> dict[str, str]:
    """The container's environment as the kubelet would give it (a secret's value is ``sample-KEY``)."""
    return sample_environment(container, docs)


def expanded_args(container: Doc, docs: list[Doc]) -> list[str]:
    """The container's args as the kubelet expands ``$(NAME)``; every name must be defined."""
    env = environment(container, docs)
    return [expand(arg, env) for arg in container["args"]]


def standby_settings(container: Doc, docs: list[Doc], **replace: str) -> tuple[VllmStandbySettings, list[str]]:
    """``preheat vllm-standby``'s settings and ``vllm serve`` words for the container, parsed by the real parser and
    resolved from the container's environment as the process would (``replace``: paths to use here instead)."""
    args = expanded_args(container, docs)
    assert container["command"] == ["preheat"]
    parsed = _build_parser().parse_args([replace.get(a, a) for a in args])
    assert parsed.command == "vllm-standby"
    flags = {name: getattr(parsed, name, None) for name in ("host", "port", "allow_model", "admin_key", "load")}
    words = parsed.vllm_args[1:] if parsed.vllm_args[:1] == ["--"] else parsed.vllm_args
    return VllmStandbySettings.resolve(flags, environment(container, docs)), words


@needs_kubectl
@pytest.mark.parametrize("profiles", [(), ("cuda",), ("scale-to-zero",)])
def test_a_vllm_fleet_is_valid_for_the_kubernetes_api(tmp_path: Path, profiles: tuple[str, ...]) -> None:
    docs = render(tmp_path, FLEET, *profiles)
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue  # a custom resource: test_deploy_manifests.py holds KEDA's schema
        for version in ("1.30", "1.33"):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: {exc}")


@needs_kubectl
def test_a_replica_is_a_vllm_standby_told_to_load_the_fleets_model_at_once(fleet: list[Doc]) -> None:
    replica = vllm_container(fleet, "Deployment", "preheat-replica")
    assert replica["image"] == "registry.internal/vllm-preheat:0.32.0"  # the user's image, as given
    settings, words = standby_settings(replica, fleet)
    assert (settings.host, settings.port, settings.load) == ("0.0.0.0", 8000, LINK)
    assert settings.allow_model == (LINK,)  # what it was told, and nothing else
    assert settings.admin_key is None  # its load route stays closed: it was told its model on the command line
    assert secret_of(replica, "PREHEAT_ADMIN_KEY") is None
    # The `vllm serve` words: the fleet's name, preheat's load format, then the user's, none of the standby's own.
    assert words == ["--served-model-name", "llama", "--load-format", "preheat",
                     "--dtype", "bfloat16", "--max-model-len", "8192"]  # fmt: skip
    assert own_words(words) is None
    assert replica["ports"] == [{"name": "http", "containerPort": settings.port}]


@needs_kubectl
def test_the_init_container_makes_the_link_the_replica_loads(
    fleet: list[Doc], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The init container's own command line, run here against a real checkpoint: the link it makes is the model
    # the replica's --load resolves to (the node-cache entry), and a standby's allow-list admits that and no other.
    spec = pod_spec(find(fleet, "Deployment", "preheat-replica"))
    [gate] = spec["initContainers"]
    origin = make_origin(tmp_path / "origin", shape=LlamaShape(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                              num_hidden_layers=1))  # fmt: skip
    here = {CACHE: str(tmp_path / "cache"), LINK: str(tmp_path / "run" / "model")}
    (tmp_path / "run").mkdir()
    args = [here.get(a, a).replace("$(PREHEAT_MODEL)", str(origin)) for a in gate["args"]]
    assert args[:2] == ["cache", "warm"]
    assert main(args) == 0
    entry = capsys.readouterr().out.strip().splitlines()[-1]
    assert Path(here[LINK]).resolve() == Path(entry)
    settings, _ = standby_settings(vllm_container(fleet, "Deployment", "preheat-replica"), fleet, **here)
    request = told_to_load(settings)
    assert request is not None
    assert request.model == entry
    assert refusal(here[LINK], settings.allow_model) is None
    assert refusal(str(origin), settings.allow_model) is not None
    # Both sides of the link are mounted where the init container wrote them.
    for container in (gate, vllm_container(fleet, "Deployment", "preheat-replica")):
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert (mounts[CACHE], mounts[str(Path(LINK).parent)]) == ("node-cache", "model-link")
    daemon = pod_spec(find(fleet, "DaemonSet", "preheat-node-cache"))
    host_paths = {v["hostPath"]["path"] for v in daemon["volumes"] if "hostPath" in v}
    assert host_paths == {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}


@needs_kubectl
def test_the_router_knows_every_standby_and_activates_it_with_the_standby_key(fleet: list[Doc]) -> None:
    standbys = find(fleet, "StatefulSet", "preheat-vllm-standby")
    assert standbys["spec"]["replicas"] == 2
    assert standbys["spec"]["podManagementPolicy"] == "Parallel"  # a standby is not Ready until it serves
    service = find(fleet, "Service", standbys["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= pod_spec_labels(standbys).items()
    [router] = pod_spec(find(fleet, "Deployment", "preheat-router"))["containers"]
    parsed = _build_parser().parse_args(expanded_args(router, fleet))
    flags = {name: getattr(parsed, name, None) for name in ("standby", "standby_model", "served_model_name")}
    urls = list(parsed.standby or ())
    assert urls == standby_urls("llm", 2)
    for i, url in enumerate(urls):
        assert url == f"http://preheat-vllm-standby-{i}.{service['metadata']['name']}.llm.svc:8000"
    # What the router tells a standby to load is what the standby's allow-list names, under the fleet's name.
    standby, words = standby_settings(vllm_container(fleet, "StatefulSet", "preheat-vllm-standby"), fleet)
    assert standby.load is None
    assert standby.allow_model == (flags["standby_model"],) == (VLLM_MODEL,)
    assert flags["served_model_name"] == "llama" == words[words.index("--served-model-name") + 1]
    router_settings = RouterSettings.resolve(
        {"replicas_from": "k8s://llm/preheat-replicas?port=http", **flags}, environment(router, fleet)
    )
    assert router_settings.activation_model == VLLM_MODEL
    # standby-key opens the standbys' load route, and the router holds it; nothing else holds it.
    key = secret_of(vllm_container(fleet, "StatefulSet", "preheat-vllm-standby"), "PREHEAT_ADMIN_KEY")
    assert key == ("standby-key", False)  # required: beyond loopback a standby refuses to start without one
    assert secret_of(router, "PREHEAT_ROUTER_REPLICA_ADMIN_KEY") == key
    assert router_settings.replica_admin_key == standby.admin_key == "sample-standby-key"
    holders = [c["name"] for w in workloads(fleet) for c in containers(w) if secret_of(c, "PREHEAT_ADMIN_KEY")]
    assert holders == ["vllm"]  # the standbys' container only
    # Once it serves, vLLM checks replica-key on /v1/*, which the router presents: one key per purpose.
    replica_key = secret_of(router, "PREHEAT_ROUTER_REPLICA_API_KEY")
    for name, kind in (("preheat-replica", "Deployment"), ("preheat-vllm-standby", "StatefulSet")):
        assert secret_of(vllm_container(fleet, kind, name), "VLLM_API_KEY") == replica_key == ("replica-key", False)
    assert len({key, replica_key, secret_of(router, "PREHEAT_ROUTER_API_KEY")}) == 3


def pod_spec_labels(workload: Doc) -> dict[str, str]:
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return labels


@needs_kubectl
def test_a_standby_without_its_key_or_with_none_set_refuses_to_start(fleet: list[Doc]) -> None:
    container = vllm_container(fleet, "StatefulSet", "preheat-vllm-standby")
    container["env"] = [e for e in container["env"] if e["name"] != "PREHEAT_ADMIN_KEY"]
    with pytest.raises(ConfigError, match="would let anyone who reaches it choose the model"):
        standby_settings(container, fleet)


@needs_kubectl
def test_probes_ask_what_each_phase_answers(fleet: list[Doc]) -> None:
    # A replica answers /health 503 while it loads and vLLM's 200 once it serves (503 again only when its engine
    # is dead); a standby answers 503 "standby" by design until activated, so only its readiness asks /health.
    replica = vllm_container(fleet, "Deployment", "preheat-replica")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert replica[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    standby = vllm_container(fleet, "StatefulSet", "preheat-vllm-standby")
    assert standby["startupProbe"]["tcpSocket"] == {"port": "http"}
    assert standby["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert standby["livenessProbe"]["tcpSocket"] == {"port": "http"}
    for container in (replica, standby):
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"


@needs_kubectl
def test_a_cuda_fleet_gives_each_vllm_pod_its_gpus_and_the_node_cache_follows_them(tmp_path: Path) -> None:
    docs = render(tmp_path, {**FLEET, "gpusPerReplica": 2, "resources": {"replica": {"cpu": "8", "memory": "64Gi"}}},
                  "cuda")  # fmt: skip
    daemon = pod_spec(find(docs, "DaemonSet", "preheat-node-cache"))
    for kind, name in (("Deployment", "preheat-replica"), ("StatefulSet", "preheat-vllm-standby")):
        spec = pod_spec(find(docs, kind, name))
        vllm = vllm_container(docs, kind, name)
        assert vllm["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}
        assert vllm["image"] == "registry.internal/vllm-preheat:0.32.0"  # no -cuda suffix: the user's image
        assert spec["initContainers"][0]["image"] == "ghcr.io/preheat-dev/preheat:0.1.0-cuda"
        for toleration in spec["tolerations"]:
            assert toleration in daemon["tolerations"]
    assert find(docs, "ConfigMap", "preheat-fleet")["data"]["device"] == "cuda"


@needs_kubectl
def test_every_vllm_pod_follows_the_fleets_policy(tmp_path: Path) -> None:
    values = {**FLEET, "vllm": {**FLEET["vllm"], "follow": {"name": "policy", "trustKeysSecret": "refit-keys",
                                                             "trustKeys": ["trainer.key.pub"]}}}  # fmt: skip
    docs = render(tmp_path, values)
    for kind, name in (("Deployment", "preheat-replica"), ("StatefulSet", "preheat-vllm-standby")):
        workload = find(docs, kind, name)
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for container in containers(workload):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            for item in container.get("env", []):
                if re.search(r"TOKEN|KEY|SECRET|PASSWORD", item["name"]) and "value" in item:
                    assert item["value"].startswith("/etc/preheat/"), f"{item['name']} is written in"  # key files
            assert not re.search(r"--(api-key|admin-key|peer-token)\b", " ".join(container["args"]))
        for volume in spec["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["defaultMode"] & 0o007 == 0
        # Following: the refit worker, the registry and peer token to find and pull versions, the keys to trust.
        vllm = vllm_container(docs, kind, name)
        env = environment(vllm, docs)
        assert vllm["args"][-2:] == ["--worker-extension-cls", REFIT_WORKER]
        assert env["PREHEAT_VLLM_FOLLOW"] == "policy"
        assert env["PREHEAT_REGISTRY"] == find(docs, "ConfigMap", "preheat-fleet")["data"]["registry"]
        assert secret_of(vllm, "PREHEAT_PEER_TOKEN") == ("peer-token", False)
        assert env["PREHEAT_VLLM_REFIT_TRUST_KEY"] == "/etc/preheat/refit-trust/trainer.key.pub"
        mount = next(m for m in vllm["volumeMounts"] if m["name"] == "refit-trust-keys")
        assert (mount["mountPath"], mount["readOnly"]) == ("/etc/preheat/refit-trust", True)


@needs_kubectl
def test_the_preheat_engine_deploys_no_vllm_object(tmp_path: Path) -> None:
    docs = render(tmp_path, {"model": {"uri": "s3://models/llama"}, "vllm": {"standbys": 3}})
    assert not [d for d in docs if "vllm" in d["metadata"]["name"]]
    [router] = pod_spec(find(docs, "Deployment", "preheat-router"))["containers"]
    assert "--standby" not in router["args"]
    assert pod_spec(find(docs, "Deployment", "preheat-replica"))["containers"][0]["args"][0] == "serve"


@needs_kubectl
def test_no_standbys_no_router_key_and_another_load_format(tmp_path: Path) -> None:
    values = {**FLEET, "vllm": {"image": VLLM_IMAGE, "loadFormat": "safetensors"}}
    docs = render(tmp_path, values)
    assert find(docs, "StatefulSet", "preheat-vllm-standby")["spec"]["replicas"] == 0
    [router] = pod_spec(find(docs, "Deployment", "preheat-router"))["containers"]
    assert "--standby" not in router["args"]
    assert secret_of(router, "PREHEAT_ROUTER_REPLICA_ADMIN_KEY") is None
    _, words = standby_settings(vllm_container(docs, "Deployment", "preheat-replica"), docs)
    assert words[words.index("--load-format") + 1] == "safetensors"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"engine": "vllm"}, "vllm: 'image' is a required property"),
        ({"engine": "sglang"}, "engine: 'sglang' is not one of ['preheat', 'vllm']"),
        ({"engine": "vllm", "vllm": {"image": {**VLLM_IMAGE, "tag": "latest"}}}, "vllm.image.tag"),
        ({"engine": "vllm", "vllm": {"image": {"repository": "r/vllm"}}}, "vllm.image: 'tag' is a required property"),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE, "args": ["--port", "9000"]}}, "vllm.args.0: '--port'"),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE, "args": ["--api-key=k"]}}, "vllm.args.0: '--api-key=k'"),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE, "args": ["--load-format", "x"]}}, "vllm.args.0"),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE, "standbys": -1}}, "vllm.standbys: -1 is less than"),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE, "loadFormat": "--x"}}, "vllm.loadFormat: '--x' does not"),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE, "replicas": 2}}, "'replicas' was unexpected"),
        (
            {"engine": "vllm", "vllm": {"image": VLLM_IMAGE, "follow": {"name": "p", "trustKeys": ["k.pub"]}}},
            "vllm.follow: 'trustKeysSecret' is a required property",
        ),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE}, "l2": {"backend": "fs"}}, "l2.backend: fs is the KV volume"),
        ({"engine": "vllm", "vllm": {"image": VLLM_IMAGE}, "compile": {"enabled": True}}, "compile.enabled: preheat"),
    ],
)
def test_bad_vllm_values_fail_at_render_time_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict[str, object], message: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": {"uri": "s3://m/x"}, **values}))
    out = tmp_path / "o"
    assert main(["deploy", "render", "--values", str(path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err
    assert message in err
    assert not out.exists()
