"""The reference OpenAI-compatible server behind ``preheat serve``, with a cold-start timeline.

This package is imported on the cold-start path before the socket is bound, so nothing here imports torch, the
engine or any third-party web framework at module level: the HTTP layer is ``preheat.http``'s server base over the
standard library's ``ThreadingHTTPServer``, server-sent events are framed in ``sse.py``, and ``/metrics`` is written by
prometheus-client, imported on the first scrape (docs/server.md).

    from preheat.server.app import serve
    from preheat.server.settings import ServeSettings
    serve(ServeSettings.resolve(model="./smollm2"))
"""
