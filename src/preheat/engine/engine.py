"""The reference engine: a checkpoint in, streamed tokens out.

``Engine.from_checkpoint`` loads the weights with ``preheat.load`` (zero-copy on CPU), binds them into the built-in
Llama-family model (or, for other architectures, a transformers model), reads the tokenizer, and allocates the KV
cache. ``generate`` prefills the prompt and decodes one token at a time, yielding a ``GenerationStep`` per token.
Not thread-safe: a server feeds it requests one at a time from one worker thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Collection, Generator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from preheat.core.errors import CheckpointError, KVError, RequestError
from preheat.core.timeline import Timeline
from preheat.engine.backend import (
    Backend,
    NativeBackend,
    build_backend,
    cpu_has_native_bf16,
    resolve_dtype,
    resolve_max_len,
)
from preheat.engine.config import ModelConfig, read_model_config
from preheat.engine.kv import PagedKVCache, Sequence
from preheat.engine.sampling import Sampler, SamplingParams, StopStrings
from preheat.io.buffers import populate_read
from preheat.kv.spec import KVLayout, KVSpec
from preheat.loader.load import load
from preheat.text.tokenizer import TextTokenizer

if TYPE_CHECKING:  # the KV tiers import torch-free key code and, for L2, redis: only when a server turns them on
    from preheat.engine.copies import Copy, CopyWriter
    from preheat.io.premap import Premapped
    from preheat.kv.tiered import TieredKV
    from preheat.store.cache import Lease, ModelCache

log = logging.getLogger("preheat.engine")
MIN_COST_SAMPLE = 64  # prefills shorter than this do not update the measured prefill cost per token
PREFILL_PIECE = 512  # prompt tokens per forward pass: bounds activation memory, lets a cancel land mid-prefill


@dataclass
class GenerationStep:
    """One generated token: its id, the text it adds (may be "": held back until a character or a possible stop
    string is complete), and ``finish_reason`` ("stop" or "length") on the last step, else None."""

    token_id: int
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens whose K/V came from a cache instead of being computed (KV tiers)


class Engine:
    """A model ready to generate. Build it with ``Engine.from_checkpoint``.

    >>> engine = Engine.from_checkpoint("path/to/smollm2")                          # doctest: +SKIP
    >>> ids = engine.encode_chat([{"role": "user", "content": "Capital of France?"}])  # doctest: +SKIP
    >>> "".join(s.text for s in engine.generate(ids, SamplingParams(temperature=0)))   # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        backend: Backend,
        tokenizer: TextTokenizer,
        config: ModelConfig,
        model_name: str,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_cache: PagedKVCache | None,
        identity: str | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = config
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.kv_cache = kv_cache  # None for the transformers fallback: no chunk export/import there
        # The built-in model (None for the fallback): its forward() runs tokens into kv_cache sequences directly.
        self.model = backend.model if isinstance(backend, NativeBackend) else None
        self.identity = identity  # the checkpoint's preheat.json identity, when it has one (KV fingerprints)
        self.kv_tiers: TieredKV | None = None  # set by ``attach_kv_tiers``: reuse prompt chunks across requests
        # The tensors as loaded, when the model is bound to them zero-copy on a GPU: they then hold the checkpoint's
        # own bytes, which a peer may offer over NIXL (preheat.peer.nixl). None otherwise (CPU, or converted).
        self.loaded_weights: Mapping[str, torch.Tensor] | None = None
        self._kv_shape: tuple[KVLayout, int] | None = None  # the pool's layout and size while offloaded
        # The node cache's converted copy this model maps (leased: not evicted while mapped), or the process writing
        # one after this load converted (preheat.engine.copies).
        self.copy_lease: Lease | None = None
        self.copy_writer: CopyWriter | None = None

    @classmethod
    def from_checkpoint(
        cls,
        path: str,
        *,
        device: str = "cpu",
        dtype: str | None = None,
        max_model_len: int | None = None,
        timeline: Timeline | None = None,
        load_mode: str | None = None,
        config: ModelConfig | None = None,
        tokenizer: TextTokenizer | Future[TextTokenizer] | None = None,
        premapped: dict[str, Premapped] | None = None,
        copies: ModelCache | None = None,
    ) -> Engine:
        """Load the checkpoint directory ``path`` (preheat or Hugging Face layout) onto ``device``.

        ``dtype``: compute dtype (``auto``/None, ``float32``, ``bfloat16``, ``float16``); weights in another dtype
        are converted once (a copy), weights already in it are bound as loaded (zero-copy). ``max_model_len``
        defaults to the model's context, capped at 8192. ``load_mode`` is ``preheat.load``'s ``mode``. With a
        ``timeline``, records the stages ``weight_load`` (bytes, GB/s), ``model_build`` and ``tokenizer``.
        ``config`` and ``tokenizer``, when the caller reads them itself (torch-free, e.g. while torch is being
        imported: ``preheat.server.prepare``), are used as given and the ``tokenizer`` stage is not recorded here; a
        ``Future`` tokenizer is waited for after the model is built, so building it overlaps the load. ``premapped``:
        the weights files mapped (and their pages populated) while torch imported, for the load to adopt.
        ``copies``: a node cache where weights converted to the compute dtype are kept (``preheat.engine.copies``):
        on CPU a load that would convert maps the copy there instead, and the first one that finds none writes it,
        in a process of its own (``Engine.copy_writer``). None: convert at every load.
        """
        root = os.fspath(path)
        if not os.path.isdir(root):
            raise CheckpointError(f"{root}: not a model directory", path=root)
        dev = torch.device(device)
        # Read first (a millisecond): a directory that is no model fails before any weight is loaded.
        if config is None:
            config = ModelConfig.from_dict(read_model_config(root), where=root)
        max_len = resolve_max_len(config, max_model_len, root)
        timeline = timeline if timeline is not None else Timeline(time.time())
        with timeline.stage("weight_load", mode=load_mode or "auto", device=str(dev)) as stage:
            weights = load(root, dev, mode=load_mode, dequantize=True, premapped=premapped)
            report = weights.report
            if report.mode == "mmap" and not weights.populated:
                # A mapping reads nothing until touched: fault every page in now, so that this stage holds the
                # reads (and its GB/s is the real one) instead of hiding them in warm-up's first forward pass.
                _fault_in(weights.values())
            stage.nbytes = report.bytes
            stage.detail.update(mode=report.mode, files=report.files, premapped=weights.populated)
        with timeline.stage("model_build") as stage:
            # The embedding is never quantized, so its dtype is the checkpoint's own.
            sample = weights.get("model.embed_tokens.weight")
            sample = (
                sample if sample is not None else next((t for t in weights.values() if t.is_floating_point()), None)
            )
            compute = resolve_dtype(dtype, dev, sample.dtype if sample is not None else torch.float32)
            identity = _identity(root)
            # A CPU converting a checkpoint that has an identity maps the node cache's converted copy if there is
            # one, and writes one if not (docs/engine.md, *Weights and dtype*).
            keep: tuple[ModelCache, str] | None = None
            converts = dev.type == "cpu" and sample is not None and sample.dtype != compute
            if converts and copies is not None and identity is not None:
                keep = (copies, identity)
            copy: Copy | None = None
            if keep is not None:  # imported only here: a start that converts nothing (most) never pays for it
                from preheat.engine.copies import find as find_copy

                copy = find_copy(*keep, compute)
            if copy is not None:
                copied = load(copy.path, dev, mode=load_mode)
                if _same_tensors(weights, copied, compute):
                    weights = copied
                    if copied.report.mode == "mmap" and not copied.populated:
                        _fault_in(copied.values())
                else:  # not what this load converts to (written by other code?): convert, as without one
                    log.warning("%s: the converted copy %s does not match the checkpoint; converting", root, copy.path)
                    copy.lease.close()
                    copy = keep = None
                del copied
            backend, cache, converted, max_len = build_backend(
                config, weights=weights, dtype=compute, device=dev, max_len=max_len, root=root
            )
            stage.detail.update(
                architecture=config.architecture or config.model_type,
                backend="native" if cache is not None else "transformers",
                dtype=str(compute).removeprefix("torch."),
                converted_bytes=converted,
                max_model_len=max_len,
            )
            if keep is not None:
                stage.detail["copy"] = copy.path if copy is not None else "none yet: writing one"
        if tokenizer is None:
            with timeline.stage("tokenizer"):
                tokenizer = TextTokenizer.from_dir(root, config_eos_ids=config.eos_token_ids)
        elif isinstance(tokenizer, Future):
            tokenizer = tokenizer.result()  # raises what building it raised
        engine = cls(
            backend=backend,
            tokenizer=tokenizer,
            config=config,
            model_name=os.path.basename(os.path.normpath(root)),
            max_model_len=max_len,
            device=dev,
            dtype=compute,
            kv_cache=cache,
            identity=identity,
        )
        if dev.type == "cuda" and converted == 0:  # no copy was made: the model's tensors are the loaded bytes
            engine.loaded_weights = weights
        if copy is not None:
            engine.copy_lease = copy.lease
        elif keep is not None:
            from preheat.engine.copies import CopyWriter

            engine.copy_writer = CopyWriter(*keep, root=root, dtype=compute)
        return engine

    def kv_spec(self) -> KVSpec | None:
        """What the KV tiers need to know about this engine (``preheat.kv.build.build_tiers``); None on the
        transformers fallback, which cannot export KV chunks."""
        if self.kv_cache is None:
            return None
        rope = self.config.rope.to_dict()
        if self.config.rope.rope_type == "dynamic":
            rope["max_model_len"] = self.max_model_len  # dynamic NTK's frequencies depend on it (docs/engine.md)
        return KVSpec(self.kv_cache.layout, identity=self.identity, rope=rope, pin=self.device.type == "cuda")

    def attach_kv_tiers(self, tiers: TieredKV | None) -> None:
        """Look prompts up in ``tiers`` (and store their new chunks there) from the next request on."""
        if tiers is not None and self.kv_cache is None:
            raise RequestError("KV tiers need the native engine's paged KV cache (not the transformers fallback)")
        self.kv_tiers = tiers

    # -- sleep level 1 on CUDA (docs/server.md, *Sleep and wake*) ------------------------------------------------

    def offload(self) -> int:
        """Move the weights to page-locked host memory and drop the KV pool, freeing the device's memory for
        another user; returns the bytes moved. Only the native model on CUDA (``DeviceError`` otherwise): on CPU
        the host copy is the page cache, and sleeping drops the engine instead."""
        from preheat.core.errors import DeviceError

        if self.model is None or self.kv_cache is None or self.device.type != "cuda":
            raise DeviceError("offload keeps a host copy of a CUDA engine's weights; on CPU drop the engine instead")
        self.loaded_weights = None  # the checkpoint's own device tensors: no longer what the model computes with
        moved = self.model.move(torch.device("cpu"), pin=True)
        self._kv_shape = (self.kv_cache.layout, self.kv_cache.num_blocks)
        # The pool is dropped, not moved: sleep forgets the K/V of finished requests (the KV tiers keep theirs).
        self.kv_cache.pool = torch.empty(0, dtype=self._kv_shape[0].dtype, device=self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return moved

    def restore(self) -> int:
        """Undo ``offload``: the weights back on the device from their pinned host copy, a fresh KV pool."""
        assert self.model is not None
        moved = self.model.move(self.device)
        assert self._kv_shape is not None, "restore() without offload()"
        layout, blocks = self._kv_shape
        self._kv_shape = None
        self.kv_cache = PagedKVCache(layout, blocks, self.device)
        self.backend = NativeBackend(self.model, self.kv_cache)
        torch.cuda.synchronize(self.device)
        return moved

    # -- prompts --------------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str) -> list[int]:
        """Token ids of a completions prompt (with the tokenizer's special tokens, e.g. BOS)."""
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of chat ``messages`` through the model's chat template, ending with the assistant's turn."""
        return self.tokenizer.encode_chat(messages)

    # -- generation -----------------------------------------------------------------------------------------------

    def check_prompt(self, prompt_ids: list[int]) -> None:
        """``RequestError`` unless ``prompt_ids`` can be generated from (non-empty, room for one token)."""
        if not prompt_ids:
            raise RequestError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens but this model's context is {self.max_model_len} tokens "
                f"(prompt and output together): shorten it to at most {self.max_model_len - 1} tokens"
            )
        vocab = self.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside this model's vocabulary (0..{vocab - 1})")

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> Generator[GenerationStep, None, None]:
        """Yield one ``GenerationStep`` per generated token; the last has ``finish_reason`` "stop" (EOS or a stop
        string) or "length" (``max_tokens`` or the context is full). ``should_stop()`` is asked before each forward
        pass; when it returns True the iterator ends at once, without a final step.

        The request is validated before the first step (``RequestError``); closing the iterator early releases
        the sequence's KV blocks.
        """
        params.validate()
        self.check_prompt(prompt_ids)
        return self._generate(list(prompt_ids), params, should_stop or (lambda: False))

    @torch.inference_mode()
    def _generate(
        self, prompt: list[int], params: SamplingParams, should_stop: Callable[[], bool]
    ) -> Generator[GenerationStep, None, None]:
        state = self.backend.begin()
        try:
            keys = self._chunk_keys(prompt)
            cached = self._restore_prefix(state, keys, len(prompt))
            logits = None
            began = time.perf_counter()
            for start in range(cached, len(prompt), PREFILL_PIECE):
                if should_stop():
                    return
                logits = self.backend.step(state, prompt[start : start + PREFILL_PIECE], start)
            assert logits is not None  # the prompt is never entirely cached: its last token yields the logits
            self._store_prefix(state, keys, cached, time.perf_counter() - began, len(prompt) - cached)
            yield from self._decode(
                state, prompt=prompt, cached=cached, logits=logits, params=params, should_stop=should_stop
            )
        finally:
            self.backend.end(state)

    def _chunk_keys(self, prompt: list[int]) -> list[str]:
        """Keys of the prompt's full chunks (docs/kv-keys.md), or [] without KV tiers."""
        tiers = self.kv_tiers
        if tiers is None:
            return []
        from preheat.kv.keys import chunk_keys

        return chunk_keys(tiers.fingerprint, prompt, tiers.chunk_tokens)

    def _restore_prefix(self, state: object, keys: list[str], prompt_len: int) -> int:
        """Fill ``state`` with the K/V of the longest run of leading chunks some tier holds; returns their token
        count. Never the whole prompt: its last token is always computed, for the first logits."""
        tiers, cache = self.kv_tiers, self.kv_cache
        if tiers is None or cache is None or not keys:
            return 0
        from preheat.kv.keys import cacheable_chunks

        assert isinstance(state, Sequence)
        size = tiers.chunk_tokens
        restored = 0
        for chunk in tiers.lookup(keys[: cacheable_chunks(prompt_len, size)]):
            start = restored * size
            try:
                view = cache.chunk_view(state, start, size)
            except KVError:  # a fragmented pool: fill a temporary chunk and copy it in
                whole = torch.empty(cache.layout.chunk_shape(size), dtype=cache.layout.dtype, device=cache.device)
                chunk.load_into(whole)
                cache.import_chunk(state, start, whole)
            else:
                chunk.load_into(view)
                cache.mark_filled(state, start + size)
            restored += 1
        return restored * size

    def _store_prefix(self, state: object, keys: list[str], cached: int, seconds: float, computed: int) -> None:
        """Hand the prompt's newly computed full chunks to the tiers (L1 now, L2 in the background)."""
        tiers, cache = self.kv_tiers, self.kv_cache
        if tiers is None or cache is None:
            return

        assert isinstance(state, Sequence)
        if computed >= MIN_COST_SAMPLE:  # a short prefill measures the fixed cost of a forward pass, not tokens
            tiers.costs.observe("prefill", seconds, computed)
        size = tiers.chunk_tokens
        for index in range(cached // size, len(keys)):
            tiers.store(keys[index], cache.export_chunk(state, index * size, size))

    def _decode(
        self,
        state: object,
        *,
        prompt: list[int],
        cached: int,
        logits: torch.Tensor,
        params: SamplingParams,
        should_stop: Callable[[], bool],
    ) -> Generator[GenerationStep, None, None]:
        sampler = Sampler(params)
        stops = StopStrings(params.stop)
        detok = self.tokenizer.detokenizer(prompt)
        eos = self.tokenizer.eos_ids
        length = len(prompt)
        for generated in range(1, params.max_tokens + 1):
            token = sampler(logits)
            if token in eos:  # the end token itself adds no text; release what was held back
                tail, _ = stops.feed(detok.flush())
                yield self._step(token, tail + stops.flush(), "stop", prompt, cached)
                return
            text, stopped = stops.feed(detok.push(token))
            if stopped:
                yield self._step(token, text, "stop", prompt, cached)
                return
            length += 1
            if generated == params.max_tokens or length >= self.max_model_len:
                tail, stopped = stops.feed(detok.flush())
                final = text + tail + ("" if stopped else stops.flush())
                yield self._step(token, final, "stop" if stopped else "length", prompt, cached)
                return
            yield self._step(token, text, None, prompt, cached)
            if should_stop():
                return
            logits = self.backend.step(state, [token], length - 1)

    @staticmethod
    def _step(token: int, text: str, finish: str | None, prompt: list[int], cached: int) -> GenerationStep:
        return GenerationStep(token, text, finish, len(prompt), cached)

    @torch.inference_mode()
    def warmup(self) -> None:
        """Pay once what the first request would otherwise pay: torch's lazy initialisation of every kernel a
        prefill and a decode step use (the thread pool, oneDNN/BLAS dispatch, attention), the sampler's, and the
        chat template's compile (jinja2 import; a no-op when ``preheat.server.prepare`` did it already).

        On the native model this runs the first layer only: lazy initialisation is per kernel, not per weight, and
        a whole forward pass more (twice: prefill and decode) was most of a float32 warm-up's cost, spent again by
        the first request (docs/engine.md, *Warm-up*). The fallback runs whole steps (transformers' own caches).
        """
        state = self.backend.begin()
        try:
            if self.model is not None:
                assert isinstance(state, Sequence)
                assert self.kv_cache is not None
                for ids, start in (([0, 0], 0), ([0], 2)):
                    self.model.forward(torch.tensor(ids), start, self.kv_cache, state, depth=1)
            else:
                self.backend.step(state, [0, 0], 0)
                self.backend.step(state, [0], 2)
        finally:
            self.backend.end(state)
        Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))(torch.zeros(8))
        if self.tokenizer.template is not None:
            self.tokenizer.template.compile()


