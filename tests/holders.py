"""Refit holders that misbehave, served by a real ``RefitServer`` in the tests that need one (preheat and vLLM
followers alike): a holder must be checked, never trusted."""

from __future__ import annotations

from preheat.refit.protocol import VersionManifest


class LyingHolder:
    """A holder whose manifest promises one thing and whose bytes are another (a corrupted copy, a bad disk)."""

    def __init__(self, manifest: VersionManifest) -> None:
        self.name, self._manifest = manifest.name, manifest

    def versions(self) -> list[int]:
        return [self._manifest.version]

    def manifest(self, version: int) -> VersionManifest | None:
        return self._manifest if version == self._manifest.version else None

    def tensor_bytes(self, version: int, tensor: str) -> memoryview | None:
        entry = self._manifest.entry(tensor)
        return None if entry is None else memoryview(bytes(entry.nbytes))  # zeros: never the promised digest
