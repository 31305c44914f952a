"""What a start can do before torch is there, done while torch imports (docs/server.md, *Start-up order*).

``import torch`` is the largest fixed cost of a cold start (~1.3-1.7 s of one core) and needs nothing of the model,
while reading the model's config, checking its files, paging its weights in and building its tokenizer and chat
template need nothing of torch. So ``start_engine_imports`` imports the engine on a thread of its own, and
``prepare`` meanwhile reads the config and checks the manifest (``model_config``), asks the kernel to page the
weights in (``page_in``: for a CPU load also mapped and their page tables filled, ``preheat.io.premap``) and has
the tokenizer built and the chat template compiled (``tokenizer``: in the process ``preheat serve`` started for it,
``preheat.text.process``, since that work holds the GIL as the import does; else on a thread), each a stage on the
timeline: the waterfall shows them as parallel bars. Nothing here imports torch (a test checks it).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest
from preheat.core import env
from preheat.core.errors import CheckpointError
from preheat.core.timeline import Timeline
from preheat.engine.config import ModelConfig, read_model_config
from preheat.io.premap import Premapped, map_files
from preheat.text.process import TokenizerProcess, build_tokenizer
from preheat.text.tokenizer import TextTokenizer

log = logging.getLogger("preheat.server")
PAGE_IN_CHUNK = 8 << 20  # bytes per read-ahead request (see page_in)
MAX_MANIFEST_BYTES = 256 * 1024 * 1024  # what Manifest.from_json accepts (sources.base.READ_BYTES_LIMIT)


class EngineImports:
    """``import preheat.engine.engine`` (torch, the model code) on a thread, recorded as ``engine_imports``."""

    def __init__(self, timeline: Timeline) -> None:
        self._timeline = timeline
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="preheat-imports", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with self._timeline.stage("engine_imports"):
                import preheat.engine.engine  # noqa: F401 - imported for its side effect: torch is loaded
        except BaseException as exc:  # re-raised by wait() on the loading thread
            self._error = exc
        finally:
            self._done.set()

    def wait(self) -> None:
        """Block until the engine is imported; re-raise what importing it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error


def start_engine_imports(timeline: Timeline) -> EngineImports:
    """Start importing the engine now; ``wait()`` on the result before building one.

    Before torch's OpenMP runtime loads, ``OMP_WAIT_POLICY`` defaults to ``PASSIVE`` (an operator's own value
    wins): with the default active policy, OpenMP's threads spin at every one of the ~450 barriers of a forward
    pass, and on a node whose cores other processes also use (other replicas, a router) a spinning thread that
    lost its core stalls the barrier for a scheduler slice. Measured on the 2-core benchmark machine with other
    jobs running: SmolLM2's first token 1.7-4.6 s active, 0.17-0.41 s passive (docs/server.md, *Start-up order*).
    """
    env.set_default(env.OMP_WAIT_POLICY, "PASSIVE")
    return EngineImports(timeline)


@dataclass
class Prepared:
    """The torch-free parts of a model: its config now, its tokenizer (template compiled) when ``tokenizer`` is
    asked for its ``result()`` (built elsewhere meanwhile), its weights files mapped and populated (``mapped``, by
    real path: for the loader to adopt; empty unless asked for)."""

    path: str
    config: ModelConfig
    tokenizer: Future[TextTokenizer]
    mapped: dict[str, Premapped]


