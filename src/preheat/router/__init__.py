"""``preheat router``: an OpenAI-compatible reverse proxy that sends each request to the replica most likely to
answer it fast (spec: docs/router.md).

Pure parts take values and return values and are tested without sockets: ``score`` (expected time to first token
per replica), ``index`` (the prefix index and the KV-event index), ``policies`` (which replica, and why).
The edges do the I/O: ``upstream`` (replicas, their connection pools), ``proxy`` (the HTTP server on the request
path), ``health`` (ejection and readmission), ``events`` (the KV-event poller), ``cluster`` (``preheat up``).
"""
