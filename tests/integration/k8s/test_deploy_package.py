"""The Kubernetes manifests are package data: ``preheat deploy render`` works from any directory, and from a wheel
installed anywhere, with no checkout (the files live in ``preheat/k8s/manifests``, found by importlib.resources)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from deployrender import KUBECTL, ROOT, find, kustomize, needs_kubectl
from preheat.cli.main import main
from preheat.k8s.bundle import manifests_dir

FLEET = {"model": {"uri": "s3://models/smollm2"}}
SHIPPED = sorted(p.relative_to(manifests_dir()).as_posix() for p in manifests_dir().rglob("*") if p.is_file())


def preheat(*argv: str, cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m preheat ARGV`` in ``cwd``, with kubectl on its PATH; ``pythonpath`` first on its import path."""
    env = dict(os.environ)
    if KUBECTL is not None:
        env["PATH"] = f"{Path(KUBECTL).parent}{os.pathsep}{env.get('PATH', '')}"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(
        [sys.executable, "-m", "preheat", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )


def test_the_package_finds_every_manifest_and_the_values_files() -> None:
    assert {"values.yaml", "values.schema.json", "kustomize/base/kustomization.yaml"} <= set(SHIPPED)
    assert {p.split("/")[2] for p in SHIPPED if p.startswith("kustomize/overlays/")} == {
        "cpu", "cuda", "redis-l2", "fs-l2", "scale-to-zero",
    }  # fmt: skip
    assert not (ROOT / "deploy" / "kustomize").exists()  # one copy: the package's


@needs_kubectl
def test_render_works_from_a_directory_outside_the_checkout(tmp_path: Path) -> None:
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    done = preheat("deploy", "render", "--values", "fleet.yaml", "-o", "overlays/prod", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "kubectl apply -k overlays/prod" in done.stderr
    docs = kustomize(tmp_path / "overlays" / "prod")
    assert find(docs, "ConfigMap", "preheat-fleet")["data"]["model"] == "s3://models/smollm2"
    printed = preheat("deploy", "render", "--values", "fleet.yaml", "--profile", "fs-l2", cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr
    objects = [doc for doc in yaml.safe_load_all(printed.stdout) if doc]
    assert find(objects, "PersistentVolumeClaim", "preheat-kv")["spec"]["accessModes"] == ["ReadWriteMany"]


@needs_kubectl
def test_deploy_dir_renders_from_a_copy_of_the_manifests(tmp_path: Path) -> None:
    copy = tmp_path / "manifests"
    shutil.copytree(manifests_dir(), copy)
    defaults = yaml.safe_load((copy / "values.yaml").read_text())
    (copy / "values.yaml").write_text(yaml.safe_dump({**defaults, "namespace": "from-the-copy"}))
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    out = tmp_path / "overlay"
    assert main(["deploy", "render", "--deploy-dir", str(copy), "--values", str(fleet), "-o", str(out)]) == 0
    assert {d["metadata"].get("namespace") for d in kustomize(out) if d["kind"] == "Deployment"} == {"from-the-copy"}


@pytest.mark.slow
@needs_kubectl
def test_the_wheel_ships_the_manifests_and_renders_from_where_it_is_installed(tmp_path: Path) -> None:
    # Built from a copy of the sources: a build in the checkout would write build/ and egg-info into a shared tree.
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(dist), str(project)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("preheat-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert {f"preheat/k8s/manifests/{p}" for p in SHIPPED} <= names
        assert not [n for n in names if n.startswith("preheat/k8s/manifests/") and n.endswith(".py")]
        site = tmp_path / "site"
        archive.extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    done = preheat("deploy", "render", "--values", "fleet.yaml", "-o", "out", cwd=elsewhere, pythonpath=site)
    assert done.returncode == 0, done.stderr
    overlay = yaml.safe_load((elsewhere / "out" / "kustomization.yaml").read_text())
    base = (elsewhere / "out" / overlay["resources"][0]).resolve()
    assert base == (site / "preheat" / "k8s" / "manifests" / "kustomize" / "base").resolve()  # the wheel's copy
    assert find(kustomize(elsewhere / "out"), "ConfigMap", "preheat-fleet")["data"]["model"] == "s3://models/smollm2"