def prepare(path: str, timeline: Timeline, text: TokenizerProcess | None = None, *, premap: bool = False) -> Prepared:
    """Read ``path``'s config (``model_config``), start building its tokenizer (``tokenizer``: in ``text``, the
    process ``preheat serve`` started at its start, else on a thread), and ask the kernel to read its weights ahead
    (``page_in``), while the engine imports elsewhere or the weights load.

    ``premap``: also map the weights files as the loader's ``mmap`` mode would and fill their page tables
    (``preheat.io.premap``: ~0.06 s for 538 MB, the GIL released), for the load to adopt: a CPU load then only makes
    views. Raises ``CheckpointError`` for a directory that is no model, before any weight is touched.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a model directory", path=path)
    with timeline.stage("model_config", model=path) as stage:
        config = ModelConfig.from_dict(read_model_config(path), where=path)
        stage.detail["manifest"] = check_manifest(path)
    tokenizer = build_tokenizer(path, config.eos_token_ids, timeline, text)
    # Here: the loading thread has nothing else to do until torch is there.
    mapped = page_in(weight_files(path), timeline, premap=premap)
    return Prepared(path, config, tokenizer, mapped)


def check_manifest(root: str) -> str:
    """With a ``preheat.json``: parse it and check every weights file it names is there with its recorded size (a
    truncated or missing file fails here, in milliseconds, not after torch); the digests are checked by the loader
    as the bytes land (remote loads) or by ``preheat verify``. Returns what was checked, for the stage's detail."""
    manifest_path = os.path.join(root, MANIFEST_NAME)
    try:
        with open(manifest_path, "rb") as handle:
            data = handle.read(MAX_MANIFEST_BYTES + 1)  # from_json refuses what is longer
    except FileNotFoundError:
        return "none"
    except OSError as exc:
        raise CheckpointError(f"{manifest_path}: cannot read: {exc.strerror}", path=manifest_path) from None
    manifest = Manifest.from_json(data, where=manifest_path)
    for record in manifest.files:
        file_path = os.path.join(root, *record.name.split("/"))
        try:
            size = os.stat(file_path).st_size
        except OSError:
            raise CheckpointError(f"{file_path}: missing (listed in {MANIFEST_NAME})", path=file_path) from None
        if size != record.size:
            raise CheckpointError(
                f"{file_path}: {size} bytes, but {MANIFEST_NAME} records {record.size}: the file is truncated or "
                "another checkpoint's; pull or convert it again",
                path=file_path,
            )
    return f"{len(manifest.files)} files, sizes match"


def weight_files(root: str) -> list[str]:
    """The safetensors files of checkpoint directory ``root`` (all of them: the page-in only needs their names)."""
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot list the checkpoint: {exc.strerror}", path=root) from None
    return [os.path.join(root, n) for n in names]


def page_in(files: list[str], timeline: Timeline, *, premap: bool = False) -> dict[str, Premapped]:
    """Ask the kernel to read ``files`` into the page cache in the background: ``POSIX_FADV_WILLNEED`` per
    ``PAGE_IN_CHUNK`` (one call reads ahead at most the device's read-ahead window, 8 MiB here: a single call for a
    whole file reads only its first megabytes). The ``page_in`` stage (``detail.total_bytes``; no ``bytes``: it moves
    none itself) is the asking: ~0.3 s for 540 MB not cached, ~7 ms when cached, the GIL released in every call, so
    torch's import goes on meanwhile; the reads themselves overlap the import, and the load's page faults then find
    the pages there or on their way. A file that cannot be opened is left for the load to report. With ``premap``,
    the files are then mapped and populated (``preheat.io.premap.map_files``, waiting for those reads) and returned
    by real path; otherwise nothing is."""
    with timeline.stage("page_in", files=len(files), method="fadvise") as stage:
        total = 0
        for path in files:
            try:
                with open(path, "rb") as handle:
                    size = os.fstat(handle.fileno()).st_size
                    for offset in range(0, size, PAGE_IN_CHUNK):
                        length = min(PAGE_IN_CHUNK, size - offset)
                        os.posix_fadvise(handle.fileno(), offset, length, os.POSIX_FADV_WILLNEED)
                total += size
            except OSError as exc:
                log.info("page-in of %s skipped: %s", path, exc)
        stage.detail["total_bytes"] = total
        mapped = map_files(files) if premap else {}
        if premap:
            stage.detail.update(method="fadvise+populate", mapped=len(mapped))
    return mapped
