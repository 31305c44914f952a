"""The `preheat` command as a user runs it: a real subprocess, real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WrittenCheckpoint

ROOT = Path(__file__).resolve().parents[1]


def preheat(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "preheat.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_load_prints_a_stage_table(sharded_checkpoint: WrittenCheckpoint) -> None:
    result = preheat("load", str(sharded_checkpoint.root), "--mode", "read", "--repeat", "2")
    assert result.returncode == 0, result.stderr
    for word in ("plan", "read", "total", "GB/s", "tensors", "runs:"):
        assert word in result.stdout


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
    assert all(row["within_bound"] for row in doc["tp"] if row["mode"] in ("read", "direct"))


def test_each_command_module_adds_exactly_the_commands_the_table_says() -> None:
    # `preheat serve ...` builds only cli_serve's parsers (a replica's start): the table must be the truth.
    import argparse
    import importlib

    from preheat.cli import COMMAND_MODULES, _build_parser

    everything = _build_parser()
    listed = next(a for a in everything._actions if isinstance(a, argparse._SubParsersAction))
    core = ("load", "convert", "verify", "info")
    assert list(listed.choices) == [*core, *(name for names in COMMAND_MODULES.values() for name in names)]
    for module, names in COMMAND_MODULES.items():
        commands = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(f"preheat.{module}").register(commands)
        assert tuple(commands.choices) == names, module


def test_a_command_line_builds_only_its_own_commands_and_still_parses_global_flags() -> None:
    from preheat.cli import _build_parser, _command_module

    assert _command_module(["-v", "serve", "./model", "--port", "0"]) == "cli_serve"
    assert _command_module(["cache", "ls"]) == "cli_store"
    assert _command_module(["verify", "./model"]) is None  # a core command: the whole parser
    assert _command_module(["--version"]) is None
    args = _build_parser("cli_serve").parse_args(["-v", "serve", "./model", "--port", "0"])
    assert (args.command, args.verbose, args.port) == ("serve", True, 0)
