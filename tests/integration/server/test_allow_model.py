"""``--allow-model`` against an origin that decodes and resolves dot segments (``Faults.resolve_dot_segments``, as
many origins and proxies do): a model URI is matched in its normal form and the replica loads that normal form, so
``public/%2e%2e/private/...`` never loads ``private/`` under ``--allow-model 'ORIGIN/public/*'``. A real standby
replica, a real origin on 127.0.0.1."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from preheat.router.cluster import ServerProcess
from preheat.testing.fileserver import Faults, FileServer
from serving import Client


@pytest.fixture
def origin_root(kv_model: Path, tmp_path: Path) -> Path:
    """An origin holding the tiny model twice: ``public/tiny`` (allowed) and ``private/tinyc`` (not)."""
    root = tmp_path / "origin"
    shutil.copytree(kv_model, root / "public" / "tiny")
    shutil.copytree(kv_model, root / "private" / "tinyc")
    return root


def test_escaped_dot_segments_cannot_leave_the_allowed_prefix_at_an_origin_that_resolves_them(
    origin_root: Path, tmp_path: Path
) -> None:
    with FileServer(origin_root, faults=Faults(resolve_dot_segments=True)) as origin:
        base = origin.url
        # The bypass is real at this origin: it serves private/ to a URL spelt under public/.
        probe = Client(base).get("/public/%2e%2e/private/tinyc/preheat.json")
        assert probe.status == 200
        asked_before = len(origin.stats.snapshot().targets)
        cache = str(tmp_path / "cache")
        with ServerProcess("", "--standby", "--allow-model", f"{base}/public/*", "--cache-dir", cache) as server:
            admin = Client(server.url)
            for sneaky in (
                "/public/%2e%2e/private/tinyc",
                "/public/%2E%2e/private/tinyc",
                "/public/.%2e/private/tinyc",
                "/public/%2e%2e%2fprivate/tinyc",  # an escaped "/": one segment here, two at the origin
                "/public/%252e%252e/private/tinyc",  # an escaped "%": ".." at an origin that decodes twice
                "/public/..%5cprivate/tinyc",  # an escaped "\": a "/" at some origins
                "/public/tiny/%00",
            ):
                reply = admin.post("/v1/preheat/load", {"model": base + sneaky, "wait": True})
                assert reply.status == 403, (sneaky, reply.json())
                assert reply.json()["error"]["code"] == "model_not_allowed", sneaky
            assert origin.stats.snapshot().targets[asked_before:] == ()  # refused before anything was fetched

            # The allowed model, spelt another way (scheme in capitals, the default form of "t" escaped), is
            # matched in its normal form and loaded from it: the origin is asked for /public/tiny/... only.
            spelt = base.replace("http://", "HTTP://") + "/public/%74iny"
            reply = admin.post("/v1/preheat/load", {"model": spelt, "wait": True})
            assert reply.status == 200, reply.json()
            assert reply.json()["model"] == "tiny"
            asked = origin.stats.snapshot().targets[asked_before:]
            assert asked
            assert all(target.startswith("/public/tiny/") for target in asked), asked
            assert admin.post("/v1/completions", {"prompt": "Hello", "max_tokens": 2}).status == 200
