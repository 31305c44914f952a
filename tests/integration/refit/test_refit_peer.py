"""``preheat serve preheat://NAME --follow``: a replica that got its weights from a warm peer follows the trainer
that publishes NAME's versions, and answers exactly as a fresh engine loaded from a checkpoint of that version."""

from __future__ import annotations

from pathlib import Path

import pytest

from preheat.engine import Engine, SamplingParams
from preheat.router.cluster import ServerProcess
from refit_trainer import NAME, Trainer
from serving import Client

pytestmark = pytest.mark.slow  # a trainer and two replicas on a 2-core machine: ~30 s

PROMPT = "The capital of France is"


def test_a_replica_pulled_from_a_peer_follows_the_trainer(kv_model: Path, tmp_path: Path) -> None:
    registry = f"file://{tmp_path / 'registry'}"
    trainer = Trainer(kv_model, registry, tmp_path / "versions")
    try:
        with ServerProcess(
            str(kv_model), "--served-model-name", NAME, "--peer", "--registry", registry, "--max-model-len", "256"
        ) as seed:
            seed.wait_ready(timeout=120)
            with ServerProcess(
                f"preheat://{NAME}", "--cache-dir", str(tmp_path / "cache"), "--registry", registry, "--follow",
                "--max-model-len", "256",
            ) as follower:  # fmt: skip
                follower.wait_ready(timeout=120)
                client = Client(follower.url)
                assert client.get("/health").json()["version"] == 0
                version, _, _ = trainer.publish(0.1)
                answer = client.post("/v1/preheat/refit", {"version": version, "wait": True, "timeout": 60})
                assert answer.status == 200, answer.body
                assert client.get("/v1/models").json()["data"][0]["version"] == version
                completion = client.post(
                    "/v1/completions", {"model": NAME, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
                )
                assert completion.status == 200
                assert completion.headers["X-Preheat-Version"] == str(version)
                engine = Engine.from_checkpoint(str(trainer.reference(version)), max_model_len=256)
                ids = engine.encode_prompt(PROMPT)
                want = "".join(s.text for s in engine.generate(ids, SamplingParams(max_tokens=6, temperature=0)))
                assert completion.json()["choices"][0]["text"] == want
    finally:
        trainer.close()
