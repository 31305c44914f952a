"""Which models a replica may be told to load: the ``--allow-model`` rule (docs/server.md, *Control endpoints*).

A standby replica loads what ``POST /v1/preheat/load`` names, so whoever can reach that route chooses what the
replica reads and runs. The rule, pure and checked before anything is fetched:

- a model is allowed when it matches one of the patterns (``fnmatch`` globs, case-sensitive; ``*`` also matches
  ``/``, so ``s3://models/*`` allows every key under that prefix);
- with no ``--allow-model``, the patterns are the one MODEL the operator gave on the command line, so the default
  allows nothing the operator did not name (a standby replica without MODEL must be given ``--allow-model``);
- both sides are compared in their normal form (``normalize``), and the replica then loads the normal form it
  matched, never the string it was sent: local paths resolved (absolute, symlinks followed, so ``/models/../etc``
  is ``/etc``); ``http(s)://`` URIs percent-decoded and normalized (``preheat.http.urlnorm``: lower-case scheme and
  host, no default port), so ``public/%2e%2e/private`` cannot pass for ``public/...`` at an origin that decodes
  and resolves it;
- URIs are refused whatever the patterns say when they could name another object than the one the pattern shows:
  ``.`` and ``..`` path segments (also escaped, ``%2e%2e``), escapes no normal form stands for (``%2f``, ``%5c``,
  ``%25``, NUL), any ``%`` in an ``s3://`` key (S3 takes keys literally, some S3-compatible servers decode them),
  user info (``user:pass@``), a query or fragment, control characters and whitespace.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from urllib.parse import urlsplit

from preheat.core.errors import ConfigError
from preheat.http import urlnorm
from preheat.server.settings import REMOTE_SCHEMES
from preheat.sources.peer_uri import SCHEME as PEER_SCHEME

GLOB = "*?[]"  # fnmatch's characters: a pattern's path keeps them as they are


def normalize(model: str) -> str:
    """``model`` as the rule compares it and as the replica then loads it: a local path resolved, an ``http(s)://``
    URI in its normal form, an ``s3://`` URI with its scheme in lower case, a ``preheat://`` name as given.
    ``ConfigError`` for a URI that has no normal form (``refusal`` says why first).

    >>> normalize("HTTP://Origin:80/public/%74iny")
    'http://origin/public/tiny'
    """
    if not model.lower().startswith(REMOTE_SCHEMES):
        return os.path.realpath(os.path.abspath(model))
    scheme, _, rest = model.partition("://")
    scheme = scheme.lower()
    if scheme in urlnorm.SCHEMES:
        return urlnorm.normalize_url(model)
    return f"{scheme}://{rest}"


def _pattern(pattern: str) -> str:
    """A ``--allow-model`` pattern in the form models are compared in: a local path resolved; a URI's scheme and host
    in lower case without the default port, its path's escapes normalized (glob characters kept). A pattern with no
    normal form is compared as written: it can only fail to match, never let more through, since the model side is
    always normal."""
    if not pattern.lower().startswith(REMOTE_SCHEMES):
        return normalize(pattern)
    scheme, _, rest = pattern.partition("://")
    scheme = scheme.lower()
    if scheme not in urlnorm.SCHEMES:
        return f"{scheme}://{rest}"
    authority, slash, path = rest.partition("/")
    try:
        authority = urlnorm.normalize_authority(scheme, authority, pattern)
        path = urlnorm.encode_path(urlnorm.decode_path(slash + path, pattern), keep=GLOB)
    except ConfigError:
        return pattern
    return f"{scheme}://{authority}{path}"


def refusal(model: str, patterns: Sequence[str]) -> str | None:
    """Why ``model`` may not be loaded under ``patterns``, or None when it may.

    >>> refusal("s3://models/llama", ["s3://models/*"]) is None
    True
    >>> refusal("http://origin/public/%2e%2e/private", ["http://origin/public/*"])
    "model 'http://origin/public/%2e%2e/private': '.' and '..' path segments (also escaped, as %2e) are not allowed"
    """
    malformed = _malformed(model)
    if malformed is not None:
        return f"model {model!r}: {malformed}"
    if not patterns:
        return (
            f"model {model!r} is not allowed: this replica was started without --allow-model and without MODEL, "
            "so it may load nothing"
        )
    wanted = normalize(model)
    for pattern in patterns:
        if fnmatch.fnmatchcase(wanted, _pattern(pattern)):
            return None
    return f"model {model!r} is not allowed on this replica (--allow-model: {', '.join(patterns)})"


def _malformed(model: str) -> str | None:  # noqa: PLR0911 - one return per reason, each its own message
    """What makes ``model`` unsafe to match at all, or None."""
    if not model or any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in model):
        return "empty, or with whitespace or control characters"
    if not model.lower().startswith(REMOTE_SCHEMES):
        return f"unknown scheme (use a directory, http(s)://, s3:// or {PEER_SCHEME})" if "://" in model else None
    parts = urlsplit(model)
    if "@" in parts.netloc:
        return "credentials in a model URI are not allowed (use the origin's token settings)"
    if parts.query or parts.fragment or model.endswith(("?", "#")):
        return "a query or fragment is not allowed in a model URI"
    scheme = parts.scheme.lower()
    if scheme == "s3" and "%" in parts.path:
        return "a '%' in an s3:// key is not allowed (S3 takes keys literally; some S3-compatible servers decode them)"
    try:
        path = urlnorm.decode_path(parts.path, model) if scheme in urlnorm.SCHEMES else parts.path
        if urlnorm.has_dot_segments(path):
            return "'.' and '..' path segments (also escaped, as %2e) are not allowed"
        normalize(model)
    except ConfigError as exc:
        return str(exc).removeprefix(f"{model}: ")
    return None
