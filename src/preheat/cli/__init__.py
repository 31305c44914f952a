"""The ``preheat`` command: ``main`` dispatches to one module per command (``store``, ``serve``, ``router``, ``plan``,
``artifacts``, ``kv``, ``doctor``, ``refit``, ``deploy``, ``demo``); ``common`` is what they share."""

from preheat.cli.main import main

__all__ = ["main"]
