"""Deployment values: merge defaults, files and profiles; check them against the schema. Pure (values in, out)."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from preheat.core.errors import ConfigError

Values = dict[str, Any]  # Any: a YAML document, checked against values.schema.json before anything reads it

# A profile is a small set of values: `--profile cuda` is the same as a file saying `device: cuda`.
PROFILES: dict[str, Values] = {
    "cpu": {"device": "cpu"},
    "cuda": {"device": "cuda"},
    "redis-l2": {"l2": {"backend": "redis"}},
    "fs-l2": {"l2": {"backend": "fs"}},
    "scale-to-zero": {"autoscaler": "keda", "replicas": {"min": 0}},
}


def merge(base: Mapping[str, object], override: Mapping[str, object]) -> Values:
    """``override`` over ``base``: mappings merge key by key, anything else (lists too) is replaced.

    >>> merge({"replicas": {"min": 1, "max": 8}}, {"replicas": {"min": 0}})
    {'replicas': {'min': 0, 'max': 8}}
    """
    out: Values = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def combine(defaults: Mapping[str, object], layers: Iterable[tuple[str, object]], profiles: Iterable[str]) -> Values:
    """Defaults, then each ``(where, document)`` layer in order, then each profile; ``where`` names a bad layer."""
    values: Values = copy.deepcopy(dict(defaults))
    for where, document in layers:
        if document is None:
            continue  # an empty YAML file
        if not isinstance(document, Mapping):
            raise ConfigError(f"{where}: values must be a mapping of keys to values, not {type(document).__name__}")
        values = merge(values, document)
    for name in profiles:
        if name not in PROFILES:
            raise ConfigError(f"unknown profile {name!r}: choose from {', '.join(PROFILES)}")
        values = merge(values, PROFILES[name])
    return values


def validate(values: Mapping[str, object], schema: Mapping[str, object], where: str = "values") -> None:
    """Raise ``ConfigError`` naming every key that breaks the schema (or a rule the schema cannot say)."""
    from jsonschema import Draft202012Validator

    problems = [
        f"{'.'.join(str(p) for p in error.absolute_path) or '(top level)'}: {error.message}"
        for error in sorted(Draft202012Validator(schema).iter_errors(values), key=lambda e: list(e.absolute_path))
    ]
    replicas = values.get("replicas")
    if isinstance(replicas, Mapping):
        low, high = replicas.get("min"), replicas.get("max")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            problems.append(f"replicas: min ({low}) is above max ({high})")
        if low == 0 and values.get("autoscaler") != "keda":
            problems.append("replicas.min: 0 is scale to zero, which needs autoscaler: keda (an HPA stops at 1)")
    problems += _engine_problems(values)
    if problems:
        raise ConfigError(f"{where}: invalid deployment values:\n  " + "\n  ".join(problems))


def _engine_problems(values: Mapping[str, object]) -> list[str]:
    """``engine: vllm`` with a value that only ``preheat serve`` replicas use: it would deploy nothing that works."""
    if values.get("engine") != "vllm":
        return []
    problems = []
    l2, compiled = values.get("l2"), values.get("compile")
    if isinstance(l2, Mapping) and l2.get("backend") == "fs":
        problems.append(
            "l2.backend: fs is the KV volume of preheat serve replicas, which vLLM replicas (engine: vllm) do not "
            "mount: use redis or external (the registry vllm.follow reads)"
        )
    if isinstance(compiled, Mapping) and compiled.get("enabled"):
        problems.append(
            "compile.enabled: preheat serve's torch.compile; vLLM replicas compile as vLLM decides (add "
            "--enforce-eager to vllm.args to turn it off)"
        )
    return problems
