"""``preheat artifacts``: the keys that let replicas install each other's compiled artifacts, and signing them.

Only argparse at import time: ``cryptography`` and the artifact code are imported when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from preheat.peer.artifact_store import ArtifactStore
    from preheat.peer.artifacts import Verified

ARTIFACTS_HELP = """\
Compiled artifacts (`preheat serve --compile`) are code: generated Python, shared objects and pickled graphs that
the replica installing them will run. A replica installs artifacts it built itself, and another replica's only when
they are signed by a key it trusts (--trust-key / PREHEAT_TRUST_KEY). Without one, peers' artifacts are refused.

commands:
  keygen OUT         a new Ed25519 key pair: OUT (private, mode 0600; keep it off the serving fleet if you can)
                     and OUT.pub (public: what --trust-key names)
  sign [BLOB ...]    sign blobs with --key; without BLOB, every blob this node built in its node cache
  verify [BLOB ...]  check blobs (default: the node cache's) against --trust-key; exit 1 if any is refused

a fleet, step by step:
  preheat artifacts keygen fleet.key                                   # once, somewhere safe
  preheat serve ./model --compile --peer --registry redis://reg:6379   # a builder compiles...
  preheat artifacts sign --key fleet.key                               # ...and signs what it built
  preheat serve preheat://model --compile --peer --registry redis://reg:6379 --trust-key fleet.key.pub

docs: docs/peer.md (compiled artifacts), docs/security.md
"""


def register(commands: Any) -> None:  # Any: argparse's subparsers action has no public type
    """Add ``artifacts keygen|sign|verify`` to the ``preheat`` command."""
    artifacts = commands.add_parser(
        "artifacts",
        help="keys for sharing compiled artifacts between replicas: keygen, sign, verify",
        description=ARTIFACTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = artifacts.add_subparsers(dest="verb", metavar="VERB", required=True)

    keygen = verbs.add_parser("keygen", help="write a new key pair: OUT (private, 0600) and OUT.pub")
    keygen.add_argument("out", metavar="OUT", help="private key path; the public key goes to OUT.pub")
    keygen.add_argument("--force", action="store_true", help="replace existing files")
    keygen.set_defaults(func=_cmd_keygen)

    sign = verbs.add_parser("sign", help="sign blobs (default: those this node built in its node cache)")
    sign.add_argument("blobs", nargs="*", metavar="BLOB", help="blob files to sign in place")
    sign.add_argument("--key", required=True, metavar="PRIV", help="private key from `preheat artifacts keygen`")
    sign.add_argument("--cache-dir", default=None, help="node cache (default: PREHEAT_CACHE_DIR or ~/.cache/preheat)")
    sign.add_argument("--json", action="store_true", help="print what was signed as JSON")
    sign.set_defaults(func=_cmd_sign)

    verify = verbs.add_parser("verify", help="check blobs against trusted keys (default: the node cache's)")
    verify.add_argument("blobs", nargs="*", metavar="BLOB", help="blob files (default: the node cache's)")
    verify.add_argument(
        "--trust-key", action="append", default=None, metavar="FILE", help="trusted public key (repeatable)"
    )
    verify.add_argument("--cache-dir", default=None, help="node cache (default: PREHEAT_CACHE_DIR or ~/.cache/preheat)")
    verify.add_argument("--json", action="store_true", help="print the results as JSON")
    verify.set_defaults(func=_cmd_verify)


def _cmd_keygen(args: argparse.Namespace) -> int:
    from preheat.peer.signing import fingerprint, generate

    private, public_path, public = generate(args.out, force=args.force)
    print(f"wrote {private} (private, mode 0600) and {public_path} (public, {fingerprint(public)})")
    print(f"trust it on replicas with: --trust-key {public_path}  (or PREHEAT_TRUST_KEY={public_path})")
    return 0


def _store(cache_dir: str | None, trust: list[str] | None = None) -> ArtifactStore:
    from preheat.peer.artifact_store import ArtifactStore
    from preheat.peer.signing import TrustedKeys
    from preheat.store.cache import ModelCache

    if trust is None:  # the flag, else the environment, like `preheat serve`
        raw = os.environ.get("PREHEAT_TRUST_KEY", "")
        trust = [part.strip() for part in raw.split(",") if part.strip()]
    return ArtifactStore(ModelCache(cache_dir).root, TrustedKeys.from_files(trust))


def _read_blob(path: str) -> bytes:
    from preheat.errors import PeerError
    from preheat.peer.artifacts import MAX_BLOB_BYTES

    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BLOB_BYTES + 1)
    except OSError as exc:
        raise PeerError(f"{path}: cannot read ({exc.strerror})") from None
    return raw


def _cmd_sign(args: argparse.Namespace) -> int:
    from preheat.errors import ArtifactTrustError, PeerError
    from preheat.peer import artifacts
    from preheat.peer.signing import SigningKey, fingerprint
    from preheat.store.durable import write_file

    key = SigningKey.read(args.key)
    if os.stat(args.key).st_mode & 0o077:
        print(f"preheat: warning: {args.key} is readable by other users; chmod 600 it", file=sys.stderr)
    signed: list[dict[str, str]] = []
    skipped: list[dict[str, str]] = []
    if args.blobs:  # the operator names these blobs, and so vouches for them
        for path in args.blobs:
            write_file(path, artifacts.sign(_read_blob(path), key, where=path))
            signed.append({"blob": path})
    else:  # the node cache: only what this node built; what it received keeps its builder's signature
        store = _store(args.cache_dir, [])
        for hex_key in store.hex_keys():
            try:
                found = store.load(hex_key)
            except ArtifactTrustError:  # received from a peer: it keeps its builder's signature
                found = None
            except PeerError as exc:
                skipped.append({"blob": store.blob_path(hex_key), "reason": str(exc)})
                continue
            if found is None or not found.local:
                skipped.append({"blob": store.blob_path(hex_key), "reason": "not built on this node"})
                continue
            raw = artifacts.sign(found.blob, key, where=store.blob_path(hex_key))
            store.put(artifacts.verify(raw, hex_key, store.trusted, where="signed", built_here=found.body_sha256))
            signed.append({"blob": store.blob_path(hex_key), "key": hex_key})
    if args.json:
        print(json.dumps({"signer": fingerprint(key.public), "signed": signed, "skipped": skipped}, indent=2))
    else:
        for item in signed:
            print(f"signed {item['blob']} ({fingerprint(key.public)})")
        for item in skipped:
            print(f"skipped {item['blob']}: {item['reason']}")
        if not signed and not skipped:
            print("no compiled artifacts in the node cache (run `preheat serve --compile` first)")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from preheat.errors import PeerError
    from preheat.peer import artifacts

    store = _store(args.cache_dir, args.trust_key)
    results: list[dict[str, str]] = []
    targets: list[tuple[str, str | None]] = [(path, None) for path in args.blobs]
    targets = targets or [(store.blob_path(h), h) for h in store.hex_keys()]
    for path, cached in targets:
        name = cached or ""
        found: Verified | None
        try:
            if cached is None:  # a loose file: its own header names its key; trusted only if signed
                raw = _read_blob(path)
                name = artifacts.parse(raw, where=path).key_hex
                found = artifacts.verify(raw, name, store.trusted, where=path)
            else:
                found = store.load(cached)
            if found is None:
                raise PeerError(f"{path}: gone")
            results.append({"blob": path, "key": name, "ok": "yes", "provenance": found.provenance})
        except PeerError as exc:
            results.append({"blob": path, "key": name, "ok": "no", "refused": str(exc)})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for item in results:
            print(f"{item['blob']}: " + (item["provenance"] if item["ok"] == "yes" else f"REFUSED: {item['refused']}"))
        if not results:
            print("no compiled artifacts to verify")
    return 0 if all(item["ok"] == "yes" for item in results) else 1
