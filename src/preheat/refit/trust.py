"""Who may publish a weights version: manifest signatures, the order of versions, and when ``--follow`` may start.

Pure rules, torch-free (``preheat serve`` checks ``require_trust`` before it binds). Signing itself is
``preheat.artifacts.signing`` (the one home of keys and signatures); what a refit signature covers is fixed here:

- the publisher signs ``CONTEXT + manifest.signed_bytes()`` (the canonical JSON of name, epoch, version and every
  tensor's dtype, shape, bytes and digest) with its Ed25519 key; the context string keeps a version's signature
  from ever passing for a compiled artifact's, and back;
- a follower with trusted keys (``--refit-trust-key``) applies, counts and advertises a version only when its
  manifest carries a signature by one of them that verifies over the manifest as parsed (``check_signature``); the
  tensors' digests then tie every byte pulled, from any holder, to what the trainer signed;
- versions are ordered by ``(epoch, version)``: the epoch is the publisher's start time in milliseconds, so a
  trainer that restarts moves forward even when it counts from 1 again (``new_epoch``);
- a version more than ``max_jump`` past the one served, or an epoch more than a day ahead of this machine's clock,
  is refused even when signed (``refusal``): one mistyped number would otherwise pin every follower above what the
  trainer publishes next;
- without trusted keys, a follower takes versions only from holders on this machine (``holder_allowed``), and
  ``--follow`` with a registry or a refit server beyond loopback refuses to start (``require_trust``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from urllib.parse import urlsplit

from preheat.artifacts.signing import SigningKey, TrustedKeys, fingerprint
from preheat.core.errors import ConfigError, VerificationError
from preheat.peer.access import is_loopback
from preheat.refit.protocol import Signature, VersionKey, VersionManifest

CONTEXT = b"preheat refit version manifest v1\0"
DEFAULT_MAX_JUMP = 1_000_000
EPOCH_SLACK_MS = 24 * 3600 * 1000  # an epoch this far ahead of our clock is a wrong clock or a forged number
HOW_TO_SIGN = (
    "make a key pair with `preheat artifacts keygen trainer.key`; the trainer signs with the private key "
    "(`Publisher(..., signing_key='trainer.key')` or `preheat refit publish --signing-key trainer.key`) and every "
    "replica trusts the public one (`--refit-trust-key trainer.key.pub` or PREHEAT_REFIT_TRUST_KEY)"
)


def new_epoch() -> int:
    """A publisher's epoch: now, in milliseconds since 1970 (a restarted trainer's is later than its last one's)."""
    return time.time_ns() // 1_000_000


def sign(manifest: VersionManifest, key: SigningKey) -> VersionManifest:
    """``manifest`` with ``key``'s signature."""
    return replace(manifest, signature=Signature(key.public, key.sign(CONTEXT + manifest.signed_bytes())))


def check_signature(manifest: VersionManifest, trusted: TrustedKeys, *, where: str) -> None:
    """``VerificationError`` naming ``where`` unless ``manifest`` is signed by one of ``trusted`` (nothing to check
    when no key is trusted: the follower then takes versions from this machine only)."""
    if not trusted:
        return
    signature = manifest.signature
    if signature is None:
        raise VerificationError(f"{where}: version {manifest.version} is not signed; refused. To sign: {HOW_TO_SIGN}")
    who = fingerprint(signature.signer)
    if signature.signer not in trusted:
        raise VerificationError(
            f"{where}: version {manifest.version} is signed by {who}, not a --refit-trust-key (trusted: "
            f"{trusted.describe()}); refused"
        )
    if not trusted.verifies(signature.signer, signature.value, CONTEXT + manifest.signed_bytes()):
        raise VerificationError(
            f"{where}: the signature by {who} does not match version {manifest.version}'s manifest (altered); refused"
        )


def refusal(served: VersionKey | None, candidate: VersionKey, *, max_jump: int, now_ms: int) -> str | None:
    """Why a version ``candidate`` newer than ``served`` (None: the loaded checkpoint, version 0) must not be
    applied even though it verifies, or None."""
    epoch, version = candidate
    if epoch > now_ms + EPOCH_SLACK_MS:
        return f"its epoch {epoch} is more than a day ahead of this replica's clock ({now_ms} ms)"
    base = served[1] if served is not None else 0
    if version - base > max_jump:
        return f"version {version} is {version - base} past version {base} (more than --refit-max-jump {max_jump})"
    return None


def behind(served: VersionKey | None, newest: VersionKey | None) -> int:
    """Versions published that the replica does not serve: within one epoch the difference; a newer epoch counts as
    at least one (its numbers may start again from 1)."""
    if newest is None or (served is not None and served >= newest):
        return 0
    if served is not None and served[0] == newest[0]:
        return newest[1] - served[1]
    return max(1, newest[1] - (served[1] if served is not None else 0))


def address_host(address: str) -> str:
    """The host of a ``host:port`` holder address (``[v6]:port`` too)."""
    return address.rsplit(":", 1)[0].strip("[]")


def holder_allowed(address: str, trusted: TrustedKeys) -> bool:
    """Whether a holder may be asked for versions: any, when signatures are checked; else only one on this machine."""
    return bool(trusted) or is_loopback(address_host(address))


def registry_host(registry: str) -> str:
    """The host a registry URL reaches: ``localhost`` for a file or unix-socket registry (on this machine)."""
    if registry.startswith(("file://", "unix://")):
        return "localhost"
    return urlsplit(registry).hostname or "localhost"


def require_trust(registry: str | None, refit_host: str, trust_keys: Sequence[str]) -> None:
    """``ConfigError`` when ``--follow`` would take versions from beyond loopback (a registry there, or a refit server
    bound there) with no ``--refit-trust-key``: whoever could write the registry would choose the weights."""
    if trust_keys:
        return
    beyond = []
    if registry is not None and not is_loopback(registry_host(registry)):
        beyond.append(f"the registry {urlsplit(registry).hostname}")
    if not is_loopback(refit_host):
        beyond.append(f"the refit server on {refit_host or '*'}")
    if beyond:
        raise ConfigError(
            f"--follow with {' and '.join(beyond)} beyond loopback and no --refit-trust-key would serve any version "
            f"whoever can write the registry publishes: {HOW_TO_SIGN}"
        )
