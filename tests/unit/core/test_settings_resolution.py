"""``resolve_settings``: the one flags-then-environment rule behind ``preheat serve`` and ``preheat router``, over
settings declared once (``@settings`` and ``option``: the flag and the variable come from the field)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from preheat.core import env
from preheat.core.config import option, resolve_settings, settings, settings_of
from preheat.core.errors import ConfigError


@settings(prefix="DEMO_", command="demo")
@dataclass(frozen=True)
class _Demo:
    port: int = field(default=80, metadata=option("port; 0 picks a free one"))
    names: tuple[str, ...] = field(default=(), metadata=option("names (repeatable)", metavar="NAME"))
    label: str | None = field(default=None, metadata=option("a label", default_text="none"))
    shared: str | None = field(default=None, metadata=option("the node cache", variable=env.CACHE_DIR))
    on: bool = field(default=True, metadata=option("turn it off", flag="--no-on"))


def _resolve(flags: dict[str, object], environ: dict[str, str]) -> dict[str, object]:
    return resolve_settings(_Demo, flags, environ)


def test_a_flag_wins_over_its_variable() -> None:
    assert _resolve({"port": 81}, {"DEMO_PORT": "82"}) == {"port": 81}


def test_a_missing_none_or_empty_list_flag_falls_back_to_the_variable() -> None:
    environ = {"DEMO_PORT": " 82 ", "DEMO_NAMES": "a, b"}
    assert _resolve({"port": None, "names": []}, environ) == {"port": 82, "names": ("a", "b")}


def test_a_repeated_flag_becomes_a_tuple_so_settings_stay_hashable() -> None:
    assert _resolve({"names": ["a", "b"]}, {}) == {"names": ("a", "b")}


def test_blank_variables_are_unset_and_defaults_are_left_to_the_dataclass() -> None:
    assert _resolve({}, {"DEMO_LABEL": "  ", "OTHER_PORT": "1"}) == {}


def test_a_bad_variable_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="DEMO_PORT='eighty'"):
        _resolve({}, {"DEMO_PORT": "eighty"})
    with pytest.raises(ConfigError, match="DEMO_ON='maybe': write 1 or 0"):
        _resolve({}, {"DEMO_ON": "maybe"})


def test_a_shared_setting_reads_the_variable_core_env_declares() -> None:
    assert _resolve({}, {"PREHEAT_CACHE_DIR": "/cache", "DEMO_SHARED": "/ignored"}) == {"shared": "/cache"}
    assert _resolve({}, {"DEMO_ON": "0"}) == {"on": False}


def test_each_field_declares_its_flag_variable_and_help_with_the_default() -> None:
    port, names, label, shared, on = settings_of(_Demo)
    assert (port.flag, port.variable.name, port.kind) == ("--port", "DEMO_PORT", "int")
    assert port.help_text == "port; 0 picks a free one (default: 80) [DEMO_PORT]"
    assert (names.kind, names.variable.value) == ("list", "NAME,...")
    assert label.help_text == "a label (default: none) [DEMO_LABEL]"
    assert shared.variable is env.CACHE_DIR
    assert (on.flag, on.variable.value) == ("--no-on", "1|0")


def test_a_field_without_its_option_is_refused_at_declaration() -> None:
    with pytest.raises(TypeError, match="metadata=option"):

        @settings(prefix="BAD_", command="demo")
        @dataclass(frozen=True)
        class _Bad:
            port: int = 80
