"""``preheat serve --peer`` and ``preheat serve preheat://NAME``: two real servers, one pulling from the other."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from preheat.checkpoint.manifest import MANIFEST_NAME
from preheat.peer.registry import FileRegistry
from preheat.router.cluster import ServerProcess


def wait_for_line(process: ServerProcess, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in process.lines if text in line]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never printed: {process.lines[-5:]}")


def get_json(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return dict(json.loads(response.read()))


def test_a_new_replica_pulls_from_a_serving_peer_then_serves_as_one(kv_model: Path, tmp_path: Path) -> None:
    registry = f"file://{tmp_path / 'registry'}"
    identity = json.loads((kv_model / MANIFEST_NAME).read_bytes())["identity"]
    common = ("--registry", registry, "--peer")
    # The first peer listens on every interface, so it needs the fleet's token; the API stays on loopback.
    env = {**os.environ, "PREHEAT_PEER_TOKEN": "fleet-secret", "PREHEAT_PEER_ADVERTISE": "127.0.0.1"}
    with ServerProcess(
        str(kv_model), "--served-model-name", "tiny", "--peer-host", "0.0.0.0", *common, env=env
    ) as first:
        first.wait_ready()
        line = wait_for_line(first, "peer serving")
        first_address = line.split(" on ", 1)[1].split(",", 1)[0]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://{first_address}/peer/v1/info", timeout=10)
        assert refused.value.code == 401
        cache = str(tmp_path / "cache")
        with ServerProcess("preheat://tiny", "--cache-dir", cache, *common, env=env) as second:
            second.wait_ready()
            wait_for_line(second, "peer serving")
            timeline = get_json(second.url + "/v1/preheat/timeline")
            fetch = next(s for s in timeline["stages"] if s["name"] == "fetch")  # type: ignore[attr-defined]
            assert fetch["detail"]["sources"] == {f"peer {first_address}": fetch["bytes"]}
            assert fetch["detail"]["key"] == identity
            # The newcomer is a peer now too: a third replica would find both.
            assert len(FileRegistry(str(tmp_path / "registry")).find("tiny")) == 2
            request = urllib.request.Request(
                second.url + "/v1/completions",
                data=json.dumps({"prompt": "Hello", "max_tokens": 2}).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
        with urllib.request.urlopen(first.url + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        sent = next(line for line in metrics.splitlines() if line.startswith("preheat_peer_bytes_sent_total "))
        assert float(sent.split()[1]) >= fetch["bytes"]
        assert "preheat_peer_registry_up 1.0" in metrics
        # A clean shutdown withdraws the entry at once instead of waiting for its TTL.
        assert [e.address for e in FileRegistry(str(tmp_path / "registry")).find("tiny")] == [first_address]
