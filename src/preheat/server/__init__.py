"""The reference OpenAI-compatible server behind ``preheat serve``, with a cold-start timeline.

This package is imported on the cold-start path before the socket is bound, so nothing here imports torch, the
engine or any third-party web framework at module level: the HTTP layer is ``preheat.http``'s server base over the
standard library's ``ThreadingHTTPServer``, server-sent events are framed in ``sse.py``, and ``/metrics`` is written by
prometheus-client, imported on the first scrape (docs/server.md).

``run`` takes the flags by ``ServeSettings`` field name (``None``: not given) and serves until SIGINT/SIGTERM:

>>> from preheat.server.app import run                  # doctest: +SKIP
>>> run({"model": "./smollm2", "port": 8000})           # doctest: +SKIP
0
"""
