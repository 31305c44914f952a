"""One settings source: every variable preheat reads is declared once in ``preheat.core.env``, read only there, and
the docs' table of them is what that declaration generates."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from preheat.core import env
from preheat.core.config import settings_of
from preheat.core.errors import ConfigError
from preheat.router.settings import RouterSettings
from preheat.server.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "preheat"
ENV_MODULE = SRC / "core" / "env.py"
ENVIRONMENT_MD = ROOT / "docs" / "environment.md"
# Reading or changing the process's environment, any spelling of it.
_OS_ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
# A variable's name in a string; "PREHEAT_ROUTER_*" and "PREHEAT_<FLAG>" are patterns, not names.
_NAME = re.compile(r"PREHEAT_[A-Z0-9_]*[A-Z0-9](?![A-Za-z0-9_*<])")


def _modules() -> list[tuple[str, ast.Module]]:
    return [(p.relative_to(SRC).as_posix(), ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


def test_only_core_env_touches_the_process_environment() -> None:
    # No allow-list: a child's environment starts from env.snapshot(), a library's variable is set by env.put or
    # env.set_default, so nothing outside core/env.py needs os.environ.
    found = []
    for where, tree in _modules():
        if where == "core/env.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in _OS_ENVIRONMENT:
                if isinstance(node.value, ast.Name) and node.value.id in ("os", "posix"):
                    found.append(f"{where}:{node.lineno}: os.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix"):
                names = [a.name for a in node.names if a.name in _OS_ENVIRONMENT]
                found += [f"{where}:{node.lineno}: from os import {name}" for name in names]
    assert not found, "read the environment through preheat.core.env (declare the variable there):\n" + "\n".join(found)


def test_every_variable_the_code_names_is_declared() -> None:
    declared = {v.name for v in env.every_variable()}
    named = {
        (name, where)
        for where, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for name in _NAME.findall(node.value)
    }
    assert {"PREHEAT_THREADS", "PREHEAT_ROUTER_REPLICAS"} <= {name for name, _ in named}  # the scan sees them
    undeclared = sorted((name, where) for name, where in named if name not in declared)
    assert not undeclared, f"named in the code but not declared in preheat/core/env.py: {undeclared}"


def test_every_serve_and_router_setting_is_a_declared_variable() -> None:
    declared = {v.name: v for v in env.every_variable()}
    for settings, prefix in ((ServeSettings, "PREHEAT_"), (RouterSettings, "PREHEAT_ROUTER_")):
        for setting in settings_of(settings):
            assert setting.variable.name == prefix + setting.name.upper()
            assert declared[setting.variable.name] is setting.variable


def test_the_docs_table_is_the_generated_one() -> None:
    text = ENVIRONMENT_MD.read_text(encoding="utf-8")
    begin, end = text.index("<!-- BEGIN generated"), text.index("<!-- END generated -->")
    table = text[text.index("\n", begin) + 1 : end]
    assert table == env.markdown(), "docs/environment.md is stale: python -m preheat.core.env --markdown prints it"
    assert "(environment.md)" in (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")


def test_the_module_prints_the_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "preheat.core.env", "--markdown"], capture_output=True, text=True, check=True
    )
    assert result.stdout == env.markdown()
    assert "| `PREHEAT_KV_L2` |" in result.stdout  # a serve setting's
    assert "| `VLLM_CACHE_ROOT` |" in result.stdout  # another program's


@pytest.mark.parametrize(
    ("variable", "text", "message"),
    [
        (env.THREADS, "many", "PREHEAT_THREADS='many': write a whole number of at least 1"),
        (env.THREADS, "0", "PREHEAT_THREADS='0': write a whole number of at least 1"),
        (env.CHUNK_BYTES, "lots", "PREHEAT_CHUNK_BYTES='lots': cannot parse size"),
        (env.LOAD_MODE, "turbo", "PREHEAT_LOAD_MODE='turbo': use one of auto, mmap, read, direct, gds"),
        (env.TOKENIZER_PROCESS, "maybe", "PREHEAT_TOKENIZER_PROCESS='maybe': write 1 or 0"),
        (env.HTTP_TIMEOUT, "5,6,7", "PREHEAT_HTTP_TIMEOUT='5,6,7': write seconds as READ or CONNECT,READ"),
        (env.T0, "yesterday", "PREHEAT_T0='yesterday': write epoch seconds"),
    ],
)
def test_a_bad_value_is_a_config_error_naming_the_variable_and_what_to_write(
    variable: env.Variable[object], text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        env.get(variable, {variable.name: text})


def test_unset_or_blank_is_the_default_and_text_is_stripped() -> None:
    assert env.get(env.TOKENIZER_PROCESS, {}) is True
    assert env.get(env.TOKENIZER_PROCESS, {"PREHEAT_TOKENIZER_PROCESS": "  "}) is True
    assert env.get(env.TOKENIZER_PROCESS, {"PREHEAT_TOKENIZER_PROCESS": " off "}) is False
    assert env.get(env.PEERS, {"PREHEAT_PEERS": "a:1, ,b:2"}) == ("a:1", "b:2")
    assert env.get(env.CHUNK_BYTES, {"PREHEAT_CHUNK_BYTES": "16MiB"}) == 16 << 20
    assert env.raw(env.API_KEY, {"PREHEAT_API_KEY": " "}) is None


def test_values_are_read_when_asked_for_never_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_THREADS", "3")
    assert env.get(env.THREADS) == 3
    monkeypatch.setenv("PREHEAT_THREADS", "5")
    assert env.get(env.THREADS) == 5
    monkeypatch.delenv("PREHEAT_THREADS")
    assert env.get(env.THREADS) is None


def test_a_snapshot_is_the_callers_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREHEAT_API_KEY", "k")
    copy = env.snapshot()
    copy["PREHEAT_API_KEY"] = "changed"
    assert env.get(env.API_KEY) == "k"


def test_a_variable_declared_by_two_modules_is_refused() -> None:
    twin = env.Variable("PREHEAT_THREADS", env.parse_count, None, "again", "N", ("load",), origin="elsewhere")
    with pytest.raises(ValueError, match="PREHEAT_THREADS is declared twice"):
        env.declare(twin)
    assert env.THREADS in env.every_variable()


def test_help_lists_a_commands_variables_beside_its_flags() -> None:
    serve = env.help_lines("serve", skip=[s.variable.name for s in settings_of(ServeSettings)])
    assert "PREHEAT_T0" in serve
    assert "PREHEAT_TOKENIZER_PROCESS" in serve
    assert "PREHEAT_PORT" not in serve  # shown beside --port instead


def test_the_doctor_names_a_bad_thread_count_like_the_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    from preheat.doctor.check import DoctorOptions
    from preheat.doctor.node import check_threads

    monkeypatch.setenv("PREHEAT_THREADS", "many")
    with pytest.raises(ConfigError, match="PREHEAT_THREADS='many'"):
        check_threads(DoctorOptions(io=False, gpu=False), 2.0)
