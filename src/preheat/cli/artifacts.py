"""``preheat artifacts``: the keys that let replicas install each other's compiled artifacts, signing them, and
vLLM's compile caches packed into, published from and pulled through the node cache and peers.

Only argparse at import time: ``cryptography``, the artifact code and the vLLM integration are imported when a
command runs (and vLLM itself never: its version is read from the installed distribution).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from preheat.artifacts.blobs import Verified
    from preheat.artifacts.store import ArtifactStore
    from preheat.artifacts.vllm import VllmCacheKey
    from preheat.cli.common import Commands

ARTIFACTS_HELP = """\
Compiled artifacts (`preheat serve --compile`) are code: generated Python, shared objects and pickled graphs that
the replica installing them will run. A replica installs artifacts it built itself, and another replica's only when
they are signed by a key it trusts (--trust-key / PREHEAT_TRUST_KEY). Without one, peers' artifacts are refused.

commands:
  keygen OUT         a new Ed25519 key pair: OUT (private, mode 0600; keep it off the serving fleet if you can)
                     and OUT.pub (public: what --trust-key names)
  sign [BLOB ...]    sign blobs with --key; without BLOB, every blob this node built in its node cache
  verify [BLOB ...]  check blobs (default: the node cache's) against --trust-key; exit 1 if any is refused
  pack               vLLM's compile cache (VLLM_CACHE_ROOT) -> one blob in the node cache, keyed by vLLM, torch,
                     Python, device, model, TP/PP and dtype; --key signs it
  push BLOB ...      publish blob files (signed by a --trust-key) into the node cache, where this node's peer
                     server offers them
  pull               the blob for this node's key from the node cache or peers, verified, installed into the
                     vLLM cache before `vllm serve` starts; exit 1 when nothing was installed

a fleet, step by step (preheat serve):
  preheat artifacts keygen fleet.key                                   # once, somewhere safe
  preheat serve ./model --compile --peer --registry redis://reg:6379   # a builder compiles...
  preheat artifacts sign --key fleet.key                               # ...and signs what it built
  preheat serve preheat://model --compile --peer --registry redis://reg:6379 --trust-key fleet.key.pub

vLLM (run these with the Python that runs `vllm serve`; give --model/--tp/--dtype exactly as vllm serve gets them):
  vllm serve /models/llama --dtype bfloat16 -tp 2                      # a builder compiles once...
  preheat artifacts pack --model /models/llama --dtype bfloat16 --tp 2 --key fleet.key
  PREHEAT_PEER_TOKEN=... python -m preheat.peer /models/llama --artifacts --host 0.0.0.0 --registry redis://reg:6379
  # every other node, before vllm serve:
  preheat artifacts pull --model /models/llama --dtype bfloat16 --tp 2 --registry redis://reg:6379 \
      --trust-key fleet.key.pub ; vllm serve /models/llama --dtype bfloat16 -tp 2

docs: docs/peer.md (compiled artifacts), docs/integrations.md (vLLM), docs/security.md
"""


def register(commands: Commands) -> None:
    """Add ``artifacts keygen|sign|verify|pack|push|pull`` to the ``preheat`` command."""
    artifacts = commands.add_parser(
        "artifacts",
        help="compiled artifacts between replicas: keygen, sign, verify; vLLM compile caches: pack, push, pull",
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
    _cache_dir(sign)
    sign.add_argument("--json", action="store_true", help="print what was signed as JSON")
    sign.set_defaults(func=_cmd_sign)

    verify = verbs.add_parser("verify", help="check blobs against trusted keys (default: the node cache's)")
    verify.add_argument("blobs", nargs="*", metavar="BLOB", help="blob files (default: the node cache's)")
    _trust_flag(verify)
    _cache_dir(verify)
    verify.add_argument("--json", action="store_true", help="print the results as JSON")
    verify.set_defaults(func=_cmd_verify)

    pack = verbs.add_parser(
        "pack",
        help="pack vLLM's compile cache into the node cache (keyed, built here; --key signs it)",
        description=_para(
            "Pack the compile caches vLLM wrote under VLLM_CACHE_ROOT (torch_compile_cache/: Inductor's "
            "kernels, vLLM's saved graphs, Triton's cache inside them) into one blob in the node cache, recorded as "
            "built on this node. Run it with the Python that ran `vllm serve`, after that first run compiled: the key "
            "records its vLLM, torch, Triton and Python versions and this machine's device and CPU/GPU architecture."
        ),
        epilog="example:\n  vllm serve /models/llama --dtype bfloat16 -tp 2     # compiles into ~/.cache/vllm\n"
        "  preheat artifacts pack --model /models/llama --dtype bfloat16 --tp 2 --key fleet.key\n"
        "  python -m preheat.peer /models/llama --artifacts    # offers it (PREHEAT_PEER_TOKEN beyond loopback)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _vllm_key_flags(pack)
    pack.add_argument("--key", default=None, metavar="PRIV", help="also sign it with this private key (keygen)")
    pack.add_argument("--out", default=None, metavar="BLOB", help="also write the blob to this file")
    pack.set_defaults(func=_cmd_pack)

    push = verbs.add_parser(
        "push",
        help="publish blob files into the node cache, where this node's peer server offers them",
        description="Put blob files (from `pack --out` elsewhere, signed) into the node cache after checking them "
        "against --trust-key, so this node's peer server (`python -m preheat.peer DIR --artifacts`, or `preheat "
        "serve --peer`) offers them to pulls. Peers never accept uploads: a node publishes what it verified.",
    )
    push.add_argument("blobs", nargs="+", metavar="BLOB", help="blob files")
    _trust_flag(push)
    _cache_dir(push)
    push.add_argument("--json", action="store_true", help="print what was published as JSON")
    push.set_defaults(func=_cmd_push)

    pull = verbs.add_parser(
        "pull",
        help="fetch this node's vLLM compile cache (node cache, peers), verify, install it before vllm serve",
        description=_para(
            "Compute this node's key (as `pack` does), take the blob from the node cache or else the "
            "first peer (--peer, PREHEAT_PEERS, then the registry's peers for the model's identity) whose blob is "
            "for this key, signed by a --trust-key and intact, and install its directories into the vLLM cache. "
            "Directories already there are kept. Exit 0 when installed, 1 when nothing was (vLLM then compiles)."
        ),
        epilog="example (before vllm serve; the same --model/--tp/--dtype it gets):\n"
        "  PREHEAT_PEER_TOKEN=... preheat artifacts pull --model /models/llama --dtype bfloat16 --tp 2 \\\n"
        "      --registry redis://reg:6379 --trust-key fleet.key.pub\n"
        "  vllm serve /models/llama --dtype bfloat16 -tp 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _vllm_key_flags(pull)
    pull.add_argument(
        "--peer", action="append", default=None, metavar="HOST:PORT", help="a peer to ask (repeatable; PREHEAT_PEERS)"
    )
    pull.add_argument("--registry", default=None, metavar="URL", help="registry whose peers to ask (PREHEAT_REGISTRY)")
    _trust_flag(pull)
    pull.set_defaults(func=_cmd_pull)


def _para(text: str) -> str:
    """A description paragraph wrapped for the raw formatter (which keeps the examples' lines as written)."""
    return textwrap.fill(text, 100)


def _cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", default=None, metavar="DIR", help="node cache (default: PREHEAT_CACHE_DIR or ~/.cache/preheat)"
    )


def _trust_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trust-key",
        action="append",
        default=None,
        metavar="FILE",
        help="trusted public key (repeatable; default PREHEAT_TRUST_KEY, comma-separated)",
    )


