"""``preheat.load("s3://...")`` against moto's standalone S3 server on 127.0.0.1, spoken to with boto3."""

from __future__ import annotations

import logging
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

import preheat
from checkpoints import WrittenCheckpoint, assert_same_tensors
from netfaults import FaultProxy
from preheat.core.errors import CheckpointError, SourceAccessError, SourceError, SourceNotFoundError
from preheat.sources import open_origin
from preheat.sources.s3 import S3Origin, parse_s3_uri
from preheat.sources.stats import TOTALS
from s3moto import AWS_TEST_ENV, BUCKET, moto_s3

boto3 = pytest.importorskip("boto3")

MiB = 1 << 20


@pytest.fixture(scope="module")
def endpoint(
    single_checkpoint: WrittenCheckpoint, sharded_checkpoint: WrittenCheckpoint, wide_checkpoint: WrittenCheckpoint
) -> Iterator[str]:
    """A moto S3 server holding the shared checkpoints under ``s3://models/{single,sharded,wide}/``: plain Hugging
    Face directories without ``preheat.json``, so loads pass ``verify=False`` (checked loads: test_load_verify.py)."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto logs every request otherwise
    with pytest.MonkeyPatch.context() as patch, moto_s3(patch) as client:
        for prefix, written in (
            ("single", single_checkpoint),
            ("sharded", sharded_checkpoint),
            ("wide", wide_checkpoint),
        ):
            for path in written.root.iterdir():
                client.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
        yield str(client.meta.endpoint_url)


@pytest.fixture(autouse=True)
def aws_env(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Point boto3 at moto through ``AWS_ENDPOINT_URL``, as a user would."""
    for name, value in AWS_TEST_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "PREHEAT_HTTP_TIMEOUT", "PREHEAT_HTTP_RETRIES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    return endpoint


def test_single_file_checkpoint_from_s3_equals_written(single_checkpoint: WrittenCheckpoint) -> None:
    assert_same_tensors(preheat.load(f"s3://{BUCKET}/single", verify=False), single_checkpoint.tensors)


def test_sharded_checkpoint_from_s3_equals_written(sharded_checkpoint: WrittenCheckpoint) -> None:
    assert_same_tensors(preheat.load(f"s3://{BUCKET}/sharded/", verify=False), sharded_checkpoint.tensors)


@pytest.mark.parametrize("name", ["single", "sharded"])
def test_tp_rank_from_s3_equals_local_rank(name: str, request: pytest.FixtureRequest) -> None:
    written: WrittenCheckpoint = request.getfixturevalue(f"{name}_checkpoint")
    for rank in range(2):
        remote = preheat.load(f"s3://{BUCKET}/{name}", rank=rank, world_size=2, verify=False)
        assert_same_tensors(remote, preheat.load(written.root, mode="read", rank=rank, world_size=2))


def test_missing_prefix_names_the_uri() -> None:
    with pytest.raises(CheckpointError, match="s3://models/no-such-model"):
        preheat.load(f"s3://{BUCKET}/no-such-model")


def test_missing_shard_named_in_the_index_is_not_found(sharded_checkpoint: WrittenCheckpoint, endpoint: str) -> None:
    client = boto3.client("s3", endpoint_url=endpoint)
    shards = sorted(p.name for p in sharded_checkpoint.root.glob("*-of-*.safetensors"))
    for path in sharded_checkpoint.root.iterdir():
        if path.name != shards[1]:
            client.upload_file(str(path), BUCKET, f"gappy/{path.name}")
    with pytest.raises(SourceNotFoundError, match=f"s3://models/gappy/{shards[1]}"):
        preheat.load(f"s3://{BUCKET}/gappy")


def test_exists_and_read_bytes(single_checkpoint: WrittenCheckpoint) -> None:
    origin = S3Origin(f"s3://{BUCKET}/single")
    assert origin.exists("model.safetensors")
    assert not origin.exists("preheat.json")
    assert origin.read_bytes("config.json") == (single_checkpoint.root / "config.json").read_bytes()
    with pytest.raises(SourceNotFoundError, match=r"s3://models/single/missing\.json"):
        origin.read_bytes("missing.json")
    with pytest.raises(SourceNotFoundError):
        S3Origin("s3://no-such-bucket/x").read_bytes("config.json")


