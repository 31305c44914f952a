"""Flags generated from a settings dataclass (vLLM's ``arg_utils``): each ``@settings`` field (``core.config``) is
one argparse flag of the same name, its help showing the field's default and its ``PREHEAT_*`` variable, so no option
is written twice. Every flag's default is None: "not given", so that the variable, then the field's default, apply
(``core.config.resolve_settings``).

Only argparse and ``core`` at import time: ``preheat serve`` builds its flags on the cold-start path.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from preheat.cli.common import Arguments, renamed
from preheat.core.config import Setting, settings_of

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_TYPES = {"int": int, "float": float}


def add_settings_flags(
    parser: argparse.ArgumentParser,
    settings: type[DataclassInstance],
    *,
    only: Sequence[str] | None = None,
    help: Callable[[Setting], str] | None = None,
) -> None:
    """Add a flag for each field of ``settings`` (``only``: those fields, in that order, without the fields' argument
    groups; ``help``: another help text, e.g. "passed to each replica")."""
    chosen = settings_of(settings)
    if only is not None:
        by_name = {s.name: s for s in chosen}
        chosen = tuple(by_name[name] for name in only)
    groups: dict[str, Arguments] = {}
    for setting in chosen:
        title = setting.option.group
        where: Arguments  # the parser or one of its argument groups
        if title is None or only is not None:
            where = parser
        elif title in groups:
            where = groups[title]
        else:
            where = groups[title] = parser.add_argument_group(title)
        text = (help(setting) if help is not None else setting.help_text).replace("%", "%%")
        action = where.add_argument(*_spelling(setting), help=text, **_how(setting))
        for old in setting.option.renamed:
            renamed(where, old, action)


def _spelling(setting: Setting) -> tuple[str, ...]:
    return (setting.name,) if setting.flag == "" else (setting.flag,)


def _how(setting: Setting) -> dict[str, Any]:  # Any: add_argument's keyword values
    """What argparse needs beside the spelling: the action, type, metavar and choices."""
    how: dict[str, Any] = {"default": None}  # Any: add_argument's values; None: not given (variable, default apply)
    if setting.flag == "":
        return {**how, "nargs": "?"}
    how["dest"] = setting.name
    if setting.kind == "bool":
        # A switch: on when given; a setting that is on by default is turned off by its --no-... flag.
        if setting.default is True:
            return {**how, "action": "store_const", "const": False}
        return {**how, "action": "store_true"}
    if setting.kind == "list":
        how["action"] = "append"
    if setting.kind in _TYPES:
        how["type"] = _TYPES[setting.kind]
    if setting.option.metavar is not None:
        how["metavar"] = setting.option.metavar
    if setting.option.choices is not None:
        how["choices"] = setting.option.choices
    return how


def settings_argv(settings: type[DataclassInstance], args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The command-line words that give a child process the settings ``names`` as ``args`` holds them (those given
    only: None is not given), spelt as the child's flags.

    >>> from preheat.router.settings import RouterSettings
    >>> given = argparse.Namespace(port=81, wake=False, standby=["u"])
    >>> settings_argv(RouterSettings, given, ["port", "wake", "standby"])
    ['--port', '81', '--no-wake', '--standby', 'u']
    """
    by_name = {s.name: s for s in settings_of(settings)}
    words: list[str] = []
    for name in names:
        setting, value = by_name[name], getattr(args, name)
        if value is None:
            continue
        if setting.kind == "bool":
            words += [setting.flag] if value is not setting.default else []
        elif setting.kind == "list":
            for item in value:
                words += [setting.flag, str(item)]
        else:
            words += [setting.flag, str(value)]
    return words
