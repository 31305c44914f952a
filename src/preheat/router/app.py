"""``preheat router``: wiring, and the process's life (bind, check replicas, serve until SIGINT/SIGTERM), from
``RouterSettings`` (router/settings.py: every flag, and its ``PREHEAT_ROUTER_*`` variable).
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from preheat.core.config import parse_size
from preheat.core.errors import RouterError
from preheat.core.procs import listening_line
from preheat.dashboard.login import Login
from preheat.dashboard.watch import Findings
from preheat.http.metrics import Counter
from preheat.http.server import sigterm_interrupts
from preheat.http.tls import use_fleet
from preheat.k8s.slices import parse_k8s_url
from preheat.router.activation import ColdSettings, ColdStarter
from preheat.router.aioproxy import AsyncRouterServer
from preheat.router.events import KVEventPoller
from preheat.router.health import HealthChecker
from preheat.router.index import KVIndex
from preheat.router.policies import LoadGuard, Policy, make_policy, text_fingerprint
from preheat.router.prompts import PromptReader, tokenizer_from_replicas
from preheat.router.proxy import Router
from preheat.router.scrape import MetricsPoller
from preheat.router.settings import FROM_REPLICAS, RouterSettings
from preheat.router.shared import SharedPolicy
from preheat.router.sleeping import Sleeper, SleepSettings
from preheat.router.upstream import Replica, parse_replica_spec
from preheat.router.workers import WorkerMain, WorkerSlot, supervise

if TYPE_CHECKING:
    from preheat.router.shared_redis import SharedState

log = logging.getLogger("preheat.router")
DISCOVERY_WAIT = 10.0  # seconds the router's start waits for the first EndpointSlice list


def prefix_fingerprint(model: str, chunk_tokens: int) -> str:
    """The seed of the prefix index's keys: only routers compare them, so any value works that every router of a
    fleet (--shared-state) derives alike: the tokenizer's files (they decide the token ids), wherever they lie (a
    directory of another name on another host, or fetched from the replicas), else the model's path."""
    import xxhash

    from preheat.kv.keys import fingerprint

    digest = xxhash.xxh3_128()
    found = False
    for name in ("tokenizer.json", "tokenizer_config.json"):
        path = os.path.join(model, name)
        if os.path.isfile(path):
            with open(path, "rb") as file:
                digest.update(name.encode() + b"\0" + file.read())
            found = True
    identity = f"tokenizer:{digest.hexdigest()}" if found else os.path.realpath(model)
    return fingerprint(identity=identity, layout={"index": "preheat-router"}, chunk_tokens=chunk_tokens)


def routing_fingerprint(settings: RouterSettings) -> str | None:
    """The seed of the keys this router learns from the prompts it routes: ``prefix``'s text keys, ``kv``'s token
    keys (``prefix_fingerprint`` of --model); None for policies that learn none."""
    if settings.policy == "prefix":
        return text_fingerprint(settings.kv_chunk_tokens)
    return prefix_fingerprint(settings.model, settings.kv_chunk_tokens) if settings.model else None


