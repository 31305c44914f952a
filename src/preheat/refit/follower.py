"""The built-in engine's follower: ``preheat serve --follow`` (docs/refit.md).

The following itself (looking, verifying, pulling, failures) is ``preheat.refit.follow.VersionFollower``'s; here the
built-in model's part: tensors are checked against the model's names and shapes before a byte is pulled, converted
to the engine's dtype and device off the generation thread, and swapped in by ``run_between`` (the server's
generation worker runs it between two requests; ``preheat.refit.swap``). Then the engine's identity becomes the
version's, so KV chunks computed under the old weights are never looked up under the new ones, and the replica
serves the version (with the trainer's signature) to the replicas still pulling it, from its live tensors when it
computes in the dtype they were published in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from preheat.checkpoint.torch_dtypes import to_torch
from preheat.core.errors import RefitError
from preheat.peer.registry import Registry
from preheat.refit.follow import FollowOptions, RefitStats, Runner, VersionFollower, run_now
from preheat.refit.protocol import TensorEntry, VersionManifest
from preheat.refit.publisher import tensor_view
from preheat.refit.swap import ModelSlots, SwapReport, check_shapes, swap

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11; only the annotations use it

    from preheat.engine import Engine

__all__ = ["Follower", "RefitStats", "run_now"]


class Follower(VersionFollower):
    """Follows ``name``'s versions for ``engine`` (the built-in model only). ``start()`` runs it on a thread.

    ``base_digests``: from the checkpoint's ``preheat.json``. ``serve``: only when the engine computes in the dtype
    the tensors are published in are its versions offered (its live tensors are then those bytes). ``inplace``:
    swap in place with a rollback copy rather than with a double buffer (``preheat.refit.swap``). The other
    arguments are ``VersionFollower``'s.
    """

    def __init__(
        self,
        name: str,
        engine: Engine,
        *,
        registry: str | Registry,
        base_digests: Mapping[str, str] | None = None,
        run_between: Runner[SwapReport] = run_now,
        inplace: bool = False,
        on_version: Callable[[int], None] | None = None,
        **options: Unpack[FollowOptions],
    ) -> None:
        if engine.model is None:
            raise RefitError("--follow needs the built-in engine: this model runs on the transformers fallback")
        self.model = engine.model
        self.engine, self.inplace = engine, inplace
        self.owned: set[str] = set()
        super().__init__(
            name, registry=registry, base_digests=base_digests, run_between=run_between, on_version=on_version,
            **options,
        )  # fmt: skip

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        manifest = self.manifest(version)
        entry = manifest.entry(tensor) if manifest is not None else None
        if entry is None or self.have.get(tensor) != entry.digest or not self._servable():
            return None
        live = ModelSlots(self.model).get(tensor)
        if live is None or live.dtype != to_torch(entry.dtype):
            return None
        return tensor_view(live.detach().to("cpu").contiguous())

    def _servable(self) -> bool:
        manifest = self.current
        if manifest is None:
            return False
        return all(to_torch(t.dtype) == self.engine.dtype for t in manifest.tensors if t.dtype.startswith(("F", "B")))

    def _needed(self, lacking: list[TensorEntry]) -> list[TensorEntry]:
        # Names and shapes come from a holder: checked against the model before a byte is pulled (a manifest of
        # another model costs one refusal, not its tensors in memory). A tied model's lm_head is not pulled: the
        # model computes with the embedding, and replicas could not serve it to each other.
        slots = ModelSlots(self.model)
        check_shapes(slots, {e.name: e.shape for e in lacking})
        return [e for e in lacking if slots.get(e.name) is not None]

    def _prepared(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors in the engine's dtype and device, made here rather than on the generation thread (the swap
        then only rebinds); as pulled when they do not fit (the swap then goes in place)."""
        if self.inplace:
            return tensors
        model = self.model
        try:
            return {
                n: t if t.dtype == model.dtype and t.device == model.device else t.to(model.device, model.dtype)
                for n, t in tensors.items()
            }
        except torch.OutOfMemoryError:
            return tensors

    def _install(self, manifest: VersionManifest, tensors: dict[str, torch.Tensor]) -> SwapReport:
        """On the generation thread, between two requests: swap, then switch identity and version together."""
        engine = self.engine
        report = swap(self.model, tensors, inplace=self.inplace, owned=self.owned)
        # The model no longer computes with the checkpoint's own bytes: nothing may offer them as such (NIXL), and
        # the old tensors a double buffer replaced must not be kept alive here.
        engine.loaded_weights = None
        engine.identity = manifest.identity
        tiers = engine.kv_tiers
        spec = engine.kv_spec()
        if tiers is not None and spec is not None:
            from preheat.kv.build import spec_fingerprint
            from preheat.kv.settings import KVSettings

            kv = KVSettings(kv_dtype=tiers.kv_dtype, chunk_tokens=tiers.chunk_tokens)
            tiers.fingerprint = spec_fingerprint(spec, kv, manifest.identity)  # keys of the old weights never match
        self._installed(manifest)
        return report
