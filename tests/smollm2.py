"""The embedded default model, SmolLM2-135M-Instruct, converted once and kept across test runs.

Converting the GGUF costs ~25 s on 2 cores, so converted checkpoints live under ``$PREHEAT_TEST_CACHE`` (default
``~/.cache/preheat-tests``), keyed by the GGUF's digest and by the digest of the code that writes them: a change to
the converter makes a fresh conversion, never a stale pass. Each entry is published atomically by ``convert``, so a
directory that exists is complete.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

import preheat
from preheat.checkpoint import digest, gguf, manifest, quant
from preheat.checkpoint.manifest import digest_bytes, file_digest
from preheat.convert import convert, inputs
from preheat.convert import pipeline as convert_module
from preheat.core.errors import ConfigError
from preheat.sources.embedded import find_smollm2_gguf
from preheat.store import locks

PROMPTS = Path(__file__).parent / "data" / "prompts.txt"


def cache_root() -> Path:
    return Path(os.environ.get("PREHEAT_TEST_CACHE", Path.home() / ".cache" / "preheat-tests"))


def gguf_path() -> str:
    """The installed GGUF, or skip the calling test with the reason and the fix."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("GGUF conversion needs transformers, gguf and accelerate: pip install 'preheat[gguf]'")
    try:
        return find_smollm2_gguf()
    except ConfigError as exc:
        pytest.skip(f"SmolLM2 is not installed ({exc})")


class SmolLM2:
    """Converted SmolLM2 checkpoints by dtype: ``keep`` straight from the GGUF, the others from ``keep``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}

    def path(self, dtype: str = "keep") -> Path:
        if dtype not in self._paths:
            self._paths[dtype] = self._convert(dtype)
        return self._paths[dtype]

    def _convert(self, dtype: str) -> Path:
        source = gguf_path()
        code = b"".join(
            Path(m.__file__ or "").read_bytes() for m in (convert_module, digest, gguf, inputs, manifest, quant)
        )
        key = f"{file_digest(source)[9:25]}-{digest_bytes(code)[9:21]}"
        target = self.root / f"smollm2-{key}-{dtype}"
        if (target / "preheat.json").is_file():
            return target
        src = source if dtype == "keep" else str(self.path("keep"))
        self.root.mkdir(parents=True, exist_ok=True)
        # Test workers (pytest -n) share this cache: one converts, the others wait and reuse it.
        with locks.exclusive(str(self.root / f".smollm2-{dtype}.lock")):
            if not (target / "preheat.json").is_file():
                for stale in self.root.glob(f"smollm2-*-{dtype}"):
                    if stale != target and ".tmp-" not in stale.name:
                        shutil.rmtree(stale, ignore_errors=True)
                convert(src, target, dtype=dtype, force=True)
        return target


def prompts() -> list[str]:
    return [line for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]


class Predictor:
    """One Llama skeleton (built from a checkpoint's config.json) reused for every weight set: greedy top-1
    next-token predictions at every position of every prompt, batched with right padding."""

    def __init__(self, checkpoint: Path) -> None:
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(LlamaConfig.from_pretrained(checkpoint))
        self.model.train(False)  # inference: no dropout
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        tokenizer.padding_side = "right"
        batch = tokenizer(prompts(), return_tensors="pt", padding=True)
        self.ids, self.mask = batch["input_ids"], batch["attention_mask"]

    def predict(self, checkpoint: Path) -> list[torch.Tensor]:
        """Per prompt, the argmax token after each of its positions (with the weights of ``checkpoint``)."""
        weights = dict(preheat.load(checkpoint, dequantize=True))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        assert not unexpected, unexpected
        assert set(missing) <= {"lm_head.weight"}, missing  # tied to the embedding, as config.json says
        self.model.tie_weights()
        with torch.no_grad():
            logits = self.model(input_ids=self.ids, attention_mask=self.mask).logits
        top = logits.argmax(-1)
        return [top[i, : int(self.mask[i].sum())] for i in range(len(top))]


def agreement(reference: list[torch.Tensor], other: list[torch.Tensor]) -> tuple[float, float]:
    """(share of prompts whose next token after the whole prompt agrees, share of all positions that agree)."""
    last = sum(int(a[-1] == b[-1]) for a, b in zip(reference, other, strict=True)) / len(reference)
    every = torch.cat([a == b for a, b in zip(reference, other, strict=True)]).float().mean().item()
    return last, every
