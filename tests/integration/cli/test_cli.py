"""The `preheat` command as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoints import WrittenCheckpoint

ROOT = Path(__file__).resolve().parents[3]


def preheat(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preheat.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_load_prints_a_stage_table(sharded_checkpoint: WrittenCheckpoint) -> None:
    result = preheat("load", str(sharded_checkpoint.root), "--mode", "read", "--repeat", "2")
    assert result.returncode == 0, result.stderr
    for word in ("plan", "read", "total", "GB/s", "tensors", "runs:"):
        assert word in result.stdout


def test_load_names_its_source_whole_on_a_narrow_terminal(sharded_checkpoint: WrittenCheckpoint) -> None:
    # A table title wraps at the table's width: the source path came out cut mid-word over three lines.
    result = subprocess.run(
        [sys.executable, "-m", "preheat.cli", "load", str(sharded_checkpoint.root), "--mode", "read"],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith(f"{sharded_checkpoint.root}: mode read, device cpu, rank 0/1")


def test_load_json_reports_each_run(sharded_checkpoint: WrittenCheckpoint) -> None:
    result = preheat(
        "load", str(sharded_checkpoint.root), "--json", "--repeat", "2", "--rank", "1", "--world-size", "2"
    )
    assert result.returncode == 0, result.stderr
    reports = json.loads(result.stdout)
    assert len(reports) == 2
    assert reports[0]["rank"] == 1
    assert reports[0]["world_size"] == 2
    assert reports[0]["mode"] == "read"  # auto picks read for a TP rank on CPU
    assert reports[0]["bytes"] < sharded_checkpoint.data_bytes


def test_custom_tp_plan_file_is_honoured(sharded_checkpoint: WrittenCheckpoint, tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"*": None}))  # replicate everything
    result = preheat(
        "load", str(sharded_checkpoint.root), "--json", "--rank", "1", "--world-size", "2", "--tp-plan", str(plan)
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)[0]["bytes"] == sharded_checkpoint.data_bytes


def test_bad_input_exits_1_with_the_file_named(tmp_path: Path) -> None:
    bogus = tmp_path / "model.safetensors"
    bogus.write_text("this is not a checkpoint")
    result = preheat("load", str(bogus))
    assert result.returncode == 1
    assert "preheat: error:" in result.stderr
    assert str(bogus) in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_chunk_size_is_a_clear_error(sharded_checkpoint: WrittenCheckpoint) -> None:
    result = preheat("load", str(sharded_checkpoint.root), "--mode", "read", "--chunk-bytes", "lots")
    assert result.returncode == 1
    assert "cannot parse size 'lots'" in result.stderr


@pytest.mark.parametrize("args", [["--help"], ["load", "--help"]])
def test_help_teaches(args: list[str]) -> None:
    result = preheat(*args)
    assert result.returncode == 0
    assert "PREHEAT_" in result.stdout or "modes:" in result.stdout
    assert "example" in result.stdout or "load" in result.stdout


def test_bench_runs_end_to_end(tmp_path: Path) -> None:
    """The loader benchmark on a tiny checkpoint: every contender either runs or says why not, and the targets and
    TP sections print. Keeps bench/load.py from rotting; its numbers are not checked (no timing asserts)."""
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "load.py"),
            "--size",
            "40MB",
            "--repeat",
            "1",
            "--tp",
            "2",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "targets" in result.stdout
    doc = json.loads(out.read_text())
    names = {row["name"] for row in doc["contenders"]}
    assert {"preheat read", "preheat mmap", "safetensors load_file (mmap)", "raw pread, 2 threads"} <= names
    # Each rank reads its slices' pages, not the file. ``within_bound`` is exact (read bytes <= page bound): a page or
    # two of incidental reads by the process (filesystem metadata evicted under CI's load) crossed it once, so the
    # test allows 1% of the file over the bound; reading the whole file would be nearly twice the bound.
    over = [row for row in doc["tp"] if row["mode"] in ("read", "direct")
            and row["disk_bytes"] > row["page_bound"] + row["file_bytes"] // 100]  # fmt: skip
    assert not over, over


def test_each_command_module_adds_exactly_the_commands_the_table_says() -> None:
    # `preheat serve ...` builds only cli_serve's parsers (a replica's start): the table must be the truth.
    import argparse
    import importlib

    from preheat.cli.main import COMMAND_MODULES, _build_parser

    everything = _build_parser()
    listed = next(a for a in everything._actions if isinstance(a, argparse._SubParsersAction))
    core = ("load", "convert", "verify", "info")
    assert list(listed.choices) == [*core, *(name for names in COMMAND_MODULES.values() for name in names)]
    for module, names in COMMAND_MODULES.items():
        commands = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"preheat.cli.{module}").register(commands)
        assert tuple(commands.choices) == names, module


def test_a_command_line_builds_only_its_own_commands_and_still_parses_global_flags() -> None:
    from preheat.cli.main import _build_parser, _command_module

    assert _command_module(["-v", "serve", "./model", "--port", "0"]) == "serve"
    assert _command_module(["cache", "ls"]) == "store"
    assert _command_module(["verify", "./model"]) is None  # a core command: the whole parser
    assert _command_module(["--version"]) is None
    args = _build_parser("serve").parse_args(["-v", "serve", "./model", "--port", "0"])
    assert (args.command, args.verbose, args.port) == ("serve", True, 0)


# -- one CLI: the same spelling, metavar and type for the same thing in every command ------------------------------
# One spelling for different things, each explained by its command's --help: the exceptions to "same flag, same form".
HOMONYMS = {
    "--standby": "serve: this replica starts as a standby; router: a standby's URL; up: how many standbys to start",
    "--peer": "serve: be a peer (a switch); artifacts pull: a peer to ask (HOST:PORT)",
    "--version": "preheat: print the version; refit publish: the weights version to publish",
    "--policy": "router and up: the routing policy; simulate: a scaling policy (warm pool, scale-to-zero, ...)",
}
# Same thing, same metavar, but each command accepts its own set of values.
CHOICES_DIFFER = {"--dtype": "convert stores keep/bf16/fp16/fp8/int8, refit publish casts to bf16/fp16/fp32"}
# Spellings of one thing: the first is its name in every command; the others may only be hidden, renamed aliases.
SYNONYMS = [
    ("--kv-chunk-tokens", "--chunk-tokens", "--chunk"),
    ("--kv-secret-file", "--secret-file"),
    ("--peer-token", "--token"),
    ("--cache-dir", "--cache", "--cache-root"),
    ("--gpu-cost-per-hour", "--gpu-cost", "--cost-per-hour"),
    ("--api-key", "--key-file", "--token"),
]
# What a command acts on is positional (`kv ls URL`, `simulate TRACE`), never one of these options.
NOT_OPTIONS = ("--url", "--uri", "--trace", "--path", "--source", "--src", "--dst")


def _commands() -> list[tuple[str, argparse.ArgumentParser]]:
    from preheat.cli.main import _build_parser

    def walk(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, argparse.ArgumentParser]]:
        found = [(path, parser)]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += walk(sub, f"{path} {name}".strip())
        return found

    return walk(_build_parser(), "")


def _visible_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help is not argparse.SUPPRESS]


def _form(action: argparse.Action) -> tuple[str, str, str]:
    """What a user sees and gets: the metavar as --help prints it, the value's type, and how it is stored."""
    metavar = argparse.HelpFormatter("preheat")._format_args(action, action.dest.upper()) if action.nargs != 0 else ""
    kind = getattr(action.type, "__name__", str(action.type))
    return metavar, kind, type(action).__name__


