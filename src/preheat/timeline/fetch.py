"""Getting a recorded cold start: the timeline JSON from a server's ``/v1/preheat/timeline``, from a file, or merged
from a directory of process records (a vLLM start: ``PREHEAT_VLLM_STARTUP``, ``merge``).

The I/O beside ``waterfall`` and ``merge`` (pure): a URL is asked through ``preheat.http`` (with the API key, from the
argument or ``PREHEAT_API_KEY``), a file is read through ``core.jsonsafe``; either is bounded, since the URL may be any
server. A directory's records are merged (the latest run); a single process record is merged with the records beside
it, for the run it belongs to.

    waterfall = Waterfall.from_dict(fetch("http://replica:8000"), where="http://replica:8000")
"""

from __future__ import annotations

import os
from http.client import responses

from preheat.core import env
from preheat.core.errors import HTTPClientError, JSONInputError, PlanError, SourceError
from preheat.core.jsonsafe import loads_bounded, read_bounded
from preheat.http.control import TIMELINE_ROUTE
from preheat.timeline.merge import ProcessRecord, is_record, merge, parse_record

MAX_TIMELINE_BYTES = 16 * 1024 * 1024  # a timeline is a few kB; a larger answer is not one
MAX_RECORD_BYTES = 1024 * 1024  # a process record is a few kB
MAX_RECORDS = 4096  # a directory shared by many starts: the newest records are read


def fetch(source: str, *, api_key: str | None = None, timeout: float = 10.0) -> object:
    """The timeline JSON from a server URL (its ``/v1/preheat/timeline``) or from a file: ``SourceError`` when it
    cannot be had, ``PlanError`` when a file holds no JSON."""
    if source.startswith(("http://", "https://")):
        return _from_server(source, api_key=api_key, timeout=timeout)
    if os.path.isdir(source):
        return merge(records_in(source))
    try:
        data = read_bounded(source, max_bytes=MAX_TIMELINE_BYTES)
    except OSError as exc:
        raise SourceError(f"{source}: cannot read ({exc.strerror})") from None
    except JSONInputError as exc:
        raise PlanError(f"{source}: cannot read the timeline ({exc})") from None
    if is_record(data):  # one process's record: merged with its run, from the records beside it
        record = parse_record(data, where=source)
        return merge(records_in(os.path.dirname(os.path.abspath(source))), member=record["pid"])
    return data


def records_in(directory: str) -> list[ProcessRecord]:
    """The process records (``*.json`` of ``merge.RECORD_KIND``) in ``directory``, newest ``MAX_RECORDS``; files of
    another kind are skipped, a malformed record is a ``PlanError`` naming it, and ``PlanError`` when there is none."""
    try:
        with os.scandir(directory) as entries:
            files = [(e.stat().st_mtime, e.path) for e in entries if e.name.endswith(".json") and e.is_file()]
    except OSError as exc:
        raise SourceError(f"{directory}: cannot list ({exc.strerror})") from None
    records = []
    for _, path in sorted(files, reverse=True)[:MAX_RECORDS]:
        try:
            data = read_bounded(path, max_bytes=MAX_RECORD_BYTES)
        except FileNotFoundError:  # removed since the listing (a pruned old record)
            continue
        except OSError as exc:
            raise SourceError(f"{path}: cannot read ({exc.strerror})") from None
        except JSONInputError as exc:
            raise PlanError(f"{path}: cannot read the process record ({exc})") from None
        if is_record(data):
            records.append(parse_record(data, where=path))
    if not records:
        raise PlanError(f"{directory}: no process records (vLLM writes them with preheat installed beside it)")
    return records


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
