"""A real S3 endpoint for tests: moto's standalone server on 127.0.0.1 with bucket ``models``, found by boto3 (and
so by ``S3Origin``) through ``AWS_ENDPOINT_URL``, with credentials that cannot reach anything else."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

BUCKET = "models"
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # Nothing from this machine's ~/.aws or an instance metadata service may leak into the tests.
    "AWS_CONFIG_FILE": "/nonexistent/preheat-test-aws-config",
    "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/preheat-test-aws-credentials",
    "AWS_EC2_METADATA_DISABLED": "true",
}


@contextlib.contextmanager
def moto_s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:  # Any: boto3 ships no type stubs
    """Start the server, point the environment at it, create ``BUCKET``; yield a boto3 client; stop it on exit."""
    boto3 = pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in {**AWS_TEST_ENV, "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
            monkeypatch.setenv(name, value)
        for name in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):  # either would win over the settings above
            monkeypatch.delenv(name, raising=False)
        client = boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client
    finally:
        server.stop()
