"""``preheat router`` and ``preheat up``: a cache-aware router in front of replicas, and a local cluster of both.

Only argparse at import time: the router, its tokenizer and the cluster code are imported when a command runs.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when a command runs: `preheat --help` stays fast
    from collections.abc import Mapping

    from preheat.cli.common import Commands
    from preheat.dashboard.refresh import Refreshing
    from preheat.doctor.findings import DoctorDocument
    from preheat.router.workers import WorkerSlot

ROUTER_HELP = """\
An OpenAI-compatible reverse proxy in front of `preheat serve`, vLLM or SGLang replicas: clients change only the URL.
Request and response bodies pass through unchanged; streams are relayed chunk by chunk.

policies:
  round-robin  each replica in turn
  least-load   the fewest requests in flight through this router
  session      sticky by session id: the X-Session-Id header, else the body's "user" field
  prefix       the replica this router already sent the longest run of the prompt's leading text to (no tokenizer)
  kv           the lowest expected time to first token, from the replicas' own KV events: tokens to recompute x
               prefill cost + tokens in L1/L2 x that tier's cost + queue wait (replicas with --kv-l1)
               vLLM and SGLang replicas: give their ZMQ KV events with --kv-events (docs/integrations.md)
  kv reads prompts with --model DIR's tokenizer (--model @replicas: the replicas', asked at start).
  prefix and kv fall back to the least-loaded replica when queues are imbalanced (--guard-gap), and spread a prefix
  hot enough to queue on one replica to a second one (--hot-in-flight).

Dead replicas are ejected (health checks, failed requests) and readmitted when /health answers 200 again; a request
that fails before the replica answered anything is retried once on another replica. A replica that says it is not
serving (a 503 "sleeping", "standby", "draining"... from /health or to a request) is ejected at once, and the request
it refused goes to another replica.

cold capacity (standby and sleeping replicas):
  --standby URL gives a `preheat serve --standby` replica the router may activate (POST /v1/preheat/load
  --standby-model MODEL, which its --allow-model must allow); a sleeping replica (POST /v1/preheat/sleep) may be
  woken (POST /v1/preheat/wake; --no-wake: never). The router brings one up, the cheapest first (a wake's measured
  cost, activations measured here), when
    - no replica is in rotation: the request waits for it (up to --activation-timeout), or gets a 503 that says
      why each cold start failed (model not allowed there, bad checksum, ...) after the next one was tried;
    - every replica in rotation is saturated: --saturation requests or more in flight through this router each
      (default 3); meanwhile the request goes to the replica the policy picks.
  A replica enters rotation only when its own /health answers 200. Metrics: preheat_router_activations_total,
  preheat_router_wakes_total, preheat_router_activation_seconds, preheat_router_wake_seconds.

routes: everything the replicas serve but their control routes (load, sleep, wake, refit: 404 here), plus the
router's own GET /health and GET /metrics.
authentication: with --api-key, every route but /health and /metrics needs 'Authorization: Bearer KEY', checked
before the prompt is read; bound beyond loopback, the router refuses to start without one. --replica-api-key is
what the router sends the replicas instead of the client's key (without it the client's passes through);
--replica-admin-key is what it sends only on its own activations and wakes. Prefer the variables to the flags: a
command line is visible to all.
environment: every flag has a PREHEAT_ROUTER_* variable (PREHEAT_ROUTER_REPLICAS=URL,URL; the flag wins).

kubernetes: --replicas-from k8s://NAMESPACE/SERVICE watches the Service's EndpointSlices: a pod whose endpoint turns
ready joins (once its /health answers 200), one that turns not ready or terminating leaves (requests on it finish;
its KV-index entries are dropped). Credentials: KUBECONFIG if set, else the pod's service account.

several routers, one view: routers given the same --shared-state redis://HOST:PORT/DB (and --shared-fleet NAME)
share the prefixes their replicas answered, their requests in flight and ejections through one Redis stream, so the
same request goes to the same replica whichever router takes it; each still checks health and polls KV events itself,
and routes on its own view while Redis is down. preheat_router_shared_staleness_seconds says how old the view is.

