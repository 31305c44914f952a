"""Settings: how a settings dataclass declares each option once (``option``: its help, flag and environment variable,
from which ``preheat.cli.flags`` makes the argparse flag and ``settings`` the ``PREHEAT_*`` variable), the one
flag-then-variable-then-default rule (``resolve_settings``) behind ``preheat serve``'s and the router's settings, and
the loader's tunables (``LoaderSettings``: ``PREHEAT_THREADS``, ``PREHEAT_CHUNK_BYTES``, ``PREHEAT_LOAD_MODE``).

Every variable is declared in ``core.env`` and read through it; docs/environment.md lists them all. Sizes
(``parse_size``, ``format_bytes``) live in ``core.sizes`` and are re-exported here for their many users.

    >>> from dataclasses import dataclass, field
    >>> @settings(prefix="DEMO_", command="demo")
    ... @dataclass(frozen=True)
    ... class Demo:
    ...     port: int = field(default=80, metadata=option("port; 0 picks a free one"))
    >>> resolve_settings(Demo, {"port": None}, {"DEMO_PORT": " 81 "})
    {'port': 81}
    >>> settings_of(Demo)[0].help_text
    'port; 0 picks a free one (default: 80) [DEMO_PORT]'
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, TypeVar

from preheat.core import env
from preheat.core.sizes import format_bytes, parse_size

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "LoaderSettings",
    "Option",
    "Setting",
    "format_bytes",
    "option",
    "parse_size",
    "resolve_settings",
    "settings",
    "settings_of",
]

S = TypeVar("S", bound="type[DataclassInstance]")
_KEY = "preheat"  # the key of a field's metadata that holds its Option
_PARSERS: dict[str, Callable[[str], object]] = {
    "str": env.parse_text,
    "int": env.parse_int,
    "float": env.parse_float,
    "bool": env.parse_switch,
    "list": env.parse_names,
}


@dataclass(frozen=True)
class Option:
    """How a settings field is given, beside its type and default. ``flag``: its spelling (default ``--field-name``;
    ``""``: the positional argument; a ``bool`` field whose default is True is turned off by a ``--no-...`` flag);
    ``default_text``: what ``--help`` says the default is when the field's default does not say it (``None`` there:
    "the model's", "off", ...); ``variable``: a variable the setting shares with other commands, declared in
    ``core.env`` (otherwise its own ``<prefix><FIELD>``); ``parse``: the variable's text to a value, when the field's
    type does not say how (comma-separated replica specs, ...); ``value``: what to write, as the docs' table shows
    it; ``renamed``: former spellings of the flag, still accepted (hidden)."""

    help: str
    flag: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    group: str | None = None
    default_text: str | None = None
    variable: env.Variable[object] | None = None  # a shared variable of the field's type
    parse: Callable[[str], object] | None = None
    value: str | None = None
    renamed: tuple[str, ...] = ()


def option(
    help: str,
    *,
    flag: str | None = None,
    metavar: str | None = None,
    choices: tuple[str, ...] | None = None,
    group: str | None = None,
    default_text: str | None = None,
    variable: env.Variable[object] | None = None,  # as in Option
    parse: Callable[[str], object] | None = None,
    value: str | None = None,
    renamed: tuple[str, ...] = (),
) -> dict[str, Option]:
    """A settings field's ``metadata``: ``port: int = field(default=8000, metadata=option("port ..."))``."""
    return {_KEY: Option(help, flag, metavar, choices, group, default_text, variable, parse, value, renamed)}


@dataclass(frozen=True)
class Setting:
    """One field of a settings dataclass as the command line and the environment see it. ``kind``: ``str``,
    ``int``, ``float``, ``bool`` or ``list`` (a repeatable flag, a comma-separated variable)."""

    name: str
    kind: str
    default: object  # dataclasses.MISSING: the field is required
    option: Option
    variable: env.Variable[object]  # of the field's type

    @property
    def flag(self) -> str:
        """``--field-name``, or the option's own spelling (``""``: positional)."""
        if self.option.flag is not None:
            return self.option.flag
        return "--" + self.name.replace("_", "-")

    @property
    def default_text(self) -> str:
        """The default as ``--help`` and the docs show it ("" when there is nothing to show)."""
        return _default_text(self.option, self.default)

    @property
    def help_text(self) -> str:
        """The flag's help: what it does, its default, and its variable."""
        default = f" (default: {self.default_text})" if self.default_text else ""
        return f"{self.option.help}{default} [{self.variable.name}]"


