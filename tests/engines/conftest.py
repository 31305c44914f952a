"""Fixtures of the tests against the real engines: the root tests/conftest.py's (``store_url``, once ``fs://`` and
once Redis; ``redis_server``; ``own_redis``) serve them, shared with the blob store's own tests."""
