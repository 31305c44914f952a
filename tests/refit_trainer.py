"""A real trainer process for the refit tests (``Trainer`` starts one):
``python tests/refit_trainer.py MODEL_DIR NAME REGISTRY OUT_DIR [SIGNING_KEY]``.

It loads MODEL_DIR's weights into memory and publishes them as ``preheat.refit.Publisher`` would in a training loop,
one version per ``publish FRACTION`` line on stdin: version N perturbs a seeded random FRACTION of the tensors
(at least one) and publishes from memory. After publishing, it writes the same weights as a reference checkpoint
``OUT_DIR/vN`` (a copy of MODEL_DIR with new weights) for the tests to load a fresh replica from, then prints
``published N CHANGED_TENSORS CHANGED_BYTES TOTAL_BYTES``. ``exit`` ends it; so does SIGKILL (the tests' dead trainer).
With SIGNING_KEY (a private key from ``preheat artifacts keygen``) every version is signed. Its first line is
``ready URL EPOCH``: each trainer process publishes in an epoch of its own, later than any before it.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from preheat.refit.publisher import Publisher

if TYPE_CHECKING:
    from serving import Client

NAME = "tiny"
PROMPT = "The capital of France is"
COMPLETION = {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}  # what the replicas are asked
REFERENCE_SKIP = ("model.safetensors", "preheat.json")  # the reference has new weights and no (stale) manifest


def perturb(weights: dict[str, torch.Tensor], version: int, fraction: float) -> list[str]:
    """Change a seeded ``fraction`` of the tensors (at least one) in place; returns their names."""
    names = sorted(weights)
    rng = random.Random(version)
    chosen = rng.sample(names, max(1, round(fraction * len(names))))
    generator = torch.Generator().manual_seed(version)
    for name in chosen:
        tensor = weights[name]
        weights[name] = tensor + 0.05 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
    return chosen


def write_reference(model_dir: str, out: str, weights: dict[str, torch.Tensor]) -> None:
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(model_dir):
        if name not in REFERENCE_SKIP:
            shutil.copy(os.path.join(model_dir, name), os.path.join(out, name))
    save_file(weights, os.path.join(out, "model.safetensors"), {"format": "pt"})


def main() -> None:
    model_dir, name, registry, out_dir = sys.argv[1:5]
    signing_key = sys.argv[5] if len(sys.argv) > 5 else None
    weights = dict(load_file(os.path.join(model_dir, "model.safetensors")))
    version = 0
    with Publisher(name, registry=registry, ttl=3.0, signing_key=signing_key) as publisher:
        print(f"ready {publisher.url} {publisher.epoch}", flush=True)
        for line in sys.stdin:
            command = line.split()
            if not command or command[0] == "exit":
                break
            version += 1
            changed = perturb(weights, version, float(command[1]))
            manifest = publisher.publish(weights, version)
            write_reference(model_dir, os.path.join(out_dir, f"v{version}"), weights)
            changed_bytes = sum(weights[n].nbytes for n in changed)
            print(f"published {version} {len(changed)} {changed_bytes} {manifest.total_bytes}", flush=True)


class Trainer:
    """``tests/refit_trainer.py`` as a child process: ``publish(fraction)`` makes the next version."""

    def __init__(self, model: Path, registry: str, out: Path, *, signing_key: Path | None = None) -> None:
        self.out = out
        key = [str(signing_key)] if signing_key is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, __file__, str(model), NAME, registry, str(out), *key],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self._line()
        assert line.startswith("ready "), line
        self.url, epoch = line.split()[1:3]
        self.epoch = int(epoch)  # of every version this process publishes

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the trainer exited with code {self.proc.wait()}")
        return line.strip()

    def publish(self, fraction: float = 0.1) -> tuple[int, int, int]:
        """Publish the next version; (version, bytes changed, total bytes)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"publish {fraction}\n")
        self.proc.stdin.flush()
        _, version, _, changed_bytes, total = self._line().split()
        return int(version), int(changed_bytes), int(total)

    def reference(self, version: int) -> Path:
        """The checkpoint the trainer wrote of ``version``: what a freshly started replica would load."""
        return self.out / f"v{version}"

    def answer(self, version: int) -> str:
        """What a replica freshly started on ``version``'s checkpoint answers to ``PROMPT``: the reference."""
        from preheat.engine import Engine, SamplingParams  # not in the trainer process itself

        engine = Engine.from_checkpoint(str(self.reference(version)), max_model_len=256)
        ids = engine.encode_prompt(PROMPT)
        return "".join(s.text for s in engine.generate(ids, SamplingParams(max_tokens=6, temperature=0)))

    def kill(self) -> None:
        """SIGKILL: the trainer dies without withdrawing anything (its registry entry stays until it expires)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


def refit(client: Client, version: int, epoch: int | None = None) -> dict[str, object]:
    """``POST /v1/preheat/refit`` asking ``client``'s replica for ``version`` (of ``epoch``) and waiting for it."""
    body: dict[str, object] = {"version": version, "wait": True, "timeout": 60}
    answer = client.post("/v1/preheat/refit", body | ({"epoch": epoch} if epoch is not None else {}))
    assert answer.status == 200, answer.body
    status: dict[str, object] = answer.json()
    return status


if __name__ == "__main__":
    main()
