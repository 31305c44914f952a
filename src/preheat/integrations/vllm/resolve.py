"""Where vLLM's weights come from: MODEL's own directory, or a remote source made a node-cache entry first.

A remote source (``http(s)://``, ``s3://``, ``preheat://NAME``) goes through the same pull as ``preheat pull`` and
``preheat serve``: the node cache (a hit moves nothing), striped peer pulls for ``preheat://`` names, the origin as
fallback, every file verified before the entry is published. vLLM itself reads config.json and the tokenizer from
MODEL before any loader runs, so MODEL stays a local directory (docs/integrations.md says why and how).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from preheat.checkpoint.jsonfile import read_config
from preheat.core.errors import CheckpointError, ConfigError
from preheat.core.timeline import Timeline
from preheat.integrations.vllm.options import LOAD_FORMAT, LoadOptions
from preheat.sources.base import is_uri
from preheat.sources.peer_uri import is_peer_uri

if TYPE_CHECKING:
    from preheat.store.cache import Lease

@dataclass
class Resolved:
    """The local directory holding the weights; ``lease`` keeps a node-cache entry from gc while it is read."""

    path: str
    source: str
    lease: Lease | None = None

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()
            self.lease = None


def is_remote(location: str) -> bool:
    """True for the locations that are pulled into the node cache first."""
    return is_uri(location) or is_peer_uri(location)


def weights_location(model: str, options: LoadOptions, model_weights: str = "") -> str:
    """The weights' location: the ``source`` option, else vLLM's ``model_weights`` (set when vLLM fetched the
    config of an ``s3://`` MODEL itself), else MODEL."""
    return options.source or model_weights or model


def resolve(model: str, options: LoadOptions, timeline: Timeline, *, model_weights: str = "") -> Resolved:
    """A local directory with the weights (pulling a remote source into the node cache, on ``timeline`` as
    ``fetch``). Raises ``ConfigError`` for a location that is neither a directory nor a remote source, and for a
    MODEL whose config.json is not the source's."""
    location = weights_location(model, options, model_weights)
    if not is_remote(location):
        if not os.path.isdir(location):
            raise ConfigError(
                f"{location}: not a checkpoint directory; --load-format {LOAD_FORMAT} loads a local directory, or "
                'the weights named by --model-loader-extra-config \'{"source": "http(s)://, s3:// or preheat://..."}\''
            )
        return Resolved(os.path.abspath(location), location)
    resolved = _pull(location, options, timeline)
    try:
        if os.path.isdir(model) and os.path.abspath(model) != resolved.path:
            check_same_config(model, resolved.path, location)
    except BaseException:
        resolved.close()
        raise
    return resolved


def _pull(uri: str, options: LoadOptions, timeline: Timeline) -> Resolved:
    from preheat.store.cache import ModelCache

    cache = ModelCache(options.cache_dir)
    with timeline.stage("fetch", uri=uri) as stage:
        try:
            if is_peer_uri(uri):
                from preheat.peer.pull import PeerOptions, pull_from_peers

                peer_options = PeerOptions.from_env(registry=options.registry, origin=options.origin)
                result = pull_from_peers(uri, cache, peer_options)
            else:
                from preheat.store.pull import pull

                result = pull(uri, cache)
        except Exception as exc:
            stage.detail["error"] = str(exc)
            raise
        stage.nbytes = result.bytes_fetched
        stage.detail.update(
            cache="hit" if result.hit else "miss", key=result.key, path=result.path, total_bytes=result.bytes_total
        )
        if result.sources:
            stage.detail.update(sources=result.sources, notes=result.notes)
    return Resolved(result.path, uri, cache.lease(result.key))


def check_same_config(model: str, weights: str, source: str) -> None:
    """MODEL's config.json must be the weights' own when they ship one: vLLM builds the model from MODEL's."""
    mine, theirs = os.path.join(model, "config.json"), os.path.join(weights, "config.json")
    if not (os.path.isfile(mine) and os.path.isfile(theirs)):
        return
    try:  # read bounded: the weights' config.json came from wherever they were downloaded
        same = read_config(model) == read_config(weights)
    except CheckpointError as exc:
        raise CheckpointError(f"cannot compare {mine} with {theirs}: {exc}", path=exc.path or mine) from None
    if not same:
        raise ConfigError(
            f"{mine} differs from the config.json of {source} ({theirs}): vLLM would build another model than the "
            f"weights'; point MODEL at a directory with {source}'s config.json and tokenizer (e.g. the path "
            f"`preheat cache warm {source}` prints)"
        )
