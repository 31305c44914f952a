"""``preheat deploy render``: deployment values -> a Kustomize overlay, or the manifests (docs/kubernetes.md)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from preheat.core.errors import ConfigError

if TYPE_CHECKING:
    from preheat.cli.common import Commands

RENDER_HELP = """\
Turn deployment values into a Kustomize overlay of the manifests shipped with preheat (their kustomize/base), checked
against their values.schema.json first: a bad value (negative replicas, an unknown L2 scheme, no model) fails here,
naming the key, not at pod start. Works from any directory: nothing is read from a checkout.

Values are merged in order: the shipped values.yaml (the defaults), each --values FILE, then each --profile:
  cpu            CPU replicas (the default)
  cuda           the -cuda image, nvidia.com/gpu per replica
  redis-l2       L2 and peer registry in an in-cluster Redis (the default)
  fs-l2          L2 and registry on a ReadWriteMany volume
  scale-to-zero  a KEDA ScaledObject instead of the HPA, min 0 replicas

With -o DIR the overlay is written to DIR/kustomization.yaml (apply it with `kubectl apply -k DIR`; it refers to the
shipped base by a relative path); without it the manifests are printed (`kubectl kustomize` of that overlay, so
kubectl must be on PATH).

examples:
  preheat deploy render --values fleet.yaml -o overlays/prod && kubectl apply -k overlays/prod
  preheat deploy render --values fleet.yaml --profile cuda --profile fs-l2 | kubectl apply -f -
  preheat simulate day.jsonl --cold-start t.json --emit-values policy.yaml
  preheat deploy render --values fleet.yaml --values policy.yaml -o overlays/prod
"""


def register(commands: Commands) -> None:
    """Add ``deploy`` (verb: ``render``) to the ``preheat`` command."""
    deploy = commands.add_parser(
        "deploy",
        help="render the Kubernetes manifests of a fleet from checked values (docs/kubernetes.md)",
        description="Deploy preheat on Kubernetes: replicas, router, node cache, L2, autoscaling.",
    )
    verbs = deploy.add_subparsers(dest="verb", metavar="VERB", required=True)
    render = verbs.add_parser(
        "render",
        help="values -> a checked Kustomize overlay (or the manifests)",
        description=RENDER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    render.add_argument("--values", action="append", default=[], metavar="FILE", help="YAML values (repeatable)")
    render.add_argument("--profile", action="append", default=[], metavar="NAME", help="a profile (repeatable)")
    render.add_argument("-o", "--output", default=None, metavar="DIR", help="write DIR/kustomization.yaml")
    render.add_argument(
        "--deploy-dir",
        default=None,
        metavar="DIR",
        help="render from a copy of the manifests (values.yaml, values.schema.json, kustomize/) instead of the "
        "ones shipped in the package (preheat/k8s/manifests)",
    )
    render.set_defaults(func=_cmd_render)


def require_deploy_extra() -> None:
    """``preheat deploy`` reads YAML and checks it against a JSON Schema: both come with the deploy extra."""
    try:
        import jsonschema  # noqa: F401 - only whether it imports
        import yaml  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"needs the deploy extra ({exc.name} is missing): pip install 'preheat[deploy]'") from None


def _read_yaml(path: str) -> Any:  # Any: a YAML document, validated by the caller
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read values ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None


def load_values(deploy_dir: str, files: list[str], profiles: list[str]) -> dict[str, Any]:  # Any: YAML values
    """The merged values, checked against ``deploy_dir/values.schema.json`` (``ConfigError`` names bad keys)."""
    from preheat.core.errors import JSONInputError
    from preheat.core.jsonsafe import read_object
    from preheat.k8s.values import combine, validate

    schema_path = os.path.join(deploy_dir, "values.schema.json")
    if not os.path.isfile(schema_path):
        raise ConfigError(f"{schema_path}: not found; --deploy-dir takes a copy of preheat/k8s/manifests")
    try:
        schema = read_object(schema_path, max_bytes=16 << 20)
    except (OSError, JSONInputError) as exc:
        raise ConfigError(f"{schema_path}: cannot read the values schema ({exc})") from None
    defaults = _read_yaml(os.path.join(deploy_dir, "values.yaml"))
    values = combine(defaults, [(path, _read_yaml(path)) for path in files], profiles)
    validate(values, schema, where=", ".join(files) or "values")
    return values


def write_overlay(values: dict[str, Any], deploy_dir: str, out_dir: str) -> str:  # Any: YAML values
    """Write ``out_dir/kustomization.yaml`` for ``values``; return its path."""
    import yaml

    from preheat.k8s.render import kustomization

    os.makedirs(out_dir, exist_ok=True)
    # Kustomize accepts only relative paths to bases and components.
    relative = os.path.relpath(os.path.join(deploy_dir, "kustomize"), out_dir)
    path = os.path.join(out_dir, "kustomization.yaml")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("# Generated by `preheat deploy render`; edit the values and render again.\n")
        yaml.dump(kustomization(values, relative), handle, Dumper=_block_dumper(), sort_keys=False, width=120)
    return path


def _block_dumper() -> type:
    import yaml

    class BlockDumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no types: SafeDumper is Any here
        """Multi-line strings (the JSON patches) as ``|`` blocks: one operation per line, as a person writes them."""

    def text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    BlockDumper.add_representer(str, text)
    return BlockDumper


def kubectl_kustomize(overlay_dir: str) -> str:
    """The manifests of an overlay, through ``kubectl kustomize``."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise ConfigError("kubectl not found on PATH: pass -o DIR to write the overlay and render it elsewhere")
    done = subprocess.run([kubectl, "kustomize", overlay_dir], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ConfigError(f"kubectl kustomize {overlay_dir} failed: {done.stderr.strip()}")
    return done.stdout


def _cmd_render(args: argparse.Namespace) -> int:
    from preheat.k8s.bundle import manifests_dir

    require_deploy_extra()
    deploy_dir = args.deploy_dir or str(manifests_dir())  # the package's own copy: no checkout, any directory
    values = load_values(deploy_dir, args.values, args.profile)
    if args.output:
        path = write_overlay(values, deploy_dir, args.output)
        print(f"wrote {path}; apply it with: kubectl apply -k {args.output}", file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory(prefix="preheat-deploy-") as tmp:
        sys.stdout.write(kubectl_kustomize(os.path.dirname(write_overlay(values, deploy_dir, tmp))))
    return 0
