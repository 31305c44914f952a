"""Does a converted SmolLM2 still predict like the original? Greedy next-token predictions of a Llama skeleton over
the prompts in tests/data/prompts.txt, for each weight set, and how often two sets agree (the converted checkpoints
themselves come from ``preheat.testing.smollm2``)."""

from __future__ import annotations

from pathlib import Path

import torch

import preheat

PROMPTS = Path(__file__).parent / "data" / "prompts.txt"


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