def _vllm_key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vllm-cache",
        default=None,
        metavar="DIR",
        help="vLLM's cache root (default: VLLM_CACHE_ROOT or ~/.cache/vllm)",
    )
    parser.add_argument(
        "--model", required=True, help="the model exactly as `vllm serve` gets it (vLLM's own cache hash includes it)"
    )
    parser.add_argument(
        "--dtype", required=True, metavar="DTYPE", help="bfloat16, float16 or float32, as `vllm serve --dtype`"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default: 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default: 1)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cpu for a CPU build of vLLM, else cuda)")
    parser.add_argument(
        "--triton-cache",
        default=None,
        metavar="DIR",
        help="a TRITON_CACHE_DIR you set for vllm serve (default: none; without it Triton's cache is inside vLLM's)",
    )
    _cache_dir(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _cmd_keygen(args: argparse.Namespace) -> int:
    from preheat.artifacts.signing import fingerprint, generate

    private, public_path, public = generate(args.out, force=args.force)
    print(f"wrote {private} (private, mode 0600) and {public_path} (public, {fingerprint(public)})")
    print(f"trust it on replicas with: --trust-key {public_path}  (or PREHEAT_TRUST_KEY={public_path})")
    return 0


def _store(cache_dir: str | None, trust: list[str] | None = None) -> ArtifactStore:
    from preheat.artifacts.store import node_store

    return node_store(cache_dir, trust)  # the flag, else the environment, like `preheat serve`


def _read_blob(path: str) -> bytes:
    from preheat.artifacts.blobs import MAX_BLOB_BYTES
    from preheat.core.errors import PeerError

    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BLOB_BYTES + 1)
    except OSError as exc:
        raise PeerError(f"{path}: cannot read ({exc.strerror})") from None
    return raw


def _cmd_sign(args: argparse.Namespace) -> int:
    from preheat.artifacts import blobs as artifacts
    from preheat.artifacts.signing import SigningKey, fingerprint
    from preheat.core.durable import write_file
    from preheat.core.errors import ArtifactTrustError, PeerError

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
    from preheat.artifacts import blobs as artifacts
    from preheat.core.errors import PeerError

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


def _vllm_key(args: argparse.Namespace) -> VllmCacheKey:
    from preheat.artifacts import vllm as vllm_artifacts

    engine = vllm_artifacts.installed_engine()
    return vllm_artifacts.cache_key(
        engine, model=args.model, dtype=args.dtype, tp=args.tp, pp=args.pp, device=args.device
    )


