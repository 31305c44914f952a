"""Getting a recorded cold start: the timeline JSON from a server's ``/v1/preheat/timeline`` or from a file.

The I/O beside ``waterfall`` (pure): a URL is asked through ``preheat.http`` (with the API key, from the argument or
``PREHEAT_API_KEY``), a file is read through ``core.jsonsafe``; either is bounded, since the URL may be any server.

    waterfall = Waterfall.from_dict(fetch("http://replica:8000"), where="http://replica:8000")
"""

from __future__ import annotations

from http.client import responses

from preheat.core import env
from preheat.core.errors import HTTPClientError, JSONInputError, PlanError, SourceError
from preheat.core.jsonsafe import loads_bounded, read_bounded
from preheat.http.control import TIMELINE_ROUTE

MAX_TIMELINE_BYTES = 16 * 1024 * 1024  # a timeline is a few kB; a larger answer is not one


def fetch(source: str, *, api_key: str | None = None, timeout: float = 10.0) -> object:
    """The timeline JSON from a server URL (its ``/v1/preheat/timeline``) or from a file: ``SourceError`` when it
    cannot be had, ``PlanError`` when a file holds no JSON."""
    if source.startswith(("http://", "https://")):
        return _from_server(source, api_key=api_key, timeout=timeout)
    try:
        return read_bounded(source, max_bytes=MAX_TIMELINE_BYTES)
    except OSError as exc:
        raise SourceError(f"{source}: cannot read ({exc.strerror})") from None
    except JSONInputError as exc:
        raise PlanError(f"{source}: cannot read the timeline ({exc})") from None


def _from_server(source: str, *, api_key: str | None, timeout: float) -> object:
    # Imported here: the HTTP client brings ssl (~0.1 s), which reading a file does not need.
    from preheat.http.client import Timeouts, request

    url = source if source.rstrip("/").endswith(TIMELINE_ROUTE) else source.rstrip("/") + TIMELINE_ROUTE
    key = api_key or env.get(env.API_KEY)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        answer = request(url, timeouts=Timeouts.within(timeout), headers=headers, max_body=MAX_TIMELINE_BYTES)
    except HTTPClientError as exc:
        raise SourceError(f"cannot fetch the timeline: {exc}") from None
    if answer.status != 200:
        hint = " (pass --api-key or PREHEAT_API_KEY)" if answer.status == 401 else ""
        raise SourceError(f"{url}: HTTP {answer.status} {responses.get(answer.status, '')}{hint}")
    try:  # bounded: the URL may be any server, and json.loads raised RecursionError on 64 KiB of "["
        return loads_bounded(answer.body, max_bytes=MAX_TIMELINE_BYTES)
    except JSONInputError as exc:
        raise SourceError(f"{url}: cannot fetch the timeline ({exc})") from None
