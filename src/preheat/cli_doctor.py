"""``preheat doctor``: check the node (and a replica, timeline, origin, registry) and rank what slows a cold start."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

DOCTOR_HELP = """\
Check whether this node is set up to load a model fast and, given a replica URL or a timeline, which stage of its
cold start to fix first. Findings are ranked by the seconds they cost per cold start, each with its evidence and the
fix (docs/operations.md explains every finding id). Every check is time-bounded; the whole run stays within
--budget-s.

exit code: 0 ok, 1 warnings, 2 failures (gate a node in CI or an init container on it).

examples:
  preheat doctor                                   # the node only
  preheat doctor /models/llama-3-8b                # + filesystem, free space, page cache, read GB/s of the model
  preheat doctor http://127.0.0.1:8000 --gpu-cost-per-hour 4   # a running replica: its slowest stage, priced
  preheat doctor timeline.json --json              # a recorded /v1/preheat/timeline
  preheat doctor /models/m --origin https://files/m/ --registry redis://reg:6379/0
"""


def register(commands: Any) -> None:  # Any: argparse's subparsers action has no public type
    """Add ``doctor`` to the ``preheat`` command."""
    doctor = commands.add_parser(
        "doctor",
        help="check the node, a replica or a timeline and rank what slows a cold start",
        description=DOCTOR_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument(
        "target", nargs="?", default=None, metavar="MODEL|URL|TIMELINE.json",
        help="a model directory, a replica's http(s):// URL, or a timeline JSON file",
    )
    doctor.add_argument("--json", action="store_true", help="print the preheat.doctor/1 JSON (docs/doctor.schema.json)")
    doctor.add_argument("--origin", default=os.environ.get("PREHEAT_ORIGIN"), metavar="URL",
                        help="an HTTP(S) origin to probe: a file's URL, or a directory URL ending in / (the model's "
                             "largest file is read from it) [PREHEAT_ORIGIN]")
    doctor.add_argument("--registry", default=os.environ.get("PREHEAT_REGISTRY"), metavar="URL",
                        help="the peer registry: redis://host:port/db or file:///dir [PREHEAT_REGISTRY]")
    doctor.add_argument("--name", default=None,
                        help="what peers announce the model as (default: its preheat.json identity or dir name)")
    doctor.add_argument("--gpu-cost-per-hour", type=float, default=0.0, metavar="USD",
                        help="price the seconds of each finding in USD per start at this GPU-hour price")
    doctor.add_argument("--budget-s", type=_budget, default=30.0, metavar="S",
                        help=f"seconds for the whole run, at least {MIN_BUDGET_S:g} (default: 30)")
    doctor.add_argument("--no-io", dest="io", action="store_false",
                        help="skip the read, download and bandwidth probes (only cheap, read-only checks)")
    doctor.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="the node cache directory to check (default: preheat's)")
    doctor.add_argument("--threads", type=int, default=None, metavar="N",
                        help="the reader threads you configured, to check")
    doctor.add_argument("--api-key", default=os.environ.get("PREHEAT_API_KEY"), metavar="KEY",
                        help="bearer token for the replica URL [PREHEAT_API_KEY]")
    doctor.set_defaults(func=_cmd_doctor)


MIN_BUDGET_S = 1.0  # under it every check is skipped (info), and a run that examined nothing would exit 0: "ok"


def _budget(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds >= MIN_BUDGET_S:  # NaN too
        raise argparse.ArgumentTypeError(f"{text} s is too short to check anything (at least "
                                         f"{MIN_BUDGET_S:g} s)")  # fmt: skip
    return seconds


def _options(args: argparse.Namespace) -> Any:  # Any: DoctorOptions, imported late to keep `preheat --help` fast
    from preheat.doctor import DoctorOptions

    target: str | None = args.target
    model = url = timeline = None
    if target is not None:
        if target.startswith(("http://", "https://")):
            url = target
        elif target.endswith(".json") and os.path.isfile(target):
            timeline = target
        else:
            model = target
    return DoctorOptions(
        model=model, url=url, timeline=timeline, origin=args.origin, registry=args.registry,
        gpu_cost_per_hour=args.gpu_cost_per_hour, budget_s=args.budget_s, io=args.io,
        cache_dir=args.cache_dir, threads=args.threads, api_key=args.api_key, name=args.name,
    )


def _cmd_doctor(args: argparse.Namespace) -> int:
    from preheat.doctor import run_doctor

    report = run_doctor(_options(args))
    document = report.to_json()
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        _print_table(document, args.gpu_cost_per_hour)
    return int(document["exit_code"])


_STYLE = {"fail": "bold red", "warn": "yellow", "info": "cyan", "ok": "green"}


def _print_table(document: dict[str, Any], cost_per_hour: float) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"preheat doctor: {document['status']} ({document['elapsed_s']:.1f} s)", show_lines=True,
                  caption="ids: docs/operations.md; all evidence: --json")
    table.add_column("s/start", justify="right")
    if cost_per_hour:
        table.add_column("$/start", justify="right")
    table.add_column("", no_wrap=True)
    table.add_column("finding", ratio=3)
    table.add_column("fix", ratio=2)
    for finding in document["findings"]:
        seconds = finding["seconds"]
        cells = ["" if seconds is None else f"{seconds:.1f}"]
        if cost_per_hour:
            cells.append("" if seconds is None else f"{seconds * cost_per_hour / 3600:.4f}")
        severity = finding["severity"]
        # Titles, evidence and fixes hold paths, URLs and servers' messages: escaped, so a "[...]" in them prints as
        # written instead of being read as rich markup (an unmatched "[/x]" would end the run with a MarkupError).
        evidence = escape(", ".join(f"{k}={_short(v)}" for k, v in finding["evidence"].items() if v is not None))
        cells += [f"[{_STYLE[severity]}]{severity}[/]",
                  f"{escape(finding['title'])} [dim]({escape(finding['id'])})\n{evidence}[/]",
                  escape(finding["fix"] or "")]  # fmt: skip
        table.add_row(*cells)
    Console().print(table)


def _short(value: object) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 40 else text[:37] + "..."