def test_a_flag_has_one_metavar_and_type_in_every_command() -> None:
    uses: dict[str, dict[str, tuple[tuple[str, str, str], object]]] = {}
    for path, parser in _commands():
        for action in _visible_options(parser):
            for flag in action.option_strings:
                uses.setdefault(flag, {})[path] = (_form(action), action.choices)
    shared = {flag: by_command for flag, by_command in uses.items() if len(by_command) > 1 and flag not in HOMONYMS}
    assert {"--cache-dir", "--api-key", "--threads"} <= set(shared)  # the walk sees every command
    for flag, by_command in shared.items():
        forms = {form for form, _ in by_command.values()}
        assert len(forms) == 1, f"{flag} differs between commands: {by_command}"
        if flag not in CHOICES_DIFFER:
            choices = {str(choice) for _, choice in by_command.values()}
            assert len(choices) == 1, f"{flag} accepts different values in different commands: {by_command}"


def test_one_thing_has_one_flag_name_everywhere() -> None:
    for path, parser in _commands():
        visible = {flag for action in _visible_options(parser) for flag in action.option_strings}
        for name, *others in SYNONYMS:
            spelt = visible & set(others) - {name} - set(HOMONYMS)
            if name == "--api-key":  # --token is --peer-token's old name, hidden; it never means an API key
                spelt -= {"--token"}
            assert not spelt, f"preheat {path}: {sorted(spelt)} is spelt {name} in the other commands"
        assert not visible & set(NOT_OPTIONS), f"preheat {path}: what a command acts on is a positional argument"


