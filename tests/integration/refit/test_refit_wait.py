"""The trainer's side of a synchronous RL step (``preheat.refit.Publisher``): ``publish`` then ``wait`` until N
replicas serve the version, and sharded (DTensor) state published whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from preheat.core.errors import RefitError
from preheat.engine import Engine
from preheat.refit.follower import Follower
from preheat.refit.publisher import Publisher, tensor_view
from preheat.server.following import base_digests
from preheat.testing.ports import free_port

NAME = "waited"


def replica(model: Path, registry: str) -> Follower:
    engine = Engine.from_checkpoint(str(model))
    return Follower(NAME, engine, registry=registry, base_digests=base_digests(str(model)), poll_s=0.1).start()


def test_wait_returns_the_replicas_once_they_serve_the_version(kv_model: Path, tmp_path: Path) -> None:
    registry = f"file://{tmp_path / 'registry'}"
    weights = dict(load_file(str(kv_model / "model.safetensors")))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 0.25
    with Publisher(NAME, registry=registry) as publisher:
        replicas = [replica(kv_model, registry) for _ in range(2)]
        try:
            manifest = publisher.publish(weights)
            serving = publisher.wait(manifest.version, replicas=2, timeout=60)
            assert serving == sorted(r.server.address for r in replicas if r.server is not None)
            assert [r.version for r in replicas] == [manifest.version, manifest.version]
            with pytest.raises(RefitError, match="0 of 1 replicas serve it"):
                publisher.wait(manifest.version + 1, replicas=1, timeout=0.3)  # never published
        finally:
            for r in replicas:
                r.stop()


def test_a_dtensor_state_dict_is_published_as_the_whole_tensors(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from preheat.refit.publisher import full_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        whole = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        sharded = distribute_tensor(whole, mesh, [Shard(0)])
        with Publisher(NAME, registry=f"file://{tmp_path / 'registry'}") as publisher:
            manifest = publisher.publish({"w": sharded})
            held = publisher.tensor_bytes(manifest.version, "w")
            assert held is not None
            assert bytes(held) == bytes(tensor_view(whole))
            assert manifest.tensors[0].shape == (3, 4)
        assert torch.equal(full_state_dict({"w": sharded})["w"], whole)
    finally:
        dist.destroy_process_group()
