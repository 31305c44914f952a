"""``preheat verify``: recompute every digest of a preheat checkpoint and compare it with the manifest.

Each file is read once (files in parallel): the digest of every tensor's bytes, then of the whole file (which also
covers headers and padding), then of each side file (config, tokenizer). A problem names its file and, when one is at
fault, its tensor; ``first_bad`` is the first in manifest order, so two runs over the same damage say the same thing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from preheat.checkpoint.digest import hash_file
from preheat.checkpoint.layout import read_manifest
from preheat.checkpoint.manifest import MANIFEST_NAME, FileRecord, Manifest
from preheat.core.errors import CheckpointError


@dataclass(frozen=True)
class Problem:
    """One mismatch: the file (relative name), the tensor when one is at fault, and what is wrong."""

    file: str
    tensor: str | None
    message: str


@dataclass
class VerifyReport:
    """The outcome of ``verify_checkpoint``: what was checked, and every problem found."""

    root: str
    identity: str
    files: int
    tensors: int
    bytes: int
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def first_bad(self) -> Problem | None:
        return self.problems[0] if self.problems else None

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["ok"] = self.ok
        return out


def require_manifest(directory: str) -> Manifest:
    """The manifest of ``directory``; ``CheckpointError`` saying what to do when there is none."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory (expected a preheat checkpoint)", path=directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise CheckpointError(
            f"{directory}: has no {MANIFEST_NAME}, so there is nothing to verify against; "
            "make one with `preheat convert SRC DST`",
            path=directory,
        )
    return manifest


def verify_checkpoint(
    directory: str | os.PathLike[str],
    *,
    progress: Callable[[int, int], None] | None = None,
    threads: int | None = None,
) -> VerifyReport:
    """Recompute the digests of ``directory``'s files and tensors; never raises for a mismatch (see ``problems``).

    Raises ``CheckpointError`` only when there is no valid manifest to check against.
    """
    root = os.fspath(directory)
    manifest = require_manifest(root)
    records = [*manifest.files, *manifest.extra_files]
    total = sum(r.size for r in records)
    lock = threading.Lock()
    done = 0

    def tick(nbytes: int) -> None:
        nonlocal done
        with lock:
            done += nbytes
            current = min(done, total)
        if progress is not None:
            progress(current, total)

    workers = max(1, min(threads or min(8, os.cpu_count() or 1), len(records)))
    with ThreadPoolExecutor(workers, thread_name_prefix="preheat-verify") as pool:
        found = list(pool.map(lambda r: _check_file(root, manifest, r, tick), records))
    report = VerifyReport(root, manifest.identity, len(records), len(manifest.tensors), total)
    for problems in found:
        report.problems.extend(problems)
    return report


def _check_file(root: str, manifest: Manifest, record: FileRecord, tick: Callable[[int], None]) -> list[Problem]:
    path = os.path.join(root, record.name)
    if not os.path.isfile(path):
        return [Problem(record.name, None, f"{path}: listed in {MANIFEST_NAME} but missing")]
    size = os.path.getsize(path)
    if size != record.size:
        return [Problem(record.name, None, f"{path}: is {size} bytes, {MANIFEST_NAME} says {record.size}")]
    tensors = manifest.tensors_in(record.name)
    try:
        whole, digests = hash_file(path, [(t.offset, t.nbytes) for t in tensors], progress=tick)
    except CheckpointError as exc:
        return [Problem(record.name, None, str(exc))]
    problems = [
        Problem(
            record.name,
            t.name,
            f"{path}: tensor {t.name!r} has digest {digest}, {MANIFEST_NAME} says {t.digest} (bytes changed)",
        )
        for t, digest in zip(tensors, digests, strict=True)
        if digest != t.digest
    ]
    if not problems and whole != record.digest:
        problems.append(
            Problem(record.name, None, f"{path}: file digest {whole} differs from {record.digest} (header changed?)")
        )
    return problems
