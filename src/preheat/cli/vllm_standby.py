"""``preheat vllm-standby``: a warm vLLM API server waiting for its model (preheat.integrations.vllm.standby).

Only argparse at import time: vLLM and torch are imported once the command runs, behind the bound socket.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from preheat.cli.common import Commands

HELP = """\
Run in vLLM's environment. Binds HOST:PORT at once, imports torch, vLLM and its API server, engine and worker
machinery (/health: 503 {"status": "standby", "prepared": false, then true}), and on
POST /v1/preheat/load {"model": DIR} (a model --allow-model allows; the admin key as for preheat serve) becomes
`vllm serve DIR VLLM_ARGS...` on the same socket: vLLM's own API, /health and /metrics. Its engine processes fork
from the prepared standby instead of importing vLLM again. `preheat router --standby URL` activates it when it needs
capacity.

--load MODEL is that load request given on the command line, queued before the port answers: the standby serves
MODEL as soon as it can (a replica of `preheat up --engine vllm` or of a Kubernetes vLLM fleet). Without an admin key
its load route is then closed beyond loopback, so it may bind 0.0.0.0.

example:
  preheat vllm-standby --port 8001 --allow-model '/models/*' -- --dtype float32 --max-model-len 2048
  curl -X POST localhost:8001/v1/preheat/load -H 'Content-Type: application/json' -d '{"model": "/models/smol"}'
  preheat vllm-standby --host 0.0.0.0 --port 8000 --load /models/smol -- --dtype float32   # serves smol at once

VLLM_ARGS: what you would give `vllm serve` after MODEL, but --host, --port, --uds and --model (the standby sets
those); checked with vLLM's own parser before the standby says prepared.
"""


def register(commands: Commands) -> None:
    """Add ``vllm-standby`` to the ``preheat`` command."""
    from preheat.cli.flags import add_settings_flags
    from preheat.integrations.vllm.standby_settings import VllmStandbySettings

    parser = commands.add_parser(
        "vllm-standby",
        help="a warm vLLM API server that loads its model on POST /v1/preheat/load",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_settings_flags(parser, VllmStandbySettings)
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="-- VLLM_ARGS", help="vllm serve's arguments")
    parser.set_defaults(func=_cmd_vllm_standby)


def _cmd_vllm_standby(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from preheat.integrations.vllm.standby import run
    from preheat.integrations.vllm.standby_settings import VllmStandbySettings

    flags: dict[str, object] = {f.name: getattr(args, f.name, None) for f in fields(VllmStandbySettings)}
    words = list(args.vllm_args)
    if words[:1] == ["--"]:
        words = words[1:]
    return run(VllmStandbySettings.resolve(flags), words)
