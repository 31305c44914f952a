"""``--replicas-from k8s://NAMESPACE/SERVICE``: the router's replicas follow a Service's EndpointSlices.

The Kubernetes list-then-watch protocol, with the official client: list the Service's slices (label
``kubernetes.io/service-name``), then watch from the list's ``resourceVersion`` with bookmarks on, so that a quiet
watch still moves its version forward. A watch the server ends (its ``timeoutSeconds``) is resumed from the last
version seen; a ``410 Gone`` (the version is older than the server keeps) means relist; anything else (the API server
restarting, a network fault, 403) is retried after a jittered backoff (``core.backoff``: a random wait under a ceiling
that doubles from ``MIN_BACKOFF`` up to ``MAX_BACKOFF``, so the routers of a fleet do not all return to a restarted
API server at once), reset once a list succeeds. Meanwhile the router keeps the replicas it had: an unreachable API
server changes nothing.

``on_change(urls)`` hears the whole set of ready replicas each time it changes (k8s/slices.py turns slices into
URLs under the router's ``SliceRules``: the controller's slices only, IP literals only, capped; this module is only
the I/O around it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from preheat.core.backoff import Backoff
from preheat.core.errors import GoneError
from preheat.core.jsonsafe import loads_bounded
from preheat.k8s.client import api_client, api_status, kubernetes_module
from preheat.k8s.slices import ServiceRef, SliceRules, SliceSet, resource_version

log = logging.getLogger("preheat.router")
WATCH_SECONDS = 240  # the server ends each watch after this long (jittered by it); we resume from the last version
CONNECT_SECONDS = 5.0
LIST_SECONDS = 30.0
# A slice lists at most 1,000 endpoints (~300 bytes each); a service's slices fill a few MiB at the very most.
MAX_LIST_BYTES = 64 * 1024 * 1024
MIN_BACKOFF = 0.5
MAX_BACKOFF = 30.0
GONE = 410


class EndpointSliceWatcher:
    """A daemon thread keeping ``on_change`` told of the Service's ready replicas; ``start()``, ``wait_synced()``
    (the first list is in), ``stop()``."""

    def __init__(
        self,
        ref: ServiceRef,
        on_change: Callable[[frozenset[str]], None],
        *,
        env: Mapping[str, str] | None = None,
        rules: SliceRules | None = None,
        watch_seconds: int = WATCH_SECONDS,
        min_backoff: float = MIN_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
    ) -> None:
        self.ref, self.on_change, self.env = ref, on_change, env
        self.watch_seconds, self.min_backoff, self.max_backoff = watch_seconds, min_backoff, max_backoff
        self.slices = SliceSet(ref.port, rules if rules is not None else SliceRules())
        self.synced = threading.Event()  # set once the first list was applied
        self.lists = 0  # lists done so far (the first, then one per 410 or reconnect): for /metrics and tests
        self.last_error: str | None = None
        self.version: str | None = None  # the last resourceVersion seen; None: list (again)
        self._stop = threading.Event()
        self._watch: Any = None  # Any: kubernetes.watch.Watch (imported lazily); stopped from another thread
        self._thread: threading.Thread | None = None
        self._told: set[str] = set()

    # -- life --------------------------------------------------------------------------------------------------------
    def start(self) -> None:
        kubernetes = kubernetes_module()  # fails now, at the router's start, when the extra is missing
        client = api_client(self.env)
        api = kubernetes.client.DiscoveryV1Api(client)
        log.warning("replicas from %s (%s)", self.ref, client.preheat_source)
        self._thread = threading.Thread(
            target=self._run, args=(kubernetes, api), name=f"preheat-router {self.ref}", daemon=True
        )
        self._thread.start()

    def wait_synced(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the first list; False when the API server did not answer in time."""
        return self.synced.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + CONNECT_SECONDS + 1
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            # Again until the thread ends: a watch whose request is still being sent has no socket to shut yet.
            watch = self._watch
            if watch is not None:
                watch.stop()  # shuts the stream's socket down: the blocked read returns at once
            self._thread.join(timeout=0.05)

    # -- the loop ----------------------------------------------------------------------------------------------------
    def _run(self, kubernetes: Any, api: Any) -> None:  # Any: the kubernetes package and its DiscoveryV1Api
        policy, failures = Backoff(self.min_backoff, self.max_backoff), 0
        while not self._stop.is_set():
            try:
                if self.version is None:
                    self.version = self._list(api)
                    failures = 0
                while not self._stop.is_set():
                    if self._watch_once(kubernetes, api):
                        failures = 0
            except GoneError:
                log.info("%s: watch expired (410 Gone), listing again", self.ref)
                self.version = None
                continue
            except Exception as exc:  # any failure of the client or the network: retry, keeping the replicas
                if self._stop.is_set():
                    return  # stop() cut the stream
                self._failed(exc)
            # As client-go's reflector does: a cut watch resumes from the last version seen (a 410 then relists).
            if self._stop.wait(policy.delay(failures)):
                return
            failures += 1

    def _list(self, api: Any) -> str:  # Any: DiscoveryV1Api
        # _preload_content=False: the JSON as the API server sent it (camelCase), which k8s_slices.py reads.
        response = api.list_namespaced_endpoint_slice(
            self.ref.namespace,
            label_selector=self.ref.label_selector,
            _preload_content=False,
            _request_timeout=(CONNECT_SECONDS, LIST_SECONDS),
        )
        try:
            body = loads_bounded(response.data, max_bytes=MAX_LIST_BYTES)
        finally:
            response.release_conn()
        items = body.get("items") if isinstance(body, dict) else None
        version = resource_version(body) if isinstance(body, dict) else None
        if not isinstance(items, list) or version is None:
            raise ValueError("the EndpointSlice list has no items or no metadata.resourceVersion")
        self.lists += 1
        changed = self.slices.reset(i for i in items if isinstance(i, dict))
        if changed or not self.synced.is_set():
            self._tell()
        self.synced.set()
        self.last_error = None
        return version

    def _watch_once(self, kubernetes: Any, api: Any) -> bool:  # Any: the kubernetes package, its API
        """One watch from ``self.version``, until the server ends it (``version`` follows each event); True when it
        carried at least one event or ran its course."""
        watch = kubernetes.watch.Watch()
        # Events as JSON, no models: only ``raw_object`` is read here, and a model's own checks fail on what the API
        # server sends (kubernetes 29's EndpointSlice refuses ``"endpoints": null``, a slice whose pods are all
        # gone): the watch would fail on that event, resume before it, and fail again, for as long as it is kept.
        watch.get_return_type = lambda func: None
        self._watch = watch
        started = time.monotonic()
        carried = False
        try:
            # timeout_seconds also turns off the client's own silent retry after a 410: the relist is ours.
            stream = watch.stream(
                api.list_namespaced_endpoint_slice,
                self.ref.namespace,
                label_selector=self.ref.label_selector,
                resource_version=self.version,
                allow_watch_bookmarks=True,
                timeout_seconds=self.watch_seconds,
                _request_timeout=(CONNECT_SECONDS, self.watch_seconds + 30),
            )
            for event in stream:
                self._event(event)
                carried = True
        except kubernetes.client.ApiException as exc:
            if api_status(exc) == GONE:
                raise GoneError from None
            raise
        finally:
            self._watch = None
        if not self._stop.is_set() and time.monotonic() - started < 1.0:
            # A server that ends watches at once would otherwise be asked again in a tight loop.
            self._stop.wait(self.min_backoff)
        self.last_error = None
        return carried or time.monotonic() - started >= 1.0

    def _event(self, event: Mapping[str, object]) -> None:  # the watch's event dict: checked here
        kind, obj = event.get("type"), event.get("raw_object")
        if not isinstance(kind, str) or not isinstance(obj, dict):
            return
        if kind not in ("BOOKMARK", "ERROR") and self.slices.apply(kind, obj):
            self._tell()
        self.version = resource_version(obj) or self.version

    def _tell(self) -> None:
        for name, problem in self.slices.problems.items():
            if name not in self._told:
                log.warning("%s: %s", self.ref, problem)
        self._told = set(self.slices.problems)
        self.on_change(self.slices.urls())

    def _failed(self, exc: Exception) -> None:
        status = api_status(exc)
        if status in (401, 403):
            why = f"the API server refused ({status}): the router's service account needs list and watch on " \
                  f"endpointslices.discovery.k8s.io in namespace {self.ref.namespace}"  # fmt: skip
        else:
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if why != self.last_error:  # said once per kind of failure, not on every retry
            log.warning("%s: %s; keeping the replicas known so far, retrying", self.ref, why)
        self.last_error = why