_FAMILIES: dict[type, tuple[Setting, ...]] = {}


def settings(*, prefix: str, command: str) -> Callable[[S], S]:
    """Declare a settings dataclass's options: each field (with ``option`` metadata) is also the flag
    ``--field-name`` and the variable ``<prefix><FIELD>`` of ``command`` (declared in ``core.env``)."""

    def declare(cls: S) -> S:
        hints = typing.get_type_hints(cls)
        found = []
        for f in fields(cls):
            how = f.metadata.get(_KEY)
            if not isinstance(how, Option):
                raise TypeError(f"{cls.__name__}.{f.name}: give it metadata=option(...) (its help, flag, variable)")
            kind = _kind(hints[f.name])
            if kind == "bool" and f.default is True and not (how.flag or "").startswith("--no-"):
                raise TypeError(f"{cls.__name__}.{f.name}: a switch that is on by default needs flag='--no-...'")
            variable = how.variable or env.declare(
                env.Variable(
                    name=prefix + f.name.upper(),
                    parse=how.parse or _PARSERS[kind],
                    default=None if f.default is MISSING else f.default,
                    help=how.help,
                    value=how.value or _value(kind, how, f.name),
                    commands=(command,),
                    # The docs show the default as the flag's help does (a switch that is off: 0).
                    default_text=_default_text(how, f.default) or ("0" if f.default is False else ""),
                    origin=cls.__module__,
                )
            )
            found.append(Setting(f.name, kind, f.default, how, variable))
        _FAMILIES[cls] = tuple(found)
        return cls

    return declare


def _default_text(how: Option, default: object) -> str:
    if how.default_text is not None:
        return how.default_text
    if how.variable is not None and how.variable.default_text:
        return how.variable.default_text  # a shared variable's default, as core.env describes it
    if default is MISSING or default is None or default == () or default is False:
        return ""
    if isinstance(default, float):
        return f"{default:g}"  # 120, not 120.0
    return "1" if default is True else str(default)


def _kind(hint: object) -> str:
    """``str``, ``int``, ``float``, ``bool`` or ``list`` for a field's type (``X | None`` as ``X``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is tuple:
        return "list"
    for kind in (bool, int, float, str):  # bool first: it is an int too
        if hint is kind:
            return kind.__name__
    raise TypeError(f"a settings field must be str, int, float, bool or tuple[str, ...], not {hint}")


def _value(kind: str, how: Option, name: str) -> str:
    if how.choices:
        return "|".join(how.choices)
    if kind == "bool":
        return "1|0"
    metavar = how.metavar or ("N" if kind in ("int", "float") else name.upper())
    return f"{metavar},..." if kind == "list" else metavar


def settings_of(cls: type[DataclassInstance]) -> tuple[Setting, ...]:
    """The settings of a dataclass declared with ``@settings``, in field order."""
    try:
        return _FAMILIES[cls]
    except KeyError:
        raise TypeError(f"{cls.__name__} is not declared with @settings(prefix=..., command=...)") from None


def resolve_settings(
    cls: type[DataclassInstance], flags: Mapping[str, object], environ: Mapping[str, str] | None = None
) -> dict[str, object]:
    """The values given for the fields of a ``@settings`` dataclass: each field's flag, else its variable (in
    ``environ``, default this process's environment), else nothing (the field's default applies).

    A flag that is missing, ``None`` or an empty list was not given; a list (a repeatable flag) becomes a tuple, so
    settings stay hashable. A variable that is empty or blank was not set; otherwise it is parsed to the field's type
    (``ConfigError`` naming the variable when it does not parse).
    """
    values: dict[str, object] = {}
    for setting in settings_of(cls):
        given = flags.get(setting.name)
        if given is not None and given != []:
            values[setting.name] = tuple(given) if isinstance(given, list) else given
        elif env.raw(setting.variable, environ) is not None:
            values[setting.name] = env.get(setting.variable, environ)
    return values


@dataclass(frozen=True)
class LoaderSettings:
    """Loader tunables. ``None`` means "tune automatically for this storage" (see ``preheat.io.tuning``)."""

    threads: int | None = None
    chunk_bytes: int | None = None
    mode: str = "auto"

    @classmethod
    def from_env(cls) -> LoaderSettings:
        """Read ``PREHEAT_THREADS``, ``PREHEAT_CHUNK_BYTES`` and ``PREHEAT_LOAD_MODE``."""
        return cls(threads=env.get(env.THREADS), chunk_bytes=env.get(env.CHUNK_BYTES), mode=env.get(env.LOAD_MODE))
