"""``preheat refit ...``: live weight updates from the command line (docs/refit.md).

``publish`` serves a checkpoint on disk as a version of ``preheat://NAME`` (a trainer that writes checkpoints, or a
rollback); ``status`` shows what a replica started with ``--follow`` serves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from preheat.cli.common import Commands, renamed
from preheat.core import env

REFIT_HELP = """\
Live weight updates (docs/refit.md): a trainer publishes versions of preheat://NAME from memory
(preheat.refit.Publisher), replicas started with `preheat serve ... --follow --registry URL` pull the tensors that
changed from the trainer and from each other, verify them, and swap them in between two requests.

examples:
  preheat refit publish ./ckpt-step-4000 --name smollm2 --registry redis://reg:6379 --version 4000 --dtype bf16
  preheat refit status http://replica:8000
"""

PUBLISH_HELP = """\
Publish the checkpoint DIR (its *.safetensors files) as the next version of NAME and serve it until Ctrl-C:
replicas following NAME pull what changed. The tensors are read into memory once; nothing else is written.

Sign it with --signing-key (a key from `preheat artifacts keygen`): replicas started with --refit-trust-key apply
only versions signed by a key they trust, and --follow beyond loopback requires one.

examples:
  preheat refit publish ./ckpt-step-4000 --name smollm2 --registry redis://reg:6379 --version 4000 \
      --signing-key trainer.key
  preheat refit publish ./ckpt --name smollm2 --registry file:///shared/registry --version 7 --dtype bf16
"""

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
HEALTH_BYTES = 1024 * 1024  # a replica's /health is a few kB


def register(commands: Commands) -> None:
    """Add ``refit`` (``publish``, ``status``) to the ``preheat`` command."""
    raw = argparse.RawDescriptionHelpFormatter
    refit = commands.add_parser(
        "refit", help="publish weights versions live, see what replicas serve", description=REFIT_HELP,
        formatter_class=raw,
    )  # fmt: skip
    verbs = refit.add_subparsers(dest="refit_command", metavar="VERB")
    verbs.required = True
    publish = verbs.add_parser(
        "publish", help="serve a checkpoint directory as the next version of NAME", description=PUBLISH_HELP,
        formatter_class=raw,
    )  # fmt: skip
    publish.add_argument("dir", help="checkpoint directory (*.safetensors)")
    publish.add_argument(
        "--name", required=True, metavar="NAME", help="the served name replicas follow (preheat://NAME)"
    )
    publish.add_argument(
        "--registry", required=True, metavar="URL", help="redis://host:port[/db] or file:///shared/dir"
    )
    # dest: the top-level parser's --version flag lives in the same namespace
    # Required: a process started from a checkpoint knows no history, and a version at or below what replicas serve
    # is ignored by them, so guessing "1" would publish nothing anyone takes.
    publish.add_argument(
        "--version", dest="refit_version", type=int, required=True,
        help="version number: higher than any version replicas of NAME serve (e.g. the training step)",
    )  # fmt: skip
    publish.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, metavar="DTYPE",
        help="cast float tensors before serving: bf16, fp16 or fp32",
    )  # fmt: skip
    publish.add_argument("--host", default="127.0.0.1", help="where the refit server listens (default: loopback)")
    publish.add_argument("--port", type=int, default=0, help="refit server port (default: 0, free)")
    # --peer-token, as `preheat serve` names the same secret (PREHEAT_PEER_TOKEN); --token, its spelling before.
    token = publish.add_argument(
        "--peer-token", default=None, metavar="TOKEN", help="token pullers must send (prefer PREHEAT_PEER_TOKEN)"
    )
    renamed(publish, "--token", token)
    publish.add_argument(
        "--signing-key", default=None, metavar="FILE",
        help="sign the version with this Ed25519 private key (`preheat artifacts keygen`); replicas trust its .pub",
    )  # fmt: skip
    publish.set_defaults(func=_cmd_publish)
    status = verbs.add_parser("status", help="the version a --follow replica serves, and its last pull")
    status.add_argument("url", help="the replica: http://host:port")
    status.add_argument("--json", action="store_true", help="print the replica's refit status as JSON")
    status.set_defaults(func=_cmd_status)


def _cmd_publish(args: argparse.Namespace) -> int:
    from preheat.core.errors import CheckpointError

    files = sorted(f for f in os.listdir(args.dir) if f.endswith(".safetensors")) if os.path.isdir(args.dir) else []
    if not files:  # before torch is imported: a wrong path fails in milliseconds
        raise CheckpointError(f"{args.dir}: no *.safetensors files to publish", path=args.dir)
    from preheat.artifacts.signing import SigningKey, fingerprint

    signer = SigningKey.read(args.signing_key) if args.signing_key else None  # a bad key fails before the weights load
    import torch
    from safetensors.torch import load_file

    from preheat.refit.publisher import Publisher

    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(os.path.join(args.dir, name)))
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    token = args.peer_token or env.get(env.PEER_TOKEN)
    with Publisher(
        args.name, registry=args.registry, host=args.host, port=args.port, token=token, signing_key=signer
    ) as publisher:
        manifest = publisher.publish(weights, args.refit_version, dtype=dtype)
        signed = f"signed by {fingerprint(signer.public)}" if signer is not None else "unsigned"
        print(
            f"preheat refit: serving version {manifest.version} of {args.name} on {publisher.url} "
            f"({len(manifest.tensors)} tensors, {manifest.total_bytes} bytes; epoch {manifest.epoch}, {signed}); "
            "Ctrl-C to stop",
            flush=True,
        )
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            print("preheat refit: stopping", flush=True)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from preheat.core.errors import JSONInputError, RefitError
    from preheat.core.jsonsafe import load_object
    from preheat.http.client import Timeouts, request

    url = args.url.rstrip("/") + "/health"
    answer = request(url, timeouts=Timeouts.within(10.0), max_body=HEALTH_BYTES)
    try:  # bounded: URL may be any server, and 64 KiB of "[" once ended this command in a RecursionError
        body = load_object(answer.body, max_bytes=HEALTH_BYTES)
    except JSONInputError as exc:
        raise RefitError(f"{url}: HTTP {answer.status}, not a preheat replica's health answer ({exc})") from None
    refit = body.get("refit")
    if not isinstance(refit, dict):
        raise RefitError(f"{url}: this replica does not follow versions (start it with --follow)")
    if args.json:
        print(json.dumps(refit, indent=2))
        return 0
    print(f"{refit.get('name')}: version {refit.get('version') or 0} (epoch {refit.get('epoch')}), newest seen "
          f"{refit.get('newest')}, {refit.get('behind')} behind, "
          f"{'signed versions only' if refit.get('signed') else 'unsigned, from this machine only'}")  # fmt: skip
    last = refit.get("last")
    if isinstance(last, dict):
        print(f"last pull: {last.get('tensors')} tensors, {last.get('nbytes')} of {last.get('model_bytes')} bytes in "
              f"{last.get('pull_s', 0):.2f} s from {', '.join(last.get('sources') or {}) or 'nobody'}")  # fmt: skip
    lies = refit.get("lies")
    if isinstance(lies, dict) and lies:
        print("holders that lied (manifest or bytes that did not verify): "
              + ", ".join(f"{holder} ({count})" for holder, count in sorted(lies.items())))  # fmt: skip
    if refit.get("error"):
        failed = refit.get("failed")
        print(f"version {failed} failed: " if failed is not None else "", refit.get("error"), sep="", file=sys.stderr)
        return 1
    return 0
