"""Which tensors ``preheat.load`` checks against ``preheat.json`` while their bytes land, and why not the others.

Pure: values in (the checkpoint's manifest and files, which tensors this rank reads whole, the mode, the caller's
``verify``), a ``VerifyPlan`` or a refusal out. The rules and their reasons are in docs/loader.md ("Verification"):

- ``verify=False``: nothing is checked, and the report says so.
- Remote sources (``http(s)://``, ``s3://``), and ``verify=True``: every returned tensor is checked, or the load
  refuses to start (no manifest, TP slices of an unsharded checkpoint, ``gds``), saying what to do instead.
- Local sources by default: checked when a manifest exists and the mode passes the bytes through host memory anyway
  (``read``, ``direct``, the CUDA staging pipeline); ``mmap`` stays lazy and ``gds`` stays DMA, unverified, and the
  report says why. A local Hugging Face directory (no manifest) loads unverified, as every other loader does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from preheat.checkpoint.digest import ExpectedDigest
from preheat.checkpoint.layout import Checkpoint
from preheat.checkpoint.manifest import MANIFEST_NAME, TensorRecord
from preheat.core.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class VerifyPlan:
    """Per checkpoint file (in load order), the tensors to check; ``total`` tensors are returned; ``reason`` says why
    some or all of them are not checked ("" when every one is)."""

    files: tuple[tuple[ExpectedDigest, ...], ...]
    total: int
    reason: str = ""

    @property
    def count(self) -> int:
        return sum(len(f) for f in self.files)

    @property
    def complete(self) -> bool:
        return not self.reason and self.count == self.total


def plan_verification(
    checkpoint: Checkpoint,
    whole: Sequence[Collection[str]],
    *,
    verify: bool | None,
    remote: bool,
    mode: str,
    rank: int,
    world_size: int,
) -> VerifyPlan:
    """Decide what a load checks. ``whole[i]`` names the tensors of ``checkpoint.files[i]`` this rank reads whole
    (a digest covers a whole tensor, so a slice of one cannot be checked against it); ``mode`` is the resolved one.

    Raises ``CheckpointError`` (no manifest) or ``ConfigError`` (slices, ``gds``) when every tensor must be checked
    and cannot be; the message names the source and what to do.
    """
    source = checkpoint.root
    total = sum(len(f.header.tensors) for f in checkpoint.files)
    nothing = tuple(() for _ in checkpoint.files)
    if verify is False:
        return VerifyPlan(nothing, total, "verify=False")
    strict = verify is True or remote
    manifest = checkpoint.manifest
    if manifest is None:
        if strict:
            raise CheckpointError(
                f"{source}: has no {MANIFEST_NAME}, so its tensors cannot be checked against digests"
                f"{' (remote sources are always checked)' if remote else ''}. Write one with `preheat convert SRC DST` "
                "where the files are (it records a digest per tensor) and load DST, or pass verify=False "
                "(`preheat load --no-verify`) to load it unverified",
                path=source,
            )
        return VerifyPlan(nothing, total, f"no {MANIFEST_NAME} (`preheat convert` writes one)")
    if mode == "gds":
        if strict:
            raise ConfigError(
                f"{source}: mode 'gds' moves bytes from storage to GPU memory by DMA, never through host memory, so "
                "they cannot be checked on the way; use mode 'read' (same device, through pinned staging buffers) "
                "or pass verify=False"
            )
        return VerifyPlan(nothing, total, "mode gds reads by DMA, past host memory (verify=True uses read)")
    if mode == "mmap" and not strict:
        return VerifyPlan(nothing, total, "mode mmap reads pages lazily (verify=True hashes them all at load)")
    records: dict[str, dict[str, TensorRecord]] = {}
    for tensor in manifest.tensors:
        records.setdefault(tensor.file, {})[tensor.name] = tensor
    planned: list[tuple[ExpectedDigest, ...]] = []
    sliced: list[str] = []
    for file, file_record, names in zip(
        checkpoint.files, manifest.files_for_rank(rank, world_size), whole, strict=True
    ):
        in_file = records.get(file_record.name, {})
        expected = []
        for entry in file.header.tensors:
            if entry.name not in names:
                sliced.append(entry.name)
                continue
            tensor = in_file[entry.name]  # layout checked each header against the manifest: every name is there
            expected.append(ExpectedDigest(tensor.name, tensor.offset, tensor.nbytes, tensor.digest))
        planned.append(tuple(expected))
    if sliced and strict:
        raise ConfigError(
            f"{source}: rank {rank} of {world_size} reads slices of {len(sliced)} tensors (such as {sliced[0]!r}) and "
            f"{MANIFEST_NAME} has digests of whole tensors only, so the slices cannot be checked. Convert with "
            f"`preheat convert SRC DST --tp {world_size}` (each rank's files get their own digests), `preheat pull` "
            "it into the node cache first (every file is checked), or pass verify=False"
        )
    reason = ""
    if sliced:
        reason = (
            f"{len(sliced)} tensors are TP slices, which whole-tensor digests cannot check "
            f"(`preheat convert --tp {world_size}` gives per-rank digests)"
        )
    return VerifyPlan(tuple(planned), total, reason)
