"""``resolve_settings``: the one flags-then-environment rule behind ``preheat serve`` and ``preheat router``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from preheat.core.config import resolve_settings
from preheat.core.errors import ConfigError


@dataclass(frozen=True)
class _Demo:
    port: int = 80
    names: tuple[str, ...] = ()
    label: str | None = None


def _parse(name: str, variable: str, raw: str) -> object:
    if name == "port":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"{variable}={raw!r} is not an integer") from None
    if name == "names":
        return tuple(part.strip() for part in raw.split(","))
    return raw


def _resolve(flags: dict[str, object], env: dict[str, str]) -> dict[str, object]:
    return resolve_settings(_Demo, flags, env, prefix="DEMO_", parse=_parse)


def test_a_flag_wins_over_its_variable() -> None:
    assert _resolve({"port": 81}, {"DEMO_PORT": "82"}) == {"port": 81}


def test_a_missing_none_or_empty_list_flag_falls_back_to_the_variable() -> None:
    env = {"DEMO_PORT": " 82 ", "DEMO_NAMES": "a, b"}
    assert _resolve({"port": None, "names": []}, env) == {"port": 82, "names": ("a", "b")}


def test_a_repeated_flag_becomes_a_tuple_so_settings_stay_hashable() -> None:
    assert _resolve({"names": ["a", "b"]}, {}) == {"names": ("a", "b")}


def test_blank_variables_are_unset_and_defaults_are_left_to_the_dataclass() -> None:
    assert _resolve({}, {"DEMO_LABEL": "  ", "OTHER_PORT": "1"}) == {}


def test_a_bad_variable_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="DEMO_PORT='eighty'"):
        _resolve({}, {"DEMO_PORT": "eighty"})