examples:
  preheat router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --policy least-load
  preheat router --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000 --policy kv --model ./smollm2
  preheat router --policy kv --model ./smollm2 \\
      --replica http://10.0.0.7:8000 --kv-events tcp://10.0.0.7:5557 --kv-replay tcp://10.0.0.7:5558 \\
      --replica http://10.0.0.8:8000,events=tcp://10.0.0.8:5557,replay=tcp://10.0.0.8:5558   # vLLM / SGLang
  preheat router --replica http://127.0.0.1:8001 --standby http://127.0.0.1:8002 --standby-model s3://models/smollm2 \
      --served-model-name smollm2 --saturation 2          # a second replica, activated when the first is busy
  preheat router --replicas-from k8s://llm/preheat-replicas?port=http --policy kv --model /models/smollm2  # in a pod
  PREHEAT_ROUTER_SHARED_STATE=redis://redis:6379/0 preheat router --replica ... --policy prefix

docs: docs/router.md, docs/kv-events.md, docs/integrations.md (vLLM, SGLang)
"""

UP_HELP = """\
Start N `preheat serve` replicas of MODEL and a router in front of them, all on 127.0.0.1, print the endpoints,
wait until every replica is healthy, and stop them all on Ctrl-C or SIGTERM (SIGKILL after a grace period).

With --standby N it also starts N `preheat serve --standby --allow-model MODEL` replicas, which the router activates
when no replica is in rotation or all are saturated (--saturation; docs/router.md, *Standby and sleeping replicas*).
The pool is not refilled: an activated standby is a serving replica from then on.

