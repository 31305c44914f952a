"""scripts/install_torch.sh, which `make demo`, `make test` and the engine venvs use: the CPU build of PyTorch from
its own wheel index first, the package index only as the fallback, and the download size said before either.

The script is run for real by bash; the venv's python is a stand-in that records each pip command line and answers
as a venv with or without torch would, so no wheel is downloaded.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_torch.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"

# A python that logs `-m pip ...` calls to $LOG and fails the first one when $FAIL_CPU_INDEX is set; `-c` snippets
# (the version probe, `import torch`) answer from $HAVE_TORCH, which a successful pip install creates.
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -m && $2 == pip ]]; then
  echo "${@:3}" >>"$LOG"
  if [[ -n ${FAIL_CPU_INDEX:-} && " $* " == *" --index-url "* ]]; then echo "ERROR: no route to host" >&2; exit 1; fi
  echo 2.13.0 >"$HAVE_TORCH"; exit 0
fi
if [[ $1 == -c ]]; then
  [[ -f $HAVE_TORCH ]] || exit 1
  cat "$HAVE_TORCH"; exit 0
fi
exit 3
"""


def run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "pip.log"
    full = {**os.environ, "LOG": str(log), "HAVE_TORCH": str(tmp_path / "torch-version"), **env}
    full.pop("TORCH_INDEX", None)
    done = subprocess.run(
        ["bash", str(SCRIPT), str(python), "2.13.0"], capture_output=True, text=True, env=full, timeout=60, check=False
    )
    return done, log.read_text().splitlines() if log.exists() else []


def test_the_cpu_wheel_index_is_asked_first_and_its_size_is_said(tmp_path: Path) -> None:
    done, calls = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert len(calls) == 1
    assert f"--index-url {CPU_INDEX} torch==2.13.0" in calls[0]
    assert "CPU build (~190 MB download)" in done.stdout


def test_an_unreachable_cpu_index_falls_back_to_the_package_index_and_says_what_that_costs(tmp_path: Path) -> None:
    done, calls = run(tmp_path, FAIL_CPU_INDEX="1")
    assert done.returncode == 0, done.stderr
    assert len(calls) == 2
    assert "--index-url" in calls[0]
    assert "--index-url" not in calls[1]
    assert "torch==2.13.0" in calls[1]
    assert "no route to host" in done.stdout  # the reason, not a silent switch
    if os.uname().sysname == "Linux" and os.uname().machine == "x86_64":
        assert "CUDA build" in done.stdout


def test_a_venv_that_has_the_version_installs_nothing(tmp_path: Path) -> None:
    (tmp_path / "torch-version").write_text("2.13.0+cpu\n")
    done, calls = run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert calls == []
    assert "already in" in done.stdout
