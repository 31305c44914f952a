"""What the planning tools learn from a real checkpoint: its KV fingerprint and bytes per token, a batch tokenizer,
and a short measured prefill/decode. The I/O edge of ``preheat.plan`` (everything else there is pure)."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from preheat.core.errors import CheckpointError
from preheat.kv.keys import fingerprint
from preheat.plan.traces import Encoder, Request

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True)
class ModelFacts:
    """A checkpoint's identity (or path), KV layout and the KV bytes one token takes."""

    root: str
    identity: str
    layout: dict[str, object]
    kv_bytes_per_token: int

    def fingerprint(self, chunk_tokens: int) -> str:
        """The chunk-key seed for this model (``preheat.kv.keys.fingerprint``)."""
        return fingerprint(identity=self.identity, layout=self.layout, chunk_tokens=chunk_tokens)


def model_facts(root: str) -> ModelFacts:
    """Read ``config.json`` (and ``preheat.json``'s identity) from the checkpoint directory ``root``."""
    from preheat.checkpoint.jsonfile import read_json_object
    from preheat.engine.config import ModelConfig, read_model_config

    if not os.path.isdir(root):
        raise CheckpointError(f"--model {root}: not a checkpoint directory", path=root)
    config = ModelConfig.from_dict(read_model_config(root), where=root)
    itemsize = _DTYPE_BYTES.get((config.torch_dtype or "bfloat16").lower(), 2)
    layout: dict[str, object] = {
        "num_layers": config.num_layers,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "dtype_bytes": itemsize,
    }
    kv_bytes = config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize
    identity = read_json_object(os.path.join(root, "preheat.json")).get("identity")
    # A Hugging Face directory has no identity: its path names the weights well enough for one analysis.
    name = identity if isinstance(identity, str) and identity else os.path.abspath(root)
    return ModelFacts(root, name, layout, kv_bytes)


def batch_encoder(root: str) -> Encoder:
    """Tokenize requests with the checkpoint's tokenizer, a batch at a time (the Rust tokenizer runs batches on all
    cores): text prompts with the tokenizer's special tokens, chats through the chat template."""
    from preheat.engine.config import ModelConfig, read_model_config
    from preheat.text.tokenizer import TextTokenizer

    config = ModelConfig.from_dict(read_model_config(root), where=root)
    tokenizer = TextTokenizer.from_dir(root, config_eos_ids=config.eos_token_ids)

    def encode(requests: list[Request]) -> list[list[int]]:
        texts = [r.text for r in requests if r.text is not None]
        chats = [tokenizer.render_chat(r.messages) for r in requests if r.messages is not None]
        plain = iter(tokenizer.tokenizer.encode_batch(texts, add_special_tokens=True) if texts else [])
        # A rendered chat template already holds BOS and the turn markers: no post-processor (as the server does).
        chat = iter(tokenizer.tokenizer.encode_batch(chats, add_special_tokens=False) if chats else [])
        return [list((next(plain) if r.text is not None else next(chat)).ids) for r in requests]

    return encode


@dataclass(frozen=True)
class Speeds:
    """Measured milliseconds per prompt token (prefill) and per generated token (decode), on this machine."""

    prefill_ms_per_token: float
    decode_ms_per_token: float
    prompt_tokens: int
    device: str


def measure_speeds(
    root: str, *, prompt_tokens: int = 256, decode_steps: int = 8, repeats: int = 3, device: str = "cpu"
) -> Speeds:
    """Load the checkpoint once, then prefill ``prompt_tokens`` tokens and decode ``decode_steps`` more, one at a
    time, ``repeats`` + 1 times. The first run warms torch up and is dropped; of the others the fastest counts,
    as the one least disturbed by whatever else runs on the machine."""
    import torch

    from preheat.engine import Engine

    engine = Engine.from_checkpoint(root, device=device)
    n = max(1, min(prompt_tokens, engine.max_model_len - decode_steps - 1))
    ids = [i % max(engine.config.vocab_size, 1) for i in range(n)]
    backend = engine.backend
    prefill, decode = math.inf, math.inf
    with torch.inference_mode():
        for run in range(repeats + 1):
            state = backend.begin()
            try:
                started = time.perf_counter()
                backend.step(state, ids, 0)
                middle = time.perf_counter()
                for step in range(decode_steps):
                    backend.step(state, [ids[step]], n + step)
                ended = time.perf_counter()
            finally:
                backend.end(state)
            if run > 0:
                prefill, decode = min(prefill, middle - started), min(decode, ended - middle)
    return Speeds(prefill * 1000.0 / n, decode * 1000.0 / max(decode_steps, 1), n, str(engine.device))
