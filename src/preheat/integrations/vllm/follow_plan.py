"""What a vLLM replica installs for a refit version, pure: which checkpoint tensors must travel together, and the
index of the staging file the workers read them from (docs/integrations.md, *vLLM: live weight updates from a
Publisher*).

vLLM fuses checkpoint tensors into one parameter (``q_proj``, ``k_proj``, ``v_proj`` -> ``qkv_proj``; ``gate_proj``,
``up_proj`` -> ``gate_up_proj``), and its reload (``reload_weights``: restore the layer, load, process again, which on
a CPU repacks the weight for oneDNN) processes a layer once every element of it is loaded. So a changed ``q_proj``
is installed with its layer's unchanged ``k_proj`` and ``v_proj`` (and biases): the *unit* of a checkpoint tensor is
its vLLM module, named by the model's own ``packed_modules_mapping``. Only the changed tensors are pulled; their
unchanged unit-mates come from what the replica already holds.

>>> packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
>>> names = [f"l.0.self_attn.{p}_proj.weight" for p in "qkvo"]
>>> install_set(["l.0.self_attn.k_proj.weight"], names, packed)
['l.0.self_attn.q_proj.weight', 'l.0.self_attn.k_proj.weight', 'l.0.self_attn.v_proj.weight']
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from preheat.core.errors import RefitError

INSTALL_METHOD = "preheat_refit_install"  # the worker extension's methods, called through collective_rpc
LAYOUT_METHOD = "preheat_refit_layout"
WORKER_EXTENSION = "preheat.integrations.vllm.follow_worker.RefitWorker"


def unit_of(name: str, packed: Mapping[str, Sequence[str]]) -> str:
    """The vLLM module a checkpoint tensor loads into: its module path with a fused part replaced by the fused
    module (``...self_attn.k_proj.weight`` -> ``...self_attn.qkv_proj``)."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    for fused, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{fused}" if parent else fused
    return module


def install_set(changed: Iterable[str], names: Sequence[str], packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The checkpoint tensors to install when ``changed`` changed: every tensor of ``names`` (the version's, in its
    order) whose unit holds a changed one, grouped by unit so each layer completes before the next begins."""
    wanted = {unit_of(n, packed) for n in changed}
    by_unit: dict[str, list[str]] = {}
    for name in names:
        unit = unit_of(name, packed)
        if unit in wanted:
            by_unit.setdefault(unit, []).append(name)
    return [name for group in by_unit.values() for name in group]


@dataclass(frozen=True)
class Staged:
    """One tensor in the staging file: safetensors dtype, shape, byte range, and the digest it must have."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    digest: str

    def to_wire(self) -> list[object]:
        """As ``collective_rpc`` carries it (msgpack: lists, strings, integers)."""
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes, self.digest]

    @classmethod
    def from_wire(cls, item: object) -> Staged:
        if not isinstance(item, list | tuple) or len(item) != 6:
            raise RefitError(f"a staged tensor is not [name, dtype, shape, offset, nbytes, digest]: {str(item)[:200]}")
        name, dtype, shape, offset, nbytes, digest = item
        if not (isinstance(name, str) and isinstance(dtype, str) and isinstance(digest, str)):
            raise RefitError(f"staged tensor {str(name)[:80]}: name, dtype and digest must be strings")
        if not isinstance(shape, list | tuple) or not all(isinstance(d, int) for d in shape):
            raise RefitError(f"staged tensor {name}: shape is not a list of sizes")
        if not isinstance(offset, int) or not isinstance(nbytes, int) or offset < 0 or nbytes < 0:
            raise RefitError(f"staged tensor {name}: offset and nbytes must be counts")
        return cls(name, dtype, tuple(shape), offset, nbytes, digest)


def layout(entries: Sequence[tuple[str, str, tuple[int, ...], int, str]]) -> list[Staged]:
    """Byte ranges of ``entries`` (name, dtype, shape, nbytes, digest) laid end to end, each at a 64-byte boundary
    (aligned views for the workers)."""
    out, offset = [], 0
    for name, dtype, shape, nbytes, digest in entries:
        out.append(Staged(name, dtype, shape, offset, nbytes, digest))
        offset += -(-nbytes // 64) * 64
    return out
