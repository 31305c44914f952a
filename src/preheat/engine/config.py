"""The model config the built-in engine needs, read from a checkpoint's ``config.json`` (or its ``preheat.json``).

Pure: ``ModelConfig.from_dict`` takes the JSON object and returns values; ``unsupported_reason`` says why the native
Llama-family implementation cannot run a config (the engine then falls back to transformers). Both the transformers
5.x spelling (``rope_parameters``) and the older one (``rope_theta`` + ``rope_scaling``) are understood.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from preheat.checkpoint.jsonfile import read_config, read_json_object
from preheat.core.errors import CheckpointError

# Architectures whose weights and math are exactly the Llama block: RMSNorm, RoPE, GQA attention (optional q/k/v
# biases, found by their presence in the weights), SiLU-gated MLP.
NATIVE_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
NATIVE_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings: ``rope_type`` is one of ``NATIVE_ROPE_TYPES`` (or another, which the native
    engine refuses); ``factor`` and the llama3 fields are used by the scaled types only."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    partial_rotary_factor: float = 1.0

    def to_dict(self) -> dict[str, object]:
        """The settings as JSON values (part of the KV fingerprint: keys computed under other RoPE are not valid)."""
        return {
            "theta": self.theta,
            "rope_type": self.rope_type,
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
            "partial_rotary_factor": self.partial_rotary_factor,
        }


@dataclass(frozen=True)
class ModelConfig:
    """What the engine reads from ``config.json``. ``raw`` keeps the whole object for the transformers fallback."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # Any: free-form JSON config

    @classmethod
    def from_dict(cls, doc: dict[str, Any], *, where: str = "config.json") -> ModelConfig:  # Any: JSON values
        """Parse a Hugging Face config object; ``CheckpointError`` naming ``where`` when a needed field is missing."""
        architectures = doc.get("architectures") or []
        architecture = str(architectures[0]) if architectures else ""
        model_type = str(doc.get("model_type", ""))
        if not architecture and not model_type:
            raise CheckpointError(f"{where}: names neither 'architectures' nor 'model_type'", path=where)
        native = architecture in NATIVE_ARCHITECTURES or (
            not architecture and model_type in NATIVE_ARCHITECTURES.values()
        )
        # Other architectures go to transformers, which reads its own fields: only the vocabulary is needed here.
        need = doc if native else {"hidden_size": 0, "num_attention_heads": 1, "num_hidden_layers": 0, **doc}
        try:
            hidden = int(need["hidden_size"])
            heads = int(need["num_attention_heads"])
            config = cls(
                architecture=architecture,
                model_type=model_type,
                vocab_size=int(need["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(doc.get("intermediate_size") or 4 * hidden),
                num_layers=int(need["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(doc.get("num_key_value_heads") or heads),
                head_dim=int(doc.get("head_dim") or hidden // heads),
                rms_norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(doc.get("max_position_embeddings", 2048)),
                rope=_rope(doc),
                # transformers' Llama/Mistral/Qwen2 configs default to untied; a missing lm_head ties anyway.
                tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)),
                hidden_act=str(doc.get("hidden_act", "silu")),
                sliding_window=_sliding_window(doc, model_type),
                bos_token_id=_int_or_none(doc.get("bos_token_id")),
                eos_token_ids=_ids(doc.get("eos_token_id")),
                torch_dtype=_str_or_none(doc.get("torch_dtype") or doc.get("dtype")),
                raw=dict(doc),
            )
        except KeyError as exc:
            raise CheckpointError(f"{where}: missing required field {exc.args[0]!r}", path=where) from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed model config ({exc})", path=where) from None
        return config

    @property
    def num_groups(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    def unsupported_reason(self) -> str | None:
        """Why the native Llama-family implementation cannot run this config, or None when it can."""
        known = (
            self.architecture in NATIVE_ARCHITECTURES
            if self.architecture
            else self.model_type in NATIVE_ARCHITECTURES.values()
        )
        checks = (
            (not known, f"architecture {self.architecture or self.model_type} is not Llama-family"),
            (self.hidden_act != "silu", f"hidden_act {self.hidden_act!r} (the native MLP is SiLU-gated)"),
            (
                self.rope.rope_type not in NATIVE_ROPE_TYPES,
                f"rope type {self.rope.rope_type!r} (native: {', '.join(NATIVE_ROPE_TYPES)})",
            ),
            (self.rope.partial_rotary_factor != 1.0, f"partial_rotary_factor {self.rope.partial_rotary_factor}"),
            (
                self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads != 0,
                f"{self.num_heads} attention heads do not group over {self.num_kv_heads} KV heads",
            ),
            (self.head_dim % 2 == 1, f"odd head_dim {self.head_dim} cannot be rotated"),
        )
        return next((reason for failed, reason in checks if failed), None)


def read_model_config(root: str) -> dict[str, Any]:  # Any: JSON values
    """``root/config.json``, or the ``config`` of ``root/preheat.json`` when there is no config.json."""
    config = read_config(root)
    if config:
        return config
    from_manifest = read_json_object(os.path.join(root, "preheat.json")).get("config")
    if isinstance(from_manifest, dict) and from_manifest:
        return from_manifest
    raise CheckpointError(f"{root}: no config.json (or preheat.json with a config): not a model directory", path=root)


def _rope(doc: dict[str, Any]) -> RopeConfig:  # Any: JSON values
    # transformers 5 writes everything into rope_parameters; older configs have rope_theta beside rope_scaling.
    params = doc.get("rope_parameters") or doc.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError("rope_parameters/rope_scaling must be an object")
    theta = params.get("rope_theta", doc.get("rope_theta", 10000.0))
    original = params.get("original_max_position_embeddings")
    return RopeConfig(
        theta=float(theta),
        rope_type=str(params.get("rope_type") or params.get("type") or "default"),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original is not None else None,
        partial_rotary_factor=float(params.get("partial_rotary_factor", doc.get("partial_rotary_factor", 1.0))),
    )


def _sliding_window(doc: dict[str, Any], model_type: str) -> int | None:  # Any: JSON values
    # Qwen2 configs carry a sliding_window value even when it is switched off; only use_sliding_window turns it on.
    if model_type == "qwen2" and not doc.get("use_sliding_window", False):
        return None
    return _int_or_none(doc.get("sliding_window"))


def _int_or_none(value: object) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _ids(value: object) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(int(v) for v in value if isinstance(v, int))
    single = _int_or_none(value)
    return (single,) if single is not None else ()
