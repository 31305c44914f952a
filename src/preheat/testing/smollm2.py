"""The embedded default model, SmolLM2-135M-Instruct, converted once per dtype and kept across test runs and
benchmarks.

Converting the GGUF costs ~25 s on 2 cores, so converted checkpoints live under ``$PREHEAT_TEST_CACHE`` (default
``~/.cache/preheat-tests``), keyed by the GGUF's digest and by the digest of the code that writes them: a change to
the converter makes a fresh conversion, never a stale pass. Each entry is published atomically by ``convert``, so a
directory that exists is complete. Where the GGUF or the converter's extras are missing, the test that asked skips
(``preheat.testing.needs``).

>>> SmolLM2(cache_root()).path("int8")      # doctest: +SKIP
PosixPath('/root/.cache/preheat-tests/smollm2-...-int8')
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from preheat.checkpoint import digest, gguf, manifest, quant
from preheat.checkpoint.manifest import digest_bytes, file_digest
from preheat.convert import convert, inputs
from preheat.convert import pipeline as convert_module
from preheat.core import env
from preheat.core.errors import ConfigError
from preheat.sources.embedded import find_smollm2_gguf
from preheat.store import locks
from preheat.testing.needs import unavailable


def cache_root() -> Path:
    """Where converted copies are kept: ``$PREHEAT_TEST_CACHE``, else ``~/.cache/preheat-tests``."""
    return Path(env.get(env.TEST_CACHE) or Path.home() / ".cache" / "preheat-tests")


def gguf_path() -> str:
    """The installed GGUF; where it or the converter's extras are missing, ``needs.unavailable`` with the fix."""
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("gguf") is None:
        unavailable("GGUF conversion needs transformers, gguf and accelerate: pip install 'preheat[gguf]'")
    try:
        return find_smollm2_gguf()
    except ConfigError as exc:
        unavailable(f"SmolLM2 is not installed ({exc})")


class SmolLM2:
    """Converted SmolLM2 checkpoints by dtype: ``keep`` straight from the GGUF, the others from ``keep``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}

    def path(self, dtype: str = "keep") -> Path:
        if dtype not in self._paths:
            self._paths[dtype] = self._convert(dtype)
        return self._paths[dtype]

    def _convert(self, dtype: str) -> Path:
        source = gguf_path()
        code = b"".join(
            Path(m.__file__ or "").read_bytes() for m in (convert_module, digest, gguf, inputs, manifest, quant)
        )
        key = f"{file_digest(source)[9:25]}-{digest_bytes(code)[9:21]}"
        target = self.root / f"smollm2-{key}-{dtype}"
        if (target / "preheat.json").is_file():
            return target
        src = source if dtype == "keep" else str(self.path("keep"))
        self.root.mkdir(parents=True, exist_ok=True)
        # Test workers (pytest -n) and benchmarks share this cache: one converts, the others wait and reuse it.
        with locks.exclusive(str(self.root / f".smollm2-{dtype}.lock")):
            if not (target / "preheat.json").is_file():
                for stale in self.root.glob(f"smollm2-*-{dtype}"):
                    if stale != target and ".tmp-" not in stale.name:
                        shutil.rmtree(stale, ignore_errors=True)
                convert(src, target, dtype=dtype, force=True)
        return target
