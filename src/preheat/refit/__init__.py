"""Live weight updates: a trainer publishes versions from memory, serving replicas pull what changed and swap it in
between two requests (docs/refit.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # both import torch: only when used
    from preheat.refit.follower import Follower
    from preheat.refit.publisher import Publisher

__all__ = ["Follower", "Publisher"]


def __getattr__(name: str) -> object:
    if name == "Publisher":
        from preheat.refit.publisher import Publisher

        return Publisher
    if name == "Follower":
        from preheat.refit.follower import Follower

        return Follower
    raise AttributeError(f"module 'preheat.refit' has no attribute {name!r}")
