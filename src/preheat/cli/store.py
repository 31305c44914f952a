"""``preheat pull`` and ``preheat cache ...``: the node-local model cache from the command line."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from preheat.core.config import format_bytes, parse_size
from preheat.core.errors import CacheError

if TYPE_CHECKING:  # imported when a command runs
    from preheat.cli.common import Commands
    from preheat.store import ModelCache

PULL_HELP = """\
Download a checkpoint into the node-local cache, in parallel, resumably, verified, published atomically.

URI is an http(s):// or s3://bucket/prefix URL (or a local/NFS directory) holding a preheat checkpoint (preheat.json)
or a Hugging Face layout (config.json + model.safetensors[.index.json]). A pull that was interrupted resumes: only
missing chunks are fetched again. Several processes pulling the same model download it once; the others wait.

examples:
  preheat pull https://models.internal/llama-3-8b
  AWS_ENDPOINT_URL=http://minio:9000 preheat pull s3://models/llama-3-8b --threads 32
  preheat pull preheat://llama-3-8b --registry redis://reg:6379 --origin https://models.internal/llama-3-8b
"""

CACHE_HELP = """\
Inspect and manage the node-local cache (default ~/.cache/preheat, or PREHEAT_CACHE_DIR).

examples:
  preheat cache ls --json
  preheat cache gc --max-size 50GiB        # least recently used first; entries in use are never removed
  preheat cache gc --stale-after 0         # only abandoned partial pulls and temp files, however young
  preheat cache rm xxh3-128:4f1c...
  preheat cache warm s3://models/llama      # for init containers and node DaemonSets: pull, print the path