def _vllm_root(args: argparse.Namespace) -> str:
    from preheat.artifacts.vllm import default_cache_root

    return os.path.abspath(args.vllm_cache or default_cache_root())


def _units(units: dict[str, set[tuple[int, int]]]) -> dict[str, list[str]]:
    return {unit: [f"rank_{r}_{d}" for r, d in sorted(ranks)] for unit, ranks in sorted(units.items())}


def _cmd_pack(args: argparse.Namespace) -> int:
    from preheat.artifacts.signing import SigningKey
    from preheat.artifacts.vllm import pack_into_store
    from preheat.core.durable import write_file

    key = _vllm_key(args)
    root = _vllm_root(args)
    signer = SigningKey.read(args.key) if args.key else None
    store = _store(args.cache_dir, [])
    result = pack_into_store(key, root, store, signer=signer, triton_cache=args.triton_cache)
    if args.out:
        write_file(args.out, result.verified.blob)
    signed = _signer(result.verified.blob)
    if args.json:
        doc = {
            "key": key.hex,
            "fields": key.fields(),
            "blob": result.path,
            "bytes": len(result.verified.blob),
            "signed_by": signed,
            "units": _units(result.units),
        }
        print(json.dumps(doc, indent=2))
        return 0
    print(f"packed {root} for key {key.hex} ({len(result.verified.blob)} bytes): {result.path}")
    print(f"  vLLM {key.build} {key.vllm}, torch {key.torch}, Python {key.python}, {key.device} {key.arch}")
    print(f"  model {key.model} ({key.identity or 'no local identity'}), tp {key.tp}, pp {key.pp}, {key.dtype}")
    for unit, ranks in _units(result.units).items():
        print(f"  {unit}  {' '.join(ranks)}")
    if signed:
        print(f"  signed by {signed}: nodes with --trust-key for it install it")
    else:
        print("  not signed: only this node installs it (sign with `preheat artifacts sign --key KEY`)")
    print("offer it to peers: python -m preheat.peer MODEL_DIR --artifacts (or preheat serve --peer)")
    return 0


def _signer(raw: bytes) -> str | None:
    """The fingerprint of a blob's signer (not checked: for messages), or None when unsigned."""
    from preheat.artifacts import blobs as artifacts
    from preheat.artifacts.signing import fingerprint

    signer = artifacts.parse(raw, where="blob").signer
    return fingerprint(signer) if signer is not None else None


def _cmd_push(args: argparse.Namespace) -> int:
    from preheat.artifacts import blobs as artifacts
    from preheat.core.errors import PeerError

    store = _store(args.cache_dir, args.trust_key)
    results: list[dict[str, str]] = []
    for path in args.blobs:
        try:
            raw = _read_blob(path)
            parsed = artifacts.parse(raw, where=path)
            verified = artifacts.verify(raw, parsed.key_hex, store.trusted, where=path)
            stored = store.put(verified)
            kind = str(parsed.key.get("format", "?"))
            results.append(
                {
                    "blob": path,
                    "key": verified.hex,
                    "kind": kind,
                    "stored": stored,
                    "ok": "yes",
                    "provenance": verified.provenance,
                }
            )
        except PeerError as exc:
            results.append({"blob": path, "ok": "no", "refused": str(exc)})
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for item in results:
            if item["ok"] == "yes":
                print(f"published {item['blob']} as {item['stored']} ({item['kind']}, {item['provenance']})")
            else:
                print(f"{item['blob']}: REFUSED: {item['refused']}")
    return 0 if all(item["ok"] == "yes" for item in results) else 1


def _cmd_pull(args: argparse.Namespace) -> int:
    from preheat.artifacts.vllm import pull
    from preheat.peer.pull import PeerOptions

    key = _vllm_key(args)
    root = _vllm_root(args)
    options = PeerOptions.from_env(registry=args.registry, peers=tuple(args.peer) if args.peer else None)
    store = _store(args.cache_dir, args.trust_key)
    result = pull(
        key,
        store,
        root,
        peers=options.peers,
        registry=options.registry,
        token=options.token,
        triton_cache=args.triton_cache,
    )
    if args.json:
        doc: dict[str, object] = {
            "key": key.hex,
            "vllm_cache": root,
            "source": result.source or None,
            "provenance": result.provenance or None,
            "installed": result.installed.installed if result.installed else [],
            "kept": result.installed.kept if result.installed else [],
            "refused": result.refused,
        }
        print(json.dumps(doc, indent=2))
    else:
        for reason in result.refused:
            print(f"refused: {reason}", file=sys.stderr)
        if result.installed is None:
            print(f"no compiled artifacts installed for key {key.hex}: vLLM will compile")
        else:
            print(f"artifacts for key {key.hex} from {result.source} ({result.provenance}) -> {root}")
            for unit in result.installed.installed:
                print(f"  installed {unit}")
            for unit in result.installed.kept:
                print(f"  kept {unit} (already there)")
    return 0 if result.installed is not None else 1