class RouterService:
    """A router with its background checks: ``start()`` binds and checks, ``serve()`` blocks, ``close()`` ends all."""

    def __init__(
        self, settings: RouterSettings, findings: Findings | None = None, worker: WorkerSlot | None = None
    ) -> None:
        """``findings``: the doctor's findings for the dashboard (``preheat.dashboard.refresh.Refreshing``; the
        command line gives it, since the router cannot import the doctor). ``worker``: this router is one of
        ``--workers N`` (router/workers.py): it binds the reserved port beside the others and signs its logins."""
        self.settings = settings
        specs = [parse_replica_spec(spec) for spec in settings.replicas]
        replicas = [Replica(spec.url, timeout=settings.upstream_timeout) for spec in specs]
        sources = [(r, spec.events) for r, spec in zip(replicas, specs, strict=True) if spec.events is not None]
        replicas += [Replica(url, timeout=settings.upstream_timeout, standby=True) for url in settings.standby]
        if sources and settings.policy != "kv":
            log.warning("--policy %s does not use KV events: the replicas' events= are ignored", settings.policy)
            sources = []
        self.kv_index = KVIndex(max_keys=settings.index_keys, snapshot_interval=settings.kv_snapshot_interval)
        guard = LoadGuard(gap=settings.guard_gap, hot=settings.hot_in_flight)
        needs_model = settings.policy == "kv"  # prefix reads prompts as text
        if needs_model and settings.model == FROM_REPLICAS:
            # The replicas' own tokenizer: a preheat replica serves its files, vLLM names its local directory.
            key = settings.replica_api_key or settings.api_key
            model = tokenizer_from_replicas(settings.replicas, {"Authorization": f"Bearer {key}"} if key else {})
            log.warning("tokenizer: from the replicas (%s)", model)
            settings = replace(settings, model=model)
            self.settings = settings
        policy = make_policy(
            settings.policy,
            fingerprint=routing_fingerprint(settings),
            chunk_tokens=settings.kv_chunk_tokens,
            kv_index=self.kv_index,
            guard=guard,
            index_keys=settings.index_keys,
            index_ttl=settings.index_ttl,
            engines=[r.url for r, _ in sources],
            hold=settings.hold,
        )
        self.shared: SharedState | None = None
        if settings.shared_state is not None:
            # Late-bound: the shared state is made once the router it reads exists, below.
            policy = SharedPolicy(policy, self._remote_in_flight, self._learnt)
        prompts = PromptReader.from_model(
            settings.model if needs_model else None, settings.max_prompt_tokens, text=policy.needs_text
        )
        self.router = Router(
            replicas, policy, prompts, api_key=settings.api_key, replica_api_key=settings.replica_api_key,
            newest_version=settings.newest_version, max_answer_bytes=parse_size(settings.max_answer_bytes),
            max_event_bytes=parse_size(settings.max_event_bytes), steal=settings.steal,
        )  # fmt: skip
        cold = ColdSettings(
            model=settings.activation_model if settings.standby else None,
            served_model_name=settings.served_model_name,
            admin_key=settings.replica_admin_key,
            api_key=settings.replica_api_key or settings.api_key,
            timeout=settings.activation_timeout,
            wake=settings.wake,
            saturation=settings.saturation,
        )
        self.router.cold = ColdStarter(replicas, self._admit, self.router.metrics, cold)
        self.router.findings = findings
        self.health = HealthChecker(
            replicas,
            self.router.set_health,
            interval=settings.health_interval,
            timeout=settings.health_timeout,
            on_phase=self.router.cold.observed,
        )
        if settings.shared_state is not None:
            self.shared = self._share(settings, policy)
        engines = {r.url for r, _ in sources}
        polled = [r for r in replicas if r.url not in engines]  # preheat replicas: GET /v1/kv/events
        self.poller = (
            KVEventPoller(
                polled,
                self.kv_index,
                interval=settings.kv_poll_interval,
                api_key=settings.replica_api_key or settings.api_key,
            )
            if settings.policy == "kv" and (polled or settings.replicas_from)
            else None
        )
        # Engine replicas report no queue with their events: their own /metrics does (scrape.py).
        self.scraper = (
            MetricsPoller([r for r, _ in sources], interval=settings.kv_poll_interval, timeout=settings.health_timeout)
            if sources
            else None
        )
        self.sleeper = None
        if settings.sleep_idle is not None:
            admin_headers = (("Authorization", f"Bearer {settings.replica_admin_key}"),) \
                if settings.replica_admin_key else ()  # fmt: skip
            self.sleeper = Sleeper(
                lambda: self.router.replicas,
                self._take_out,
                self._admit,
                self.router.metrics.sleeps,
                SleepSettings(
                    settings.sleep_idle,
                    settings.sleep_level,
                    settings.sleep_keep,
                    settings.health_interval,
                    admin_headers,
                ),
            )
        self.subscriber = None
        if sources:
            # Imported here: pyzmq and msgspec are the `engines` extra, needed only with engine replicas.
            from preheat.router.zmq_events import EngineEventSubscriber, engine_events_counter

            counter = engine_events_counter()
            self.router.metrics.add(counter)
            assert settings.model is not None  # resolved above: kv needs a tokenizer
            self.subscriber = EngineEventSubscriber(
                sources,
                self.kv_index,
                counter,
                identity=os.path.realpath(settings.model),
                max_keys=settings.index_keys,
            )
        self.discovery = None
        self.membership = Counter(
            "preheat_router_membership_changes_total",
            "Replicas that joined or left the fleet (--replicas-from), by change (joined, left).",
        )
        if settings.replicas_from is not None:
            from preheat.k8s.discovery import EndpointSliceWatcher
            from preheat.k8s.slices import SliceRules

            rules = SliceRules.of(
                settings.pod_cidr,
                max_slice_endpoints=settings.max_slice_endpoints,
                max_replicas=settings.max_discovered_replicas,
            )
            self.discovery = EndpointSliceWatcher(parse_k8s_url(settings.replicas_from), self._discovered, rules=rules)
            self.router.metrics.add(self.membership)
        try:
            port = settings.port if worker is None else worker.port
            self.httpd = AsyncRouterServer((settings.host, port), self.router, reuse_port=worker is not None)
            self.httpd.max_connections, self.httpd.header_timeout = settings.max_connections, settings.header_timeout
            self.httpd.tls = settings.tls.listener()
            signing = worker.session_key if worker is not None else None
            self.httpd.login = Login.lasting(settings.dashboard_session_ttl, signing)
        except OSError as exc:
            raise RouterError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None

    def _share(self, settings: RouterSettings, policy: Policy) -> SharedState:
        """--shared-state: this router's side of the fleet's view (router/shared_redis.py), its series on /metrics."""
        from preheat.router.shared_redis import SharedState

        def decisions() -> dict[str, float]:
            samples = self.router.metrics.decisions.family().samples
            return {labels["reason"]: n for labels, n in samples if labels.get("policy") == policy.name}

        assert settings.shared_state is not None
        shared = SharedState(
            settings.shared_state, settings.shared_fleet,
            policy=policy if isinstance(policy, SharedPolicy) else None,
            replicas=lambda: self.router.replicas, decisions=decisions, hint_down=self.health.check_now,
            fingerprint=routing_fingerprint(settings),
            learn_ttl=settings.index_ttl,
        )  # fmt: skip
        for series in shared.metrics.series():
            self.router.metrics.add(series)
        self.router.dashboard.shared = shared.state
        return shared

    def _remote_in_flight(self) -> Mapping[str, int]:
        return self.shared.view.remote_in_flight() if self.shared is not None else {}

    def _learnt(self, replica: str, keys: list[str]) -> None:
        if self.shared is not None:
            self.shared.learnt(replica, keys)

    def _admit(self, replica: Replica, why: str) -> None:
        self.router.set_health(replica, True, why)

    def _take_out(self, replica: Replica, why: str) -> None:
        """Out of rotation on the router's own decision (an idle replica going to sleep): not an ejection."""
        if replica.set_healthy(False):
            replica.close_idle()
            self.router.policy.forget(replica.url)  # a sleep drops its KV cache
            log.warning("replica %s out of rotation: %s", replica.url, why)

    def _discovered(self, urls: frozenset[str]) -> None:
        """The Service's ready replicas changed (the discovery thread): the ones that left go first (their keys
        dropped from the KV index), then the new ones join, each health-checked at once."""
        static = {parse_replica_spec(spec).url for spec in self.settings.replicas} | set(self.settings.standby)
        have = {r.url for r in self.router.replicas if r.url not in static}
        for url in sorted(have - urls):
            gone = self.router.remove_replica(url)
            if gone is None:
                continue
            self.health.remove(gone)
            if self.poller is not None:
                self.poller.remove(gone)
            self.kv_index.forget(url)
            self.membership.inc(change="left")
        for url in sorted(urls - have - static):
            replica = Replica(url, timeout=self.settings.upstream_timeout)
            if self.router.add_replica(replica):
                self.health.add(replica)
                if self.poller is not None:
                    self.poller.add(replica)
                self.membership.inc(change="joined")

    @property
    def url(self) -> str:
        host, port = self.httpd.socket.getsockname()[:2]
        return f"{'https' if self.httpd.tls is not None else 'http'}://{host}:{port}"

    def start(self) -> None:
        """Learn who is up (and, for ``kv``, what their caches hold) before the first request, then keep checking."""
        self.health.tick_all()
        self.health.start()
        if self.poller is not None:
            self.poller.tick_all()
            self.poller.start()
        if self.subscriber is not None:
            self.subscriber.start()
        if self.scraper is not None:
            self.scraper.tick_all()
            self.scraper.start()
        if self.sleeper is not None:
            self.sleeper.start()
        if self.shared is not None:
            self.shared.start()
        if self.discovery is not None:
            self.discovery.start()
            # The first list, so that the router starts with its replicas; an API server that does not answer
            # in time delays nothing more: the replicas join when it does.
            if not self.discovery.wait_synced(DISCOVERY_WAIT):
                log.warning("%s: no answer from the API server yet; replicas join as it answers", self.discovery.ref)
            else:
                self.health.tick_all()  # the discovered replicas' first checks, so that /health counts them

    def serve(self) -> None:
        self.httpd.serve_forever(poll_interval=0.25)

    def close(self) -> None:
        if self.discovery is not None:
            self.discovery.stop()
        self.health.stop()
        if self.sleeper is not None:
            self.sleeper.stop()
        if self.scraper is not None:
            self.scraper.stop()
        if self.poller is not None:
            self.poller.stop()
        if self.subscriber is not None:
            self.subscriber.stop()
        if self.shared is not None:
            self.shared.stop()
        self.httpd.server_close()
        for replica in self.router.replicas:
            replica.close_idle()


