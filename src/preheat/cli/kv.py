"""``preheat kv ...``: the KV store from the command line: list its namespaces, warm a node before a replica starts."""

from __future__ import annotations

import argparse
import json
import sys

from preheat.cli.common import Commands, renamed
from preheat.core.config import format_bytes, parse_size
from preheat.core.errors import ConfigError

KV_HELP = """\
The shared KV store (docs/kv-store.md): preheat's own L2 chunks and the values LMCache (and other engines) keep in
it, one namespace per model identity + engine + KV layout.

examples:
  preheat kv ls fs:///shared/kv
  preheat kv warm fs:///shared/kv --namespace 6f1c...e2 --bytes 20GiB
"""

WARM_HELP = """\
Read and verify the hottest values of a namespace (most recently used first) before a replica starts: the node's
page cache then holds them, and damaged ones are removed before the engine asks. For an engine's own host tier, warm
inside it: `preheat serve --kv-warm SIZE` (its /health says "warming" until done) or, for LMCache,
preheat.integrations.lmcache.warm(connector).

examples:
  preheat kv warm fs:///shared/kv --namespace 6f1c...e2 --bytes 20GiB
  preheat kv warm redis://kv:6379/0 --namespace 6f1c...e2 --entries 500 --json
"""


def register(commands: Commands) -> None:
    """Add ``kv`` (``ls``, ``warm``) to the ``preheat`` command."""
    kv = commands.add_parser("kv", help="list the shared KV store's namespaces, warm a node from it",
                             description=KV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = kv.add_subparsers(dest="kv_command", metavar="VERB")
    verbs.required = True
    ls = verbs.add_parser("ls", help="the namespaces of a store (id, model, engine)", description=KV_HELP,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    _store_url(ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_cmd_ls)
    warm = verbs.add_parser("warm", help="read and verify a namespace's hottest values before a replica starts",
                            description=WARM_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    _store_url(warm)
    warm.add_argument("--namespace", required=True, help="the namespace id (32 hex digits: preheat kv ls)")
    warm.add_argument("--bytes", default=None, metavar="SIZE", help="stop after this much (e.g. 20GiB; default: all)")
    warm.add_argument("--entries", type=int, default=None, metavar="N", help="stop after N values")
    secret = warm.add_argument(
        "--kv-secret-file", default=None, metavar="FILE", help="the fleet secret: check signed values' MAC"
    )
    renamed(warm, "--secret-file", secret)
    warm.add_argument("--json", action="store_true", help="print the report as JSON")
    warm.set_defaults(func=_cmd_warm)


def _store_url(parser: argparse.ArgumentParser) -> None:
    # Positional, as every command's main URI is; --url, its spelling before, still works (into ``url_flag``).
    url = parser.add_argument("url", nargs="?", default=None, metavar="URL",
                              help="fs:///shared/kv or redis://host:port/db")
    renamed(parser, "--url", url, dest="url_flag")


def _url(args: argparse.Namespace) -> str:
    url: str | None = args.url or args.url_flag
    if url is None:
        raise ConfigError(f"kv {args.kv_command} needs the store's URL: preheat kv {args.kv_command} fs:///shared/kv")
    return url


def _cmd_ls(args: argparse.Namespace) -> int:
    from preheat.kv.backends import list_namespaces

    found = list_namespaces(_url(args))
    if args.json:
        print(json.dumps([{"id": ident, "namespace": description} for ident, description in found], indent=2))
        return 0
    for ident, description in found:
        if description is None:
            print(f"{ident}  (preheat engine chunks, or no description)")
        else:
            print(f"{ident}  {description.get('engine')}  {description.get('model')}")
    return 0


def _cmd_warm(args: argparse.Namespace) -> int:
    from preheat.kv.warm import WarmReport, warm_namespace

    last = [0.0]

    def progress(report: WarmReport) -> None:
        if args.json or not sys.stderr.isatty():
            return
        print(f"\rwarmed {report.loaded} values, {format_bytes(report.bytes)}", end="", file=sys.stderr)
        last[0] = 1.0

    report = warm_namespace(_url(args), args.namespace, max_bytes=parse_size(args.bytes) if args.bytes else None,
                            max_entries=args.entries, secret_file=args.kv_secret_file, progress=progress)
    if last[0]:
        print(file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"warmed {report.loaded} values ({format_bytes(report.bytes)}) of {args.namespace} in "
              f"{report.seconds:.1f} s; {report.skipped} skipped (damaged or gone)")
    return 0
