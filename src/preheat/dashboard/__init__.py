"""The live fleet dashboard: ``GET /dashboard`` on the router (every replica) and on ``preheat serve`` (itself).

Static assets (``assets/``: one page, one script, one stylesheet) ship in the package: no CDN, no build step, so the
page works on an air-gapped cluster. The page polls ``/dashboard/api/state``, whose JSON (``state.py``) is built
from what the router or the replica already knows (``watch.py`` scrapes the replicas; ``web.py`` answers the routes
and checks the API key; ``login.py`` holds the sessions and throttles wrong keys; ``refresh.py`` keeps the doctor's
findings fresh). docs/dashboard.md has the format and the
login.

It sits low in the layers (beside ``http``) so that both the router and the server can serve it; what it needs from
above (the router's replicas, the doctor's findings) is passed in as values or callables. Nothing is imported here:
``preheat serve`` imports ``refresh`` on its cold-start path, and the rest only when a page is asked for.

>>> from preheat.dashboard.state import SCHEMA
>>> SCHEMA
'preheat.dashboard/1'
"""