def test_the_old_spellings_still_work_and_say_the_new_name() -> None:
    from preheat.cli.main import _build_parser

    parser = _build_parser()
    args = parser.parse_args(["router", "--replica", "http://a:1", "--chunk-tokens", "16"])
    assert args.kv_chunk_tokens == 16
    args = parser.parse_args(["kv", "warm", "--url", "fs:///kv", "--namespace", "0" * 32, "--secret-file", "s"])
    assert (args.url, args.url_flag, args.kv_secret_file) == (None, "fs:///kv", "s")
    args = parser.parse_args(["simulate", "--trace", "t.csv", "--cold-start", "t.json"])
    assert args.trace_flag == "t.csv"
    result = preheat("kv", "ls", "--url", "fs:///nonexistent-kv-store", "--json")
    assert "--url is not needed any more: give URL alone" in result.stderr


def test_every_serve_and_router_setting_is_a_flag_of_its_name_and_a_variable_of_the_same() -> None:
    # PREHEAT_<FIELD> and --<field> are generated from one declaration: a flag named otherwise has no variable.
    from dataclasses import fields

    from preheat.router.settings import RouterSettings
    from preheat.server.settings import ServeSettings

    commands = dict(_commands())
    for command, settings, spelt_otherwise in (
        ("serve", ServeSettings, {}),
        (
            "router",
            RouterSettings,
            {
                "replicas": "--replica",
                "wake": "--no-wake",
                "hold": "--no-hold",
                "steal": "--no-steal",
            },
        ),
    ):
        flags: dict[str, list[str]] = {}
        for action in _visible_options(commands[command]):
            flags.setdefault(action.dest, []).extend(action.option_strings)
        for field in fields(settings):
            if field.name == "model" and command == "serve":
                continue  # MODEL, positional (PREHEAT_MODEL)
            spelt = spelt_otherwise.get(field.name, "--" + field.name.replace("_", "-"))
            assert spelt in flags.get(field.name, []), f"{command}: setting {field.name} is not the flag {spelt}"


def test_a_misspelt_flag_gets_the_subcommands_usage_and_the_flag_it_meant() -> None:
    result = preheat("serve", "--prot", "8000")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: preheat serve ")
    assert "preheat serve: error: unrecognized arguments: --prot (did you mean --port?)" in result.stderr
    nested = preheat("cache", "ls", "--jsno")
    assert nested.returncode == 2
    assert nested.stderr.startswith("usage: preheat cache ls ")
    assert "did you mean --json?" in nested.stderr


def test_a_hidden_old_spelling_is_never_suggested() -> None:
    from preheat.cli.common import unknown_arguments

    router = dict(_commands())["router"]
    assert unknown_arguments(router, ["--chunk-tokns=8"]).endswith("(did you mean --kv-chunk-tokens?)")


def test_every_flag_docs_cli_shows_is_a_flag_of_the_command_today() -> None:
    import re

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    block = text.split("```", 2)[1]  # the synopsis of every command
    visible = {
        flag for _, command in _commands() for action in _visible_options(command) for flag in action.option_strings
    }
    shown = {
        flag
        for line in block.splitlines()
        if not line.lstrip().startswith("vllm ")  # vLLM's own flags
        for flag in re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", line.split("#", 1)[0])
    }
    assert {"--kv-chunk-tokens", "--cache-dir"} <= shown
    assert not shown - visible, f"docs/cli.md shows flags no command has: {sorted(shown - visible)}"


def test_up_gives_the_replicas_and_the_router_one_chunk_size_and_passes_every_router_flag() -> None:
    from preheat.cli.main import _build_parser
    from preheat.cli.router import _up_arguments

    args = _build_parser().parse_args(
        ["up", "./m", "--kv-chunk-tokens", "64", "--max-model-len", "512", "--newest-version", "--no-wake"]
    )
    replica_args, router_args = _up_arguments(args)
    assert replica_args == ["--kv-chunk-tokens", "64", "--max-model-len", "512"]
    assert router_args[router_args.index("--kv-chunk-tokens") + 1] == "64"
    assert {"--newest-version", "--no-wake"} <= set(router_args)  # --newest-version was accepted, then dropped
