"""Choosing the next token and knowing when to stop: ``SamplingParams``, the sampler, and stop strings.

Pure over tensors and strings; the engine calls them once per generated token.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch

from preheat.core.errors import RequestError


@dataclass
class SamplingParams:
    """How to pick tokens (the OpenAI request fields of the same names).

    ``temperature == 0`` is greedy (``top_p`` and ``seed`` are then irrelevant); a ``seed`` makes sampling
    reproducible for the same prompt and model; ``stop`` strings end generation and are not part of the text.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        """``RequestError`` naming the first field out of range."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise RequestError(f"temperature must be a number between 0 and 100 (got {self.temperature!r})")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be a number in (0, 1] (got {self.top_p!r})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError(f"stop must be a list of non-empty strings (got {self.stop!r})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise RequestError(f"seed must be an integer (got {self.seed!r})")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Sampler:
    """Picks tokens from float32 logits ``[vocab]`` with one private random generator per request."""

    def __init__(self, params: SamplingParams) -> None:
        self.temperature = float(params.temperature)
        self.top_p = float(params.top_p)
        self.generator = torch.Generator()
        # A private generator per request: seeded requests reproduce whatever else runs in the process.
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator.manual_seed(seed % 2**63)

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature == 0.0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float().cpu() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            probs = top_p_filter(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p`` (at least one); renormalise."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above each one
    sorted_probs[before >= top_p] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()


class StopStrings:
    """Finds stop strings in streamed text without ever emitting a part of one.

    Text that could still turn into a stop string (a suffix that is a prefix of one) is held back until the next
    delta settles it; ``flush`` releases it when generation ends for another reason.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was found; the text then ends before it)."""
        if not self.stops:
            return delta, False
        text = self._held + delta
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self._held = ""
            return text[: min(found)], True
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), keep, -1):
                if text.endswith(stop[:n]):
                    keep = n
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text (generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held