def run(
    flags: Mapping[str, object],
    announce: Callable[[str], None] | None = None,
    findings: Findings | None = None,
    *,
    worker: WorkerSlot | None = None,
    worker_main: WorkerMain | None = None,
) -> int:
    """Run the router with ``flags`` until SIGINT/SIGTERM; returns the exit code. ``findings``: see RouterService.
    With ``--workers N`` (N > 1), this process supervises N workers (router/workers.py), each started as
    ``worker_main(flags, slot)``, which runs this again with ``worker=slot``."""
    say = announce or (lambda line: print(line, flush=True))
    settings = RouterSettings.resolve(flags)
    if settings.workers > 1 and worker is None:
        if worker_main is None:
            raise RouterError("--workers N needs a worker entry point (the command line gives one)")
        if settings.shared_state is None and settings.policy in ("least-load", "prefix", "kv"):
            log.warning(
                "--workers %d without --shared-state: each worker routes by its own view (its requests in flight, "
                "its learnt prefixes); give --shared-state redis://... for one view",
                settings.workers,
            )

        def describe(port: int, healthy: int, total: int) -> list[str]:
            bound = settings.host or "0.0.0.0"  # noqa: S104 - the address "" binds, as the one-process URL names it
            host = f"[{bound}]" if ":" in bound else bound
            url = f"{'https' if settings.ssl_certfile else 'http'}://{host}:{port}"
            return _serving_lines(settings, url, healthy, total, f", {settings.workers} workers")

        return supervise(
            flags, host=settings.host, port=settings.port, count=settings.workers, main=worker_main, say=say,
            describe=describe,
        )  # fmt: skip
    use_fleet(settings.tls)  # https replicas verified with its CA (--ssl-ca-certs) beside the system's
    service = RouterService(settings, findings, worker)
    try:
        with sigterm_interrupts():
            service.start()
            up = sum(r.healthy for r in service.router.replicas)
            total = len(service.router.replicas) - len(settings.standby)
            if worker is not None:
                worker.serving(up, total)  # the parent prints the lines once, for all workers
            else:
                for line in _serving_lines(settings, service.url, up, total, ""):
                    say(line)
            quiet_collector()
            service.serve()
    except KeyboardInterrupt:
        if worker is None:
            say("preheat router: shutting down")
    finally:
        service.close()
    return 0


def quiet_collector() -> None:
    """For a router process about to serve: what its start built (imports, the tokenizer, the indexes) is frozen out
    of the cyclic collector's scans, and young collections come every 20,000 allocations, not 700. A request
    allocates dozens of objects and leaves almost no cycles, and the collections were ~7% of a busy router's time
    (py-spy; ~13% more requests/s on one process in bench/router_capacity.py). The process's own: never called
    where the router is a library (a test, an embedding program)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def _serving_lines(settings: RouterSettings, url: str, healthy: int, total: int, workers: str) -> list[str]:
    standby = f", {len(settings.standby)} standby" if settings.standby else ""
    detail = f"policy {settings.policy}{workers}, {healthy}/{total} replicas healthy{standby}"
    return [
        listening_line("preheat router", url, detail),
        f"preheat router: dashboard at {url}/dashboard (docs/dashboard.md)",
    ]
