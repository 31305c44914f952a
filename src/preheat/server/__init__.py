"""The reference OpenAI-compatible server behind ``preheat serve``, with a cold-start timeline.

This package is imported on the cold-start path before the socket is bound, so nothing here imports torch, the
engine or any third-party web framework at module level: the HTTP layer is the standard library's
``ThreadingHTTPServer`` with hand-written server-sent events and Prometheus text (docs/server.md).

    from preheat.server.app import serve
    from preheat.server.settings import ServeSettings
    serve(ServeSettings.resolve(model="./smollm2"))
"""
