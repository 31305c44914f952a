"""Resuming a pull from an S3 prefix without a manifest (moto's real S3 server): the journal pins each object's ETag,
LastModified and size, and ranged GetObjects carry IfMatch, so a replaced object is fetched again whole."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from origins import assert_entry_holds, new_version
from preheat.store import ModelCache
from preheat.store.pull import pull
from pulls import CHUNK, PullInterruptedError, interrupt_at
from s3moto import BUCKET, moto_s3

URI = f"s3://{BUCKET}/hf"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:  # Any: boto3 has no stubs
    """A moto S3 server with an empty bucket ``models``, found through ``AWS_ENDPOINT_URL``; yields a client."""
    with moto_s3(monkeypatch) as client:
        yield client


def upload(client: Any, origin: Path, replaced: dict[str, bytes] | None = None) -> None:  # Any: boto3 has no stubs
    for path in origin.iterdir():
        data = (replaced or {}).get(path.name) or path.read_bytes()
        client.put_object(Bucket=BUCKET, Key=f"hf/{path.name}", Body=data)


def test_s3_resume_over_a_replaced_object_publishes_only_the_new_bytes(
    s3: Any, hf_origin: Path, tmp_path: Path
) -> None:
    cache = ModelCache(tmp_path / "cache")
    upload(s3, hf_origin)
    with pytest.raises(PullInterruptedError):
        pull(URI, cache, threads=1, chunk_bytes=CHUNK, progress=interrupt_at(0.5))
    [journal] = (tmp_path / "cache" / "partial").glob("*/.journal")
    pin = json.loads(journal.read_text().splitlines()[0])["pin"]
    assert pin["etag"]  # S3's ETag and LastModified are pinned
    assert pin["modified"]
    newer = new_version(hf_origin, seed=4)
    upload(s3, hf_origin, newer)
    result = pull(URI, cache, threads=4, chunk_bytes=CHUNK)
    assert_entry_holds(result.path, newer)
    assert any("changed on the origin" in note for note in result.notes), result.notes


def test_s3_object_replaced_mid_pull_is_fetched_again_whole(s3: Any, hf_origin: Path, tmp_path: Path) -> None:
    upload(s3, hf_origin)
    newer = new_version(hf_origin, seed=5)
    lock, replaced = threading.Lock(), threading.Event()

    def replace_at_a_third(done: int, total: int) -> None:
        with lock:
            if done >= total / 3 and not replaced.is_set():
                upload(s3, hf_origin, newer)  # the GetObjects after this one carry an IfMatch that no longer holds
                replaced.set()

    result = pull(URI, ModelCache(tmp_path / "cache"), threads=2, chunk_bytes=CHUNK, progress=replace_at_a_third)
    assert_entry_holds(result.path, newer)
    assert replaced.is_set()
    assert any("started that file over" in note for note in result.notes), result.notes
