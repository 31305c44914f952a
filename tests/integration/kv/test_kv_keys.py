"""The portable KV chunk keys (docs/kv-keys.md): deterministic everywhere, chained, seeded by the fingerprint."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given

from preheat.core.errors import KVError
from preheat.kv.keys import cacheable_chunks, chunk_keys, fingerprint
from strategies import token_ids

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 16, "dtype": "F32"}
FP = fingerprint(identity="model-a", layout=LAYOUT, chunk_tokens=4)
tokens = token_ids(max_size=64)


def test_known_vector_is_stable_across_releases() -> None:
    # A fixed vector: if this changes, every stored chunk everywhere stops matching (bump KEY_VERSION on purpose).
    fp = fingerprint(identity="abc", layout={"num_layers": 1}, chunk_tokens=2)
    keys = chunk_keys(fp, [1, 2, 3, 4, 5], 2)
    assert len(fp) == 32
    assert len(keys) == 2
    assert keys == chunk_keys(fp, [1, 2, 3, 4], 2)
    assert (fp, keys) == _in_subprocess("abc", [1, 2, 3, 4, 5])


def _in_subprocess(identity: str, ids: list[int]) -> tuple[str, list[str]]:
    code = (
        "from preheat.kv.keys import fingerprint, chunk_keys\n"
        f"fp = fingerprint(identity={identity!r}, layout={{'num_layers': 1}}, chunk_tokens=2)\n"
        f"print(fp); print(','.join(chunk_keys(fp, {ids!r}, 2)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    fp, keys = out.split()
    return fp, keys.split(",")


@given(tokens, tokens)
def test_a_key_names_its_chunk_and_every_token_before_it(a: list[int], b: list[int]) -> None:
    ka, kb = chunk_keys(FP, a, 4), chunk_keys(FP, b, 4)
    for i, (x, y) in enumerate(zip(ka, kb, strict=False)):
        assert (x == y) == (a[: 4 * (i + 1)] == b[: 4 * (i + 1)])


@given(tokens)
def test_only_full_chunks_have_keys(ids: list[int]) -> None:
    assert len(chunk_keys(FP, ids, 4)) == len(ids) // 4
    assert chunk_keys(FP, ids, 4, limit=1) == chunk_keys(FP, ids, 4)[:1]


@pytest.mark.parametrize(
    "change",
    [
        {"identity": "model-b"},
        {"layout": {**LAYOUT, "dtype": "BF16"}},
        {"layout": {**LAYOUT, "num_kv_heads": 4}},
        {"kv_dtype": "int8"},
        {"tp_rank": 1, "tp_size": 2},
        {"chunk_tokens": 8},
        {"rope": {"theta": 500000.0}},
    ],
)
def test_anything_that_changes_kv_bytes_changes_every_key(change: dict[str, object]) -> None:
    base: dict[str, object] = {"identity": "model-a", "layout": LAYOUT, "chunk_tokens": 4}
    other = fingerprint(**{**base, **change})  # type: ignore[arg-type]
    assert other != FP
    ids = list(range(16))
    assert not set(chunk_keys(other, ids, 4)) & set(chunk_keys(FP, ids, 4))


def test_the_last_prompt_token_is_never_cached() -> None:
    assert [cacheable_chunks(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


@pytest.mark.parametrize("bad", [[-1], [2**32], ["x"]])
def test_bad_token_ids_are_a_clear_error(bad: list[object]) -> None:
    with pytest.raises(KVError, match="token ids"):
        chunk_keys(FP, bad * 4, 4)  # type: ignore[arg-type]


def test_bad_fingerprints_and_sizes_are_refused() -> None:
    with pytest.raises(KVError, match="32 hex"):
        chunk_keys("abc", [1, 2], 1)
    with pytest.raises(KVError, match="chunk size"):
        chunk_keys(FP, [1, 2], 0)
    with pytest.raises(KVError, match="identity"):
        fingerprint(identity="", layout=LAYOUT)
    with pytest.raises(KVError, match="TP rank"):
        fingerprint(identity="a", layout=LAYOUT, tp_rank=2, tp_size=2)
