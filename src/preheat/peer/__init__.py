"""Weights and compiled artifacts from warm peers (spec: docs/peer.md).

A replica that holds a checkpoint serves its files' byte ranges to new replicas (``server``), announces itself in a
registry (``registry``: Redis or a shared directory), and a new replica pulls disjoint pieces from several peers at
once, verifying each tensor as it lands and moving a dead, stalled or lying peer's pieces to the others or to the
origin (``pull``, through the store's one fetcher, ``preheat.store.fetch``). ``artifacts`` packs torch.compile caches
under a key of everything that makes them valid, so a newcomer skips recompilation; being code, they are installed
only when built on the node or signed by a key the operator trusts (``signing``, ``artifact_store``). ``plan`` is
the pure part: URIs, piece plans, tensor coverage.

Nothing here is imported by ``import preheat``; the server imports it only with ``--peer``/``--registry``/``--compile``
or a ``preheat://`` model.
"""