"""


def register(commands: Commands) -> None:
    """Add ``pull`` and ``cache`` to the ``preheat`` command."""
    pull = commands.add_parser(
        "pull",
        help="download a checkpoint into the node-local cache (parallel, resumable, verified)",
        description=PULL_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pull.add_argument("uri", help="http(s)://..., s3://bucket/prefix, preheat://NAME (from peers) or a local directory")
    _common(pull)
    pull.add_argument(
        "--registry", default=None, metavar="URL", help="preheat://: peer registry, redis://... or file:///dir"
    )
    pull.add_argument(
        "--origin", default=None, metavar="URI", help="preheat://: where to fall back to when no peer has it"
    )
    pull.set_defaults(func=_cmd_pull)

    cache = commands.add_parser(
        "cache",
        help="list, remove, garbage-collect or warm node-local cache entries",
        description=CACHE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verbs = cache.add_subparsers(dest="cache_command", metavar="VERB")
    ls = verbs.add_parser("ls", help="list entries, most recently used first")
    _cache_dir(ls)
    ls.add_argument("--json", action="store_true", help="print JSON")
    ls.set_defaults(func=_cmd_ls)
    rm = verbs.add_parser("rm", help="remove an entry (by key or by the URI it was pulled from)")
    rm.add_argument("target", help="an entry key (see 'cache ls') or its URI")
    _cache_dir(rm)
    rm.set_defaults(func=_cmd_rm)
    gc = verbs.add_parser(
        "gc",
        help="remove abandoned partial pulls and temp files, and least recently used entries beyond --max-size",
    )
    gc.add_argument("--max-size", default=None, help="e.g. 50GiB: also remove entries until the cache fits")
    gc.add_argument(
        "--stale-after",
        type=_duration,
        default=None,
        help="remove partial pulls no process runs and temp files untouched this long (30m, 2h, 0; default 1h)",
    )
    _cache_dir(gc)
    gc.add_argument("--json", action="store_true", help="print JSON")
    gc.set_defaults(func=_cmd_gc)
    warm = verbs.add_parser("warm", help="make sure URI is cached (pull it if not) and print the entry's path")
    warm.add_argument("uri", help="http(s)://..., s3://bucket/prefix or a local directory")
    _common(warm)
    warm.add_argument(
        "--link",
        default=None,
        metavar="PATH",
        help="also make PATH a symlink to the entry: a fixed MODEL path for vllm serve (docs/kubernetes.md)",
    )
    warm.set_defaults(func=_cmd_pull, warm=True)

    def usage(args: argparse.Namespace) -> int:  # `preheat cache` without a verb
        cache.print_help()
        return 2

    cache.set_defaults(func=usage)


def _cache_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", default=None, metavar="DIR", help="cache root (default: PREHEAT_CACHE_DIR or ~/.cache/preheat)"
    )


def _common(parser: argparse.ArgumentParser) -> None:
    _cache_dir(parser)
    parser.add_argument("--threads", type=int, default=16, metavar="N", help="parallel streams (default: 16)")
    parser.add_argument(
        "--chunk-bytes", default="16MiB", metavar="SIZE", help="bytes per ranged request (default: 16MiB)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _cache(args: argparse.Namespace) -> ModelCache:
    from preheat.store import ModelCache

    return ModelCache(args.cache_dir)


def _cmd_pull(args: argparse.Namespace) -> int:
    from preheat.cli.common import progress_for
    from preheat.sources.peer_uri import is_peer_uri
    from preheat.store.pull import pull

    with progress_for(args, label=f"pulling {args.uri}", transient=True) as bar:
        progress = bar.update
        peers = is_peer_uri(args.uri)
        if peers:  # a name peers hold: tokens only from PREHEAT_PEER_TOKEN (a command line is public)
            from preheat.peer.pull import PeerOptions, pull_from_peers

            given = {"registry": getattr(args, "registry", None), "origin": getattr(args, "origin", None)}
            options = PeerOptions.from_env(**given)
            result = pull_from_peers(
                args.uri, _cache(args), options, chunk_bytes=parse_size(args.chunk_bytes), progress=progress
            )
        else:
            chunk_bytes = parse_size(args.chunk_bytes)
            result = pull(args.uri, _cache(args), threads=args.threads, chunk_bytes=chunk_bytes, progress=progress)
    if getattr(args, "link", None):
        from preheat.store.cache import link_entry

        link_entry(args.link, result.path)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    elif getattr(args, "warm", False):
        print(result.path)
    else:
        state = "already cached" if result.hit else f"{format_bytes(result.bytes_fetched)} in {result.seconds:.1f} s"
        rate = f" ({result.mbps:.0f} MB/s)" if not result.hit else ""
        print(f"{result.key}\n{result.path}\n{state}{rate}")
        for note in result.notes:
            print(f"note: {note}", file=sys.stderr)
        for source, nbytes in result.sources.items() if peers else ():
            print(f"from {source}: {format_bytes(nbytes)}", file=sys.stderr)
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    cache = _cache(args)
    entries = cache.entries()
    if args.json:
        print(json.dumps([e.to_dict() for e in entries], indent=2))
        return 0
    count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    print(f"preheat cache {cache.root}: {count}, {format_bytes(sum(e.size for e in entries))}")
    rows = [
        (e.name, e.key, format_bytes(e.size), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used)),
         "yes" if e.in_use else "", e.uri, e.path)
        for e in entries
    ]  # fmt: skip
    # name: what `preheat serve NAME` takes; key: what `cache rm` takes; path: where the files are.
    for line in columns(("NAME", "KEY", "SIZE", "LAST USED", "IN USE", "URI", "PATH"), rows) if rows else ():
        print(line)
    return 0


def columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Plain left-aligned columns, each as wide as its longest cell: a key, URI or path is never cut or wrapped
    mid-value, so it can be copied from the terminal (which wraps a long line) or cut from a pipe.

    >>> columns(("KEY", "PATH"), [("k1", "/a/very/long/path")])
    ['KEY  PATH', 'k1   /a/very/long/path']
    """
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in (header, *rows)]
    return ["  ".join(cells).rstrip() for cells in lines]


def _cmd_rm(args: argparse.Namespace) -> int:
    cache = _cache(args)
    key = args.target if cache.lookup(args.target) else cache.find_uri(args.target)
    if key is None:
        raise CacheError(f"no cache entry with key or URI {args.target!r} in {cache.root}")
    cache.remove(key)
    print(f"removed {key}")
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from preheat.store.cache import STALE_AFTER

    cache = _cache(args)
    swept = cache.sweep(STALE_AFTER if args.stale_after is None else args.stale_after)
    removed = cache.gc(parse_size(args.max_size)) if args.max_size is not None else []
    if args.json:
        print(json.dumps({"removed": [e.to_dict() for e in removed], "swept": [s.to_dict() for s in swept]}, indent=2))
    else:
        freed = sum(e.size for e in removed) + sum(s.size for s in swept)
        leftovers = f"{len(swept)} abandoned pulls or temp files"
        print(f"removed {len(removed)} entries and {leftovers}, freed {format_bytes(freed)}")
    return 0


def _duration(text: str) -> float:
    """Seconds from ``90``, ``30s``, ``30m``, ``2h`` or ``1d``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], units[text[-1]]) if text and text[-1] in units else (text, 1)
    try:
        seconds = float(number) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration (e.g. 90, 30m, 2h, 1d)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a duration must be a finite number of seconds, 0 or more")
    return seconds
