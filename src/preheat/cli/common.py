"""What every ``preheat`` command shares: the parser class (a misspelt flag is answered by the command it was given
to, with the flag it meant), renamed flags (the old spelling still works, hidden, and says the new name) and the
progress display of long jobs.

Only argparse at import time, like the commands' modules: ``preheat serve`` builds its parser on the cold-start path.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from preheat.core.progress import ProgressBars


class Commands(Protocol):
    """What a command module's ``register`` is given: ``preheat``'s subparsers action (argparse's class for it,
    ``_SubParsersAction``, is private), as much of it as the commands use."""

    def add_parser(
        self,
        name: str,
        *,
        help: str = ...,
        description: str | None = ...,
        formatter_class: type[argparse.HelpFormatter] = ...,
    ) -> argparse.ArgumentParser: ...


class Arguments(Protocol):
    """What takes flags: a parser or one of its argument groups (argparse's ``_ArgumentGroup`` is private)."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> argparse.Action: ...  # Any: argparse's keywords


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose (sub)commands refuse unknown arguments themselves.

    argparse hands a subcommand's leftovers back to the top-level parser, which prints the top-level usage: a user who
    typed ``preheat serve --prot 8000`` would read every command's name and not one of serve's flags. Here the
    subcommand that got the argument errors, with its own usage and the flags closest to what was typed. Subparsers
    inherit the class (``add_subparsers`` uses ``type(self)``), so the whole tree answers this way.
    """

    def parse_known_args(  # type: ignore[override]  # typeshed's overloads; we take and return the plain forms
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(unknown_arguments(self, extras))
        return parsed, extras


def unknown_arguments(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The message for ``extras`` that ``parser`` does not take, with a "did you mean" for each misspelt flag.

    >>> parser = argparse.ArgumentParser(prog="preheat serve")
    >>> _ = parser.add_argument("--port")
    >>> unknown_arguments(parser, ["--prot", "8000"])
    'unrecognized arguments: --prot 8000 (did you mean --port?)'
    """
    import difflib  # here: only a command line with a mistake pays for it

    flags = visible_flags(parser)
    hints: dict[str, str] = {}
    for word in extras:
        typed = word.split("=", 1)[0]
        close = difflib.get_close_matches(typed, flags, n=1, cutoff=0.6) if typed.startswith("--") else []
        if close:
            hints[typed] = close[0]
    message = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{message} (did you mean {next(iter(hints.values()))}?)"
    return message + "".join(f"\n  {typed}: did you mean {flag}?" for typed, flag in hints.items())


def visible_flags(parser: argparse.ArgumentParser) -> list[str]:
    """The long option strings ``parser --help`` shows (hidden, renamed spellings are never suggested)."""
    return [
        flag
        for action in parser._actions  # argparse has no public list of a parser's actions
        if action.help is not argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--")
    ]


class _Renamed(argparse.Action):
    """A flag's old spelling: parsed as the flag under its new name, with a note on stderr saying that name."""

    def __init__(
        self, *args: Any, note: str, inner: argparse.Action, into: str | None, **kwargs: Any  # Any: argparse's own
    ) -> None:
        super().__init__(*args, **kwargs)
        self.note, self.inner, self.into = note, inner, into

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,  # Any: argparse's signature (whatever the renamed flag's type gives)
        option_string: str | None = None,
    ) -> None:
        print(f"{parser.prog}: {self.note}", file=sys.stderr)
        if self.into is not None:  # an option that became a positional argument: its own dest (see ``renamed``)
            setattr(namespace, self.into, values)
        else:
            self.inner(parser, namespace, values, self.inner.option_strings[0])


def renamed(parser: Arguments, old: str, action: argparse.Action, *, dest: str | None = None) -> None:
    """Keep ``old``, a flag's former spelling, working for scripts written before the rename: hidden from ``--help``
    and from "did you mean", parsed exactly as ``action`` (the flag under its new name, or the positional argument an
    option became: then into ``dest``, since a positional's absence would overwrite the value), with a note on stderr.
    """
    if action.option_strings:
        note = f"{old} is now {action.option_strings[0]}; {old} will go"
    else:
        note = f"{old} is not needed any more: give {action.metavar or action.dest.upper()} alone; {old} will go"
    parse: dict[str, Any] = {"type": action.type} if action.type is not None else {}  # Any: add_argument's values
    parser.add_argument(
        old,
        dest=dest or action.dest,
        nargs=action.nargs if action.option_strings else None,
        choices=action.choices,
        default=argparse.SUPPRESS if dest is None else None,  # the new flag's default stands when old is not given
        help=argparse.SUPPRESS,
        action=_Renamed,
        note=note,
        inner=action,
        into=dest,
        **parse,
    )


def progress_for(args: argparse.Namespace, *, label: str = "", transient: bool = False) -> ProgressBars:
    """Progress for a long job: bars on a terminal (not with ``--json``); elsewhere (logs, CI) a line on stderr for
    each stage over 2 s, then its bytes and seconds. Both wait 2 s, so a quick job prints nothing more."""
    stderr = sys.stderr  # this one: a library may swap sys.stderr to silence its own output meanwhile
    terminal = stderr.isatty()

    def say(line: str) -> None:
        print(line, file=stderr, flush=True)

    return ProgressBars(
        enabled=terminal and not args.json, label=label, delay=2.0, transient=transient, say=None if terminal else say
    )
