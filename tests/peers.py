"""Seed peers as real child processes (``python -m preheat.peer DIR``) and a small checkpoint worth striping."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import torch

from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint

# About 6.6 MB of float32 in 21 tensors of 64 KiB to 1 MiB: big enough to stripe, quick to move at a few MB/s.
STRIPED = LlamaShape(1024, 256, 512, 2, 4, 2)


def write_peer_checkpoint(root: Path, *, seed: int = 0) -> Path:
    """A checkpoint with a ``preheat.json`` (so it has an identity peers can announce)."""
    write_llama_checkpoint(root, STRIPED, dtype=torch.float32, seed=seed)
    (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())
    return root


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


class SeedPeer:
    """``python -m preheat.peer ROOT`` on a free port; ``address`` is ``host:port``; always stopped on exit."""

    def __init__(self, root: Path, *extra: str, token: str | None = None) -> None:
        env = dict(os.environ)
        env.pop("PREHEAT_PEER_TOKEN", None)
        if token is not None:
            env["PREHEAT_PEER_TOKEN"] = token
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preheat.peer", str(root), *extra],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " at " not in line:
            self.stop()
            raise RuntimeError(f"seed peer did not start: {line!r}")
        self.address = line.rsplit(" at ", 1)[1].strip()

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen peer must be able to take its SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> SeedPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
