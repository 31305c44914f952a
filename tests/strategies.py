"""The Hypothesis strategies shared by the property tests, and their budget: one definition of "any JSON value",
"a hostile integer", "token ids", so every parser is fuzzed with the same input.

Budgets: every property test that takes ``FUZZ`` runs 300 examples with no deadline, which keeps each file to seconds
on two cores; a hang is caught by the suite's per-test timeout, never by a timing assert.
``PREHEAT_FUZZ_EXAMPLES=20000`` fuzzes longer by hand.

Strategies used by one test file only stay in that file.
"""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=int(os.environ.get("PREHEAT_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# Characters that matter to JSON parsers and to our scanners: brackets, quotes, escapes, digits, and non-ASCII.
TRICKY = st.sampled_from([*'[]{}",:\\/ \n\t0123456789-+.eEabnrtfu', "\u00e9", "\u2028", "\U0001f600", "\x00"])
tricky_text = st.text(TRICKY, max_size=40)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | tricky_text
# Python's json writes NaN and Infinity as bare words, and lenient readers take them: a parser must refuse them.
nonfinite = st.sampled_from([float("nan"), float("inf"), float("-inf")])


def json_values(max_leaves: int = 30, *, allow_nonfinite: bool = False) -> st.SearchStrategy[Any]:  # Any: any JSON
    """Any JSON value, nested a few levels, with strings full of brackets and escapes; ``allow_nonfinite``: floats may
    also be NaN or +-Infinity (what ``json.dumps`` writes for them)."""
    leaves = scalars | nonfinite if allow_nonfinite else scalars
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(tricky_text, inner, max_size=5),
        max_leaves=max_leaves,
    )


def huge_ints() -> st.SearchStrategy[int]:
    """Integers a hostile sender may write: negative, 2**63 and past it, hundreds of digits."""
    return st.sampled_from([-1, 2**63 - 1, 2**63, 2**64, 10**100, -(10**100)]) | st.integers()


def token_ids(max_size: int = 64) -> st.SearchStrategy[list[int]]:
    """Token ids as tokenizers hand them out: any unsigned 32-bit integer, up to ``max_size`` of them."""
    return st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=max_size)


def containers(value: object) -> int:
    """How many arrays and objects ``value`` holds, itself included."""
    if isinstance(value, list):
        return 1 + sum(containers(v) for v in value)
    if isinstance(value, dict):
        return 1 + sum(containers(v) for v in value.values())
    return 0


def depth(value: object) -> int:
    """How deeply ``value`` nests arrays and objects (a scalar: 0, ``[]``: 1)."""
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


# What moves a tokenizer's splits: runs of spaces and newlines, special tokens, digits, non-ASCII, punctuation.
FRAGMENTS = ["hello", " world", " ", "  ", "\n", "\n\n", "\t", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im",
             "12345", "é", "\U0001f600", "'s", ".", "-", "abcdefghij" * 3]  # fmt: skip