@torch.inference_mode()
def warm_kernels() -> None:
    """Initialise, without a model, what every model's first forward pass initialises lazily: torch's thread pool
    and the CPU kernels of a Llama layer (linear, attention with and without a causal mask, norms, SiLU, sampling),
    in float32 and (where the CPU computes it natively) bfloat16. A standby replica runs this while it waits."""
    import torch.nn.functional as F  # noqa: N812 - the conventional alias

    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_has_native_bf16() else [])
    for dtype in dtypes:
        x = torch.randn(4, 256, dtype=dtype)
        w = torch.randn(512, 256, dtype=dtype)
        h = F.silu(F.linear(x, w)) * F.linear(x, w)
        h = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5)
        q, k = torch.randn(1, 4, 4, 64, dtype=dtype), torch.randn(1, 2, 4, 64, dtype=dtype)
        F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
        F.scaled_dot_product_attention(q[:, :, :1], k, k, enable_gqa=True)
        F.embedding(torch.tensor([1, 2]), w)
        torch.softmax(torch.matmul(q[0, :2], k[0].transpose(1, 2)), dim=-1, dtype=torch.float32)
    Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))(torch.zeros(8))


def _identity(root: str) -> str | None:
    # preheat.load already recomputed and checked the manifest's identity when it read it; reading the field is enough.
    from preheat.checkpoint.jsonfile import read_json_object

    try:
        value = read_json_object(os.path.join(root, "preheat.json")).get("identity")
    except CheckpointError:  # unreadable, or not JSON: no identity to key the KV tiers by
        return None
    return value if isinstance(value, str) else None


def _same_tensors(loaded: Mapping[str, torch.Tensor], copied: Mapping[str, torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether ``copied`` holds ``loaded``'s tensors (names, shapes) in ``dtype``: what converting them would bind."""
    return loaded.keys() == copied.keys() and all(
        t.dtype == dtype and t.shape == loaded[name].shape for name, t in copied.items()
    )


def _fault_in(tensors: Collection[torch.Tensor]) -> None:
    """Map every page of each (contiguous, CPU) tensor: ``MADV_POPULATE_READ`` over each storage (a mapped file's
    tensors share one; ~0.06 s instead of ~0.13 s for SmolLM2's 538 MB, the GIL released meanwhile); where the kernel
    refuses it, read one byte of every 4 KiB page."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor.numel() and tensor.is_contiguous() and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    if all(populate_read(address, nbytes) for address, nbytes in storages.items()):
        return
    for tensor in tensors:
        if tensor.numel() and tensor.is_contiguous() and tensor.device.type == "cpu":
            tensor.reshape(-1).view(torch.uint8)[::4096].sum()