With --engine vllm (run it in vLLM's environment) every replica and standby is a `preheat vllm-standby`: the
replicas are told to load MODEL at once, so each starts as an activated standby does (its engine processes forked
from a process that has already imported vLLM), and --vllm-args are the `vllm serve` arguments of all of them.

examples:
  preheat up --replicas 2 ./smollm2
  preheat up --engine vllm --replicas 1 --standby 1 ./smollm2 --vllm-args '--dtype float32 --max-model-len 2048'
  preheat up --replicas 2 ./smollm2 --kv-l1 2GiB --kv-l2 fs:///tmp/kv --policy kv --port 8080
  preheat up --replicas 1 --standby 2 ./smollm2 --saturation 2     # grows to 3 replicas under load
  preheat up --replicas 0 --standby 1 ./smollm2                    # the first request activates one
"""


# What `up` passes to its router and, each as `preheat serve` parses it, to every replica (the flags are generated
# from the same settings, so they are spelt and parsed alike: tests/integration/cli/test_cli.py compares them).
VLLM_API_KEY = "VLLM_API_KEY"  # vLLM's, not preheat's (core/env declares preheat's own): its server's --api-key
UP_ROUTER = ("policy", "kv_chunk_tokens", "guard_gap", "hot_in_flight", "index_keys", "index_ttl", "health_interval",
             "health_timeout", "kv_poll_interval", "kv_snapshot_interval", "upstream_timeout", "saturation",
             "activation_timeout", "wake", "newest_version")  # fmt: skip
UP_REPLICA = ("kv_l1", "kv_l2", "max_model_len", "served_model_name", "device", "dtype", "max_queue")


def register(commands: Commands) -> None:
    """Add ``router`` and ``up`` to the ``preheat`` command."""
    from preheat.cli.flags import add_settings_flags
    from preheat.router.settings import RouterSettings
    from preheat.server.settings import ServeSettings

    router = commands.add_parser(
        "router",
        help="route OpenAI requests across replicas: round-robin, least-load, session, prefix or KV-aware",
        description=ROUTER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(router, RouterSettings)
    router.add_argument(
        "--kv-events",
        dest="replicas",
        action=_ReplicaOption,
        option="events",
        metavar="tcp://HOST:PORT",
        help="kv: the preceding --replica is a vLLM/SGLang engine publishing ZMQ KV events here",
    )
    router.add_argument(
        "--kv-replay",
        dest="replicas",
        action=_ReplicaOption,
        option="replay",
        metavar="tcp://HOST:PORT",
        help="kv: the preceding --replica's replay endpoint, to catch up after a gap or a restart",
    )
    router.set_defaults(func=_cmd_router)

    up = commands.add_parser(
        "up",
        help="start N replicas and a router on this machine; Ctrl-C stops them all",
        description=UP_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    up.add_argument(
        "model", help="checkpoint directory or node-cache entry name (served by every replica; the router's tokenizer)"
    )
    up.add_argument("--replicas", type=int, default=2, help="how many replicas (default: 2)")
    up.add_argument(
        "--standby",
        type=int,
        default=0,
        metavar="N",
        help="also start N standby replicas the router activates when it needs capacity (default: 0)",
    )
    up.add_argument("--port", type=int, default=8080, help="the router's port (default: 8080; 0 picks a free one)")
    up.add_argument(
        "--engine",
        choices=("preheat", "vllm"),
        default="preheat",
        help="what serves: `preheat serve` replicas, or vLLM through `preheat vllm-standby` (default: preheat)",
    )
    up.add_argument(
        "--vllm-args",
        default="",
        metavar="ARGS",
        help="--engine vllm: the `vllm serve` arguments of every replica, as one quoted string (not --host/--port)",
    )
    add_settings_flags(up, RouterSettings, only=UP_ROUTER)
    add_settings_flags(
        up, ServeSettings, only=UP_REPLICA, help=lambda s: f"passed to each replica's `preheat serve {s.flag}`"
    )
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for healthy replicas")
    up.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="one key for the router and every replica; their control routes then get an admin key of their own "
        "(PREHEAT_ADMIN_KEY, else a random one) (default: PREHEAT_ROUTER_API_KEY; none: all open on 127.0.0.1)",
    )
    up.set_defaults(func=_cmd_up)


class _ReplicaOption(argparse.Action):
    """``--kv-events``/``--kv-replay``: an option of the ``--replica`` given just before (URL,events=...)."""

    def __init__(self, *args: Any, option: str, **kwargs: Any) -> None:  # Any: argparse's own signature
        super().__init__(*args, **kwargs)
        self.option = option

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,  # Any: argparse's signature (a str here: nargs is None)
        option_string: str | None = None,
    ) -> None:
        replicas = getattr(namespace, self.dest, None)
        if not replicas:
            parser.error(f"{option_string} applies to the --replica before it: give --replica URL first")
        replicas[-1] += f",{self.option}={values}"


def _cmd_router(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from preheat.router.app import run
    from preheat.router.settings import RouterSettings

    flags: dict[str, object] = {f.name: getattr(args, f.name, None) for f in fields(RouterSettings)}
    return run(flags, findings=_doctor_findings(args.model), worker_main=_router_worker)


def _router_worker(flags: Mapping[str, object], slot: WorkerSlot) -> int:
    """One process of ``preheat router --workers N`` (router/workers.py starts it, fresh)."""
    from preheat.cli.main import configure_logging
    from preheat.core.errors import PreheatError
    from preheat.router.app import run

    configure_logging(slot.log_level)
    model = flags.get("model")
    try:
        return run(flags, findings=_doctor_findings(model if isinstance(model, str) else None), worker=slot)
    except PreheatError as exc:  # as `preheat` itself reports one: a line, not a traceback
        print(f"preheat: error: {exc}", file=sys.stderr)
        return 1


def _doctor_findings(model: str | None) -> Refreshing[DoctorDocument]:
    """The doctor's findings for the router's dashboard, refreshed in the background at most once a minute: only
    the cheap checks (no read or bandwidth probes, no CUDA: the router is a CPU front end), within 5 seconds."""
    from preheat.dashboard.refresh import Refreshing
    from preheat.doctor import DoctorOptions, run_doctor

    options = DoctorOptions(model=model if model and os.path.isdir(model) else None, io=False, gpu=False, budget_s=5)
    return Refreshing(lambda: run_doctor(options).to_json(), every=60.0)


def _up_arguments(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The command-line arguments ``preheat up`` gives every replica, and the router."""
    from preheat.cli.flags import settings_argv
    from preheat.router.settings import RouterSettings
    from preheat.server.settings import ServeSettings

    # --kv-chunk-tokens (a router flag too): the router's prefix keys and the replicas' chunks are the same size.
    # --kv-l2 reaches the replicas through their environment (_cmd_up): its URL may carry a password.
    passed = ("kv_l1", "kv_chunk_tokens", "max_model_len", "served_model_name", "device", "dtype", "max_queue")
    replica_args = settings_argv(ServeSettings, args, passed)
    router_args = ["--port", str(args.port), "--model", args.model, *settings_argv(RouterSettings, args, UP_ROUTER)]
    if args.standby:
        # The standbys' --allow-model (cluster.py) and the router's --standby-model name the model the same way.
        model = os.path.abspath(args.model) if "://" not in args.model else args.model
        router_args += ["--standby-model", model]
        if args.served_model_name is not None:
            router_args += ["--served-model-name", str(args.served_model_name)]
    return replica_args, router_args


def _engine_arguments(args: argparse.Namespace, replica_args: list[str]) -> list[str] | None:
    """Each replica's arguments for ``--engine``: ``preheat serve``'s, or vLLM's (``--vllm-args``); None (said why)
    when the two are mixed."""
    if args.engine != "vllm":
        if args.vllm_args:
            print("preheat up: --vllm-args needs --engine vllm", file=sys.stderr)
            return None
        return replica_args
    if replica_args:
        flags = " ".join(a for a in replica_args if a.startswith("--"))
        print(f"preheat up: {flags}: `preheat serve` flags; with --engine vllm give vLLM's own in --vllm-args",
              file=sys.stderr)  # fmt: skip
        return None
    return shlex.split(args.vllm_args)


def _cmd_up(args: argparse.Namespace) -> int:
    from preheat.core import env
    from preheat.http.server import sigterm_interrupts
    from preheat.router.cluster import kv_report, start_cluster, wait_healthy

    def echo(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.standby < 0 or args.replicas < 0 or args.replicas + args.standby < 1:
        print("preheat up: give at least one replica (--replicas N, --standby N)", file=sys.stderr)
        return 2
    from preheat.store.cache import resolve_model

    # A node-cache entry's name (smollm2-135m-instruct) becomes its directory once, here: the replicas, the standby
    # slots' --allow-model and the router's tokenizer then all name the same checkpoint.
    args.model = resolve_model(args.model)
    replica_args, router_args = _up_arguments(args)
    engine_args = _engine_arguments(args, replica_args)
    if engine_args is None:
        return 2
    replica_args = engine_args
    # Secrets reach the children through their environment, never their command lines (visible to all users): the
    # API key, and the L2 URL, which may carry a Redis password. PREHEAT_KV_SECRET_FILE is inherited as it is.
    key = args.api_key or env.get(env.ROUTER_API_KEY)
    extra = {env.API_KEY.name: key, env.ROUTER_API_KEY.name: key} if key else {}
    if key and args.engine == "vllm":  # vLLM's server reads its own variable: without it the replicas were open
        extra[VLLM_API_KEY] = key
    # The replicas' control routes take a key of their own, never the clients' (docs/security.md): the caller's
    # PREHEAT_ADMIN_KEY, else (with a client key) a random one that only the router knows, for its activations.
    admin = env.get(env.ADMIN_KEY) or (secrets.token_urlsafe(24) if key else None)
    if admin:
        extra |= {env.ADMIN_KEY.name: admin, "PREHEAT_ROUTER_REPLICA_ADMIN_KEY": admin}
    if args.kv_l2 is not None:
        extra["PREHEAT_KV_L2"] = str(args.kv_l2)
    # A copy of this process's environment, the children's to change.
    children = {**env.snapshot(), **extra} if extra else None
    # SIGTERM stops the cluster like Ctrl-C; the children are in their own sessions, so the terminal's SIGINT
    # reaches only this process, which stops them in order.
    in_main = threading.current_thread() is threading.main_thread()
    cluster = None
    with sigterm_interrupts():
        try:
            cluster = start_cluster(
                args.model,
                args.replicas,
                replica_args=replica_args,
                router_args=router_args,
                echo=echo,
                env=children,
                standby=args.standby,
                engine=args.engine,
                admin_key=admin,
            )
            assert cluster.router is not None
            assert cluster.router.url is not None
            for child in cluster.children:
                print(f"{child.name}: {child.url} (pid {child.pid})", flush=True)
            live = cluster
            wait_healthy(
                cluster.router.url,
                args.replicas,
                args.ready_timeout,
                alive=lambda: all(c.proc.poll() is None for c in live.children),
                standby=args.standby,
            )
            # Every tier's state before `ready`, and a tier that is down loudly: otherwise it shows only in the
            # children's log above, and the fleet looks whole while every request recomputes.
            tiers, warnings = kv_report(cluster, args.kv_l1, args.kv_l2)
            if tiers:
                print(tiers, flush=True)
            for warning in warnings:
                print(f"preheat up: WARNING: {warning}", file=sys.stderr, flush=True)
            print(f"ready: {cluster.router.url}/v1 (Ctrl-C stops everything)", flush=True)
            while cluster.router.proc.poll() is None:
                time.sleep(0.25)
            print("preheat up: the router exited; stopping the replicas", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt:
            print("preheat up: stopping", file=sys.stderr, flush=True)
            return 0
        finally:
            if cluster is not None:
                # A second Ctrl-C must not cut the shutdown short and leave children behind.
                interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main else None
                if in_main:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
                cluster.stop()
                if interrupt is not None:
                    signal.signal(signal.SIGINT, interrupt)