def test_readv_stops_at_end_of_object(single_checkpoint: WrittenCheckpoint) -> None:
    want = single_checkpoint.single_file.read_bytes()
    source = S3Origin(f"s3://{BUCKET}/single").open("model.safetensors")
    a, b = bytearray(10), bytearray(100)
    assert source.readv(len(want) - 50, [memoryview(a), memoryview(bytearray()), memoryview(b)]) == 50
    assert bytes(a) + bytes(b[:40]) == want[-50:]
    assert source.readv(len(want), [memoryview(a)]) == 0


def _set_auth(endpoint: str, free_requests: str) -> None:
    """moto's switch for enforcing IAM: after ``free_requests`` more requests, every request must be authorised."""
    control = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=free_requests.encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with urllib.request.urlopen(control, timeout=10) as answer:
        answer.read()


def test_access_denied_is_a_clear_error(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    iam = boto3.client("iam", endpoint_url=endpoint)
    iam.create_user(UserName="nobody")
    key = iam.create_access_key(UserName="nobody")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    _set_auth(endpoint, "0")
    try:
        with pytest.raises(SourceAccessError) as caught:
            preheat.load(f"s3://{BUCKET}/single")
        # HEAD answers carry no error body (just 403); a GET names the reason.
        with pytest.raises(SourceAccessError, match=r"single/config\.json: access denied \(AccessDenied"):
            S3Origin(f"s3://{BUCKET}/single").read_bytes("config.json")
    finally:
        _set_auth(endpoint, "inf")
    message = str(caught.value)
    assert "s3://models/single/" in message
    assert "access denied (403" in message
    assert "AWS_ACCESS_KEY_ID" in message


def test_connection_dropped_mid_object_is_resumed(
    endpoint: str, wide_checkpoint: WrittenCheckpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = int(endpoint.rsplit(":", 1)[1])
    uri = f"s3://{BUCKET}/wide"
    with FaultProxy(port) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        before = TOTALS.snapshot()
        preheat.load(uri, threads=1, chunk_bytes=4 * MiB, verify=False)
        clean = TOTALS.snapshot() - before

        proxy.cut_after = 1 * MiB  # only the 4 MiB data reads carry that much on one connection
        before = TOTALS.snapshot()
        weights = preheat.load(uri, threads=1, chunk_bytes=4 * MiB, verify=False)
        dropped = TOTALS.snapshot() - before
    assert proxy.cuts_done == 1
    assert_same_tensors(weights, wide_checkpoint.tensors)
    assert dropped.retries == 1
    assert dropped.bytes == clean.bytes  # resumed from the bytes already received, not restarted


def test_dead_endpoint_fails_with_source_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(SourceError, match="s3://models/single"):
        preheat.load(f"s3://{BUCKET}/single")


def test_no_credentials_means_unsigned_requests(
    single_checkpoint: WrittenCheckpoint, endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = boto3.client("s3", endpoint_url=endpoint)
    for path in single_checkpoint.root.iterdir():
        client.upload_file(str(path), BUCKET, f"public/{path.name}", ExtraArgs={"ACL": "public-read"})
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert_same_tensors(preheat.load(f"s3://{BUCKET}/public", verify=False), single_checkpoint.tensors)


def test_s3_uris_parse_and_dispatch(tmp_path: Path) -> None:
    assert parse_s3_uri("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_uri("s3://bucket") == ("bucket", "")
    with pytest.raises(preheat.ConfigError, match="bucket"):
        parse_s3_uri("s3:///x")
    origin = open_origin(f"s3://{BUCKET}/single")
    assert isinstance(origin, S3Origin)
    assert origin.join("model.safetensors") == f"s3://{BUCKET}/single/model.safetensors"
    assert S3Origin(f"s3://{BUCKET}").join("x.json") == f"s3://{BUCKET}/x.json"
