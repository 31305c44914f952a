"""Which models a replica may be told to load: the ``--allow-model`` rule (docs/server.md, *Control endpoints*).

A standby replica loads what ``POST /v1/preheat/load`` names, so whoever can reach that route chooses what the
replica reads and runs. The rule, pure and checked before anything is fetched:

- a model is allowed when it matches one of the patterns (``fnmatch`` globs, case-sensitive; ``*`` also matches
  ``/``, so ``s3://models/*`` allows every key under that prefix);
- with no ``--allow-model``, the patterns are the one MODEL the operator gave on the command line, so the default
  allows nothing the operator did not name (a standby replica without MODEL must be given ``--allow-model``);
- local paths are compared resolved (absolute, symlinks followed, so ``/models/../etc`` is ``/etc``), on both sides;
- URIs whose path has ``.`` or ``..`` segments, user info (``user:pass@``) or control characters and whitespace
  are refused whatever the patterns say: they could name another object than the one the pattern shows.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Sequence
from urllib.parse import urlsplit

from preheat.server.settings import REMOTE_SCHEMES
from preheat.sources.peer_uri import SCHEME as PEER_SCHEME


def normalize(model: str) -> str:
    """``model`` as the rule compares it: a local path resolved, a URI as given."""
    if model.startswith(REMOTE_SCHEMES):
        return model
    return os.path.realpath(os.path.abspath(model))


def refusal(model: str, patterns: Sequence[str]) -> str | None:
    """Why ``model`` may not be loaded under ``patterns``, or None when it may.

    >>> refusal("s3://models/llama", ["s3://models/*"]) is None
    True
    >>> refusal("s3://models/../secret/x", ["s3://models/*"])
    "model 's3://models/../secret/x': '.' and '..' path segments are not allowed in a model URI"
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
        if fnmatch.fnmatchcase(wanted, pattern if pattern.startswith(REMOTE_SCHEMES) else normalize(pattern)):
            return None
    return f"model {model!r} is not allowed on this replica (--allow-model: {', '.join(patterns)})"


def _malformed(model: str) -> str | None:
    """What makes ``model`` unsafe to match at all, or None."""
    if not model or any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in model):
        return "empty, or with whitespace or control characters"
    if not model.startswith(REMOTE_SCHEMES):
        return f"unknown scheme (use a directory, http(s)://, s3:// or {PEER_SCHEME})" if "://" in model else None
    parts = urlsplit(model)
    if "@" in parts.netloc:
        return "credentials in a model URI are not allowed (use the origin's token settings)"
    if any(segment in (".", "..") for segment in parts.path.split("/")):
        return "'.' and '..' path segments are not allowed in a model URI"
    if parts.query or parts.fragment:
        return "a query or fragment is not allowed in a model URI"
    return None
