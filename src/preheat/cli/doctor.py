"""``preheat doctor``: check the node (and a replica, timeline, origin, registry) and rank what slows a cold start."""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from preheat.core import env

if TYPE_CHECKING:  # imported when a command runs: `preheat --help` stays fast
    from preheat.cli.common import Commands
    from preheat.doctor.check import DoctorOptions
    from preheat.doctor.findings import DoctorDocument, FindingRecord

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


def register(commands: Commands) -> None:
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
    doctor.add_argument("--origin", default=env.get(env.ORIGIN), metavar="URI",
                        help="an HTTP(S) origin to probe: a file's URL, or a directory URL ending in / (the model's "
                             "largest file is read from it) [PREHEAT_ORIGIN]")
    doctor.add_argument("--registry", default=env.get(env.REGISTRY), metavar="URL",
                        help="the peer registry: redis://host:port/db or file:///dir [PREHEAT_REGISTRY]")
    doctor.add_argument("--name", default=None, metavar="NAME",
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
    doctor.add_argument("--api-key", default=env.get(env.API_KEY), metavar="KEY",
                        help="bearer token for the replica URL [PREHEAT_API_KEY]")
    # Its own dest: a subcommand's default would overwrite the top-level -v (`preheat -v doctor`) in the namespace.
    doctor.add_argument("-v", "--verbose", dest="every_check", action="store_true",
                        help="print every check with its evidence (default: the problems, their fixes, one line per "
                             "area)")
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


def _options(args: argparse.Namespace) -> DoctorOptions:
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
    elif args.every_check or args.verbose:
        _print_table(document, args.gpu_cost_per_hour)
    else:
        _print_summary(document, args.gpu_cost_per_hour)
    return int(document["exit_code"])


PROBLEMS_SHOWN = 6  # the costliest problems in full; a node with more is told to run -v (the default stays short)


def summary_lines(document: DoctorDocument, cost_per_hour: float, width: int) -> list[tuple[str, str]]:
    """The default report as ``(severity or "", line)`` pairs within ``width`` columns: a verdict, each problem (fail,
    warn) with its cost and fix, one line per area with its counts, and where the rest is. Pure: tested at 80.

    >>> doc = {"status": "ok", "elapsed_s": 0.1, "findings": [{"id": "node.thp", "area": "node", "severity": "ok",
    ...        "title": "THP: madvise", "seconds": None, "evidence": {}, "fix": None}]}
    >>> for _, line in summary_lines(doc, 0.0, 80):
    ...     print(line)
    preheat doctor: ok, 1 check in 0.1 s (1 ok)
    <BLANKLINE>
    node      1 ok
    <BLANKLINE>
    every check: preheat doctor -v; JSON: --json; ids: docs/operations.md
    """
    import textwrap

    findings = document["findings"]  # ranked: costliest first
    counts = _counts(findings)
    plural = "check" if len(findings) == 1 else "checks"
    lines = [("", f"preheat doctor: {document['status']}, {len(findings)} {plural} in {document['elapsed_s']:.1f} s "
                  f"({counts})"), ("", "")]  # fmt: skip
    problems = [f for f in findings if f["severity"] in ("fail", "warn")]
    indent = " " * 6
    for finding in problems[:PROBLEMS_SHOWN]:
        cost = ""
        if finding["seconds"] is not None:
            cost = f"{finding['seconds']:.1f} s/start"
            if cost_per_hour:
                cost += f" (${finding['seconds'] * cost_per_hour / 3600:.4f})"
            cost += ": "
        head = f"{cost}{finding['title']} ({finding['id']})"
        wrapped = textwrap.wrap(head, width - len(indent), break_long_words=False, break_on_hyphens=False)
        lines.append((finding["severity"], f"{finding['severity']:<4}  {wrapped[0]}"))
        lines += [("", indent + more) for more in wrapped[1:]]
        if finding["fix"]:
            fix = textwrap.wrap(f"fix: {finding['fix']}", width - len(indent), break_long_words=False,
                                break_on_hyphens=False)  # fmt: skip
            lines += [("", indent + part) for part in fix]
    if len(problems) > PROBLEMS_SHOWN:
        lines.append(("", f"{indent}... and {len(problems) - PROBLEMS_SHOWN} more problems: preheat doctor -v"))
    if problems:
        lines.append(("", ""))
    areas: dict[str, list[FindingRecord]] = {}
    for finding in findings:
        areas.setdefault(finding["area"], []).append(finding)
    for area, found in areas.items():
        # The ids of the infos (optional extras, things not checked): a word each, enough to know what to ask -v.
        infos = [f["id"].removeprefix(f"{area}.") for f in found if f["severity"] == "info"]
        line = f"{area:<9} {_counts(found, infos)}"
        wrapped = textwrap.wrap(line, width, subsequent_indent=" " * 10, break_long_words=False)
        lines += [("", part) for part in wrapped]
    lines += [("", ""), ("", "every check: preheat doctor -v; JSON: --json; ids: docs/operations.md")]
    return lines


def _counts(findings: list[FindingRecord], infos: list[str] | None = None) -> str:
    """``1 warn, 2 info (gds, nixl), 6 ok``: how many findings of each severity, the worst first (with ``infos``
    named)."""
    order = ("fail", "warn", "info", "ok")
    tally = {severity: sum(f["severity"] == severity for f in findings) for severity in order}
    named = f" ({', '.join(infos)})" if infos else ""
    return ", ".join(f"{n} {severity}" + (named if severity == "info" else "") for severity, n in tally.items() if n)


def _print_summary(document: DoctorDocument, cost_per_hour: float) -> None:
    from rich.console import Console
    from rich.text import Text

    # No markup and no wrapping by rich: findings hold paths, URLs and servers' messages, printed as they are, and
    # summary_lines already wrapped them at word boundaries.
    console = Console(highlight=False, soft_wrap=True)
    for severity, line in summary_lines(document, cost_per_hour, console.width):
        text = Text(line)
        if severity:
            text.stylize(_STYLE[severity], 0, len(severity))
        console.print(text)


_STYLE = {"fail": "bold red", "warn": "yellow", "info": "cyan", "ok": "green"}


def _print_table(document: DoctorDocument, cost_per_hour: float) -> None:
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
