"""Request traces in, typed records out: preheat JSON Lines, Mooncake JSON Lines, Azure LLM CSV, BurstGPT CSV.

Formats (spec with examples: docs/plan.md):

- preheat JSON Lines: one object per line with ``prompt`` (text), ``messages`` (chat) or ``token_ids``, and optional
  ``timestamp`` (seconds), ``output_tokens`` and ``input_length`` (a token count when no tokenizer is at hand).
- Mooncake JSON Lines: ``{timestamp (ms), input_length, output_length, hash_ids}``; hash id h names a block of
  ``MOONCAKE_BLOCK`` tokens whose content is synthesized from h (same id, same tokens), so chunk keys can be chained.
- Azure LLM inference CSV: ``TIMESTAMP, ContextTokens, GeneratedTokens`` (TIMESTAMP a date-time or seconds).
- BurstGPT CSV: ``Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type`` (seconds).

A malformed line is reported with its line number and skipped, or raises ``PlanError`` with ``strict=True``.
Columns or keys this module does not know are named once in the ``Problems`` (never fatal: traces carry extras).
"""

from __future__ import annotations

import csv
import math
import os
import warnings
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime

import numpy as np

from preheat.core.errors import JSONInputError, PlanError
from preheat.core.jsonsafe import loads_bounded

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id (the published traces' block size)
CHARS_PER_TOKEN = 4.0  # estimate for text prompts when no tokenizer is given (simulate only needs counts)
_U32 = 2**32
MAX_LINE_BYTES = 64 * 1024 * 1024  # one request: even a long prompt's text or token ids fill a few MiB
MAX_LINE_CONTAINERS = 100_000  # a chat's messages; a line of "[]," would otherwise become millions of lists
_PREHEAT_KEYS = frozenset(
    {"timestamp", "prompt", "messages", "token_ids", "output_tokens", "output_length", "input_length", "max_tokens"}
)
_IGNORED_KEYS = frozenset({"id", "model", "session_id", "metadata"})  # common, known, and not needed here
_MOONCAKE_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
_BURSTGPT_KNOWN = frozenset({*BURSTGPT_COLUMNS, "Model", "Total tokens", "Log Type"})


@dataclass(frozen=True)
class Request:
    """One request of a trace. ``token_ids`` is None until known; ``text``/``messages`` wait for a tokenizer."""

    line: int
    timestamp: float | None
    input_tokens: int
    output_tokens: int
    token_ids: Sequence[int] | None = None  # an array('I') when read from token_ids: 4 bytes a token, not 36
    text: str | None = None
    messages: list[dict[str, str]] | None = None


@dataclass
class Problems:
    """What was wrong with a trace: malformed lines (skipped) and unknown columns (ignored)."""

    path: str
    strict: bool = False
    skipped: list[tuple[int, str]] = field(default_factory=list)
    unknown_columns: set[str] = field(default_factory=set)

    def bad_line(self, line: int, message: str) -> None:
        """Record (or, strict, raise) a malformed line."""
        if self.strict:
            raise PlanError(f"{self.path}:{line}: {message}")
        self.skipped.append((line, message))

    def summary(self, limit: int = 5) -> list[str]:
        """Human-readable notes, the first ``limit`` bad lines in full."""
        notes = [f"{self.path}:{line}: skipped: {message}" for line, message in self.skipped[:limit]]
        if len(self.skipped) > limit:
            notes.append(f"{self.path}: ... and {len(self.skipped) - limit} more malformed line(s) skipped")
        if self.unknown_columns:
            notes.append(f"{self.path}: ignored unknown column(s): {', '.join(sorted(self.unknown_columns))}")
        return notes


def detect_format(path: str) -> str:
    """``jsonl``, ``azure`` or ``burstgpt`` from the file's first line."""
    try:
        with open(path, encoding="utf-8", newline="") as handle:
            first = handle.readline()
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the trace ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise PlanError(f"{path}: not a UTF-8 text trace (JSON Lines or CSV)") from None
    stripped = first.strip()
    if not stripped:
        raise PlanError(f"{path}:1: the trace is empty (expected a JSON object or a CSV header)")
    if stripped.startswith("{"):
        return "jsonl"
    columns = {c.strip() for c in next(csv.reader([stripped]))}
    if set(AZURE_COLUMNS) <= columns:
        return "azure"
    if set(BURSTGPT_COLUMNS) <= columns:
        return "burstgpt"
    raise PlanError(
        f"{path}:1: unknown trace format: not JSON Lines, and the CSV header {sorted(columns)} has neither the Azure "
        f"columns {list(AZURE_COLUMNS)} nor the BurstGPT columns {list(BURSTGPT_COLUMNS)}"
    )


def iter_requests(path: str, problems: Problems) -> Iterator[Request]:
    """Every well-formed request of the trace at ``path``, in file order (text prompts not yet tokenized)."""
    kind = detect_format(path)
    if kind == "jsonl":
        yield from _iter_jsonl(path, problems)
    else:
        yield from _iter_csv(path, kind, problems)


# -- JSON Lines ----------------------------------------------------------------------------------------------------
def _iter_jsonl(path: str, problems: Problems) -> Iterator[Request]:
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                doc = fast_token_ids(raw) or _parse(raw)
            except JSONInputError as exc:  # not JSON, or past a bound: 64 KiB of "[" is a bad line, not a crash
                problems.bad_line(number, str(exc))
                continue
            if not isinstance(doc, dict):
                problems.bad_line(number, f"expected a JSON object, got {type(doc).__name__}")
                continue
            try:
                request = _mooncake(doc, number) if "hash_ids" in doc else _preheat(doc, number)
            except (TypeError, ValueError) as exc:
                problems.bad_line(number, str(exc))
                continue
            known = _MOONCAKE_KEYS if "hash_ids" in doc else _PREHEAT_KEYS
            problems.unknown_columns.update(k for k in doc if k not in known and k not in _IGNORED_KEYS)
            yield request


_KEY = '"token_ids"'
_ID_CHARS = str.maketrans("", "", "0123456789, \t\r\n")  # what a plain list of ids is made of


def fast_token_ids(raw: str) -> dict[str, object] | None:
    """A ``token_ids`` line parsed ~4x faster than ``json.loads`` (numpy reads the list, JSON the few other fields);
    None whenever the line is anything but plain, when the careful path decides (and words the error)."""
    key = raw.find(_KEY)
    opening = raw.find("[", key)
    closing = raw.find("]", opening)
    if key < 0 or opening < 0 or closing < 0 or raw[key + len(_KEY) : opening].strip() != ":":
        return None
    ids = _plain_ids(raw[opening + 1 : closing])
    if ids is None:
        return None
    try:
        doc = _parse(raw[:opening] + "[]" + raw[closing + 1 :])
    except JSONInputError:
        return None
    if not isinstance(doc, dict) or doc.get("token_ids") != []:
        return None
    doc["token_ids"] = ids
    return doc


def _parse(line: str) -> object:
    """One line of JSON, bounded: a trace file may come from anyone."""
    return loads_bounded(line, max_bytes=MAX_LINE_BYTES, max_containers=MAX_LINE_CONTAINERS)


def _plain_ids(body: str) -> array[int] | None:
    """The ids of a JSON list's inside made only of digits, commas and spaces, in 0..2**32-1; else None."""
    ids = array("I")
    if body.translate(_ID_CHARS):  # a sign, a fraction, a string, a nested list: not plain
        return None
    if not body.strip():
        return ids
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # numpy < 2.3 warns and stops at bad input
            values = np.fromstring(body, dtype=np.int64, sep=",")
    except ValueError:  # numpy >= 2.3 raises instead
        return None
    if values.size != body.count(",") + 1 or values.max() >= _U32:
        return None
    ids.frombytes(values.astype(np.uint32).tobytes())
    return ids


def _count(doc: dict[str, object], *names: str, default: int | None = None) -> int:
    for name in names:
        value = doc.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"'{name}' must be a non-negative integer (got {value!r})")
        return value
    if default is None:
        raise ValueError(f"missing '{names[0]}'")
    return default


def _timestamp(value: object, scale: float = 1.0) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"'timestamp' must be a number (got {value!r})")
    return float(value) * scale


def _preheat(doc: dict[str, object], line: int) -> Request:
    timestamp = _timestamp(doc.get("timestamp"))
    output = _count(doc, "output_tokens", "output_length", "max_tokens", default=0)
    given = [name for name in ("token_ids", "prompt", "messages") if doc.get(name) is not None]
    if len(given) != 1:
        raise ValueError(
            "needs exactly one of 'token_ids', 'prompt', 'messages'" + (f" (got {given})" if given else "")
        )
    raw_ids = doc.get("token_ids")
    if raw_ids is not None:
        ids = raw_ids if isinstance(raw_ids, array) else _packed(raw_ids)
        return Request(line, timestamp, len(ids), output, token_ids=ids)
    prompt = doc.get("prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"'prompt' must be a string (got {type(prompt).__name__})")
        estimate = _count(doc, "input_length", default=round(len(prompt) / CHARS_PER_TOKEN))
        return Request(line, timestamp, estimate, output, text=prompt)
    messages = doc.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError("'messages' must be a list of {'role': str, 'content': str} objects")
    chars = sum(len(m["content"]) for m in messages)
    estimate = _count(doc, "input_length", default=round(chars / CHARS_PER_TOKEN))
    return Request(line, timestamp, estimate, output, messages=messages)


def _packed(value: object) -> array[int]:
    """``value`` as 32-bit token ids; ``ValueError`` unless it is a list of integers in 0..2**32-1."""
    if isinstance(value, list) and not any(isinstance(t, bool) for t in value):
        try:
            return array("I", value)  # checks each id at C speed: OverflowError out of range, TypeError not an int
        except (OverflowError, TypeError):
            pass
    raise ValueError("'token_ids' must be a list of integers in 0..2**32-1")


def _mooncake(doc: dict[str, object], line: int) -> Request:
    timestamp = _timestamp(doc.get("timestamp"), scale=1e-3)  # Mooncake traces count milliseconds
    length = _count(doc, "input_length")
    output = _count(doc, "output_length", default=0)
    hashes = doc.get("hash_ids")
    if not isinstance(hashes, list) or not all(type(h) is int and h >= 0 for h in hashes):
        raise ValueError("'hash_ids' must be a list of non-negative integers")
    if len(hashes) * MOONCAKE_BLOCK < length:
        raise ValueError(f"{len(hashes)} hash id(s) of {MOONCAKE_BLOCK} tokens cannot cover input_length {length}")
    return Request(line, timestamp, length, output, token_ids=mooncake_tokens(hashes, length))


def mooncake_tokens(hash_ids: list[int], length: int, block: int = MOONCAKE_BLOCK) -> list[int]:
    """Stand-in token ids for a Mooncake request: block h is ``h*block .. h*block+block-1`` (mod 2**32), so equal
    hash ids give equal tokens and different ids different ones (below 2**32 / block ids).

    >>> mooncake_tokens([0, 7], 5, block=4)
    [0, 1, 2, 3, 28]
    """
    ids: list[int] = []
    for h in hash_ids:
        if len(ids) >= length:
            break
        base = (h * block) % _U32
        ids.extend(range(base, min(base + block, _U32)))
    return ids[:length]


# -- CSV -----------------------------------------------------------------------------------------------------------
def _iter_csv(path: str, kind: str, problems: Problems) -> Iterator[Request]:
    stamp_col, input_col, output_col = AZURE_COLUMNS if kind == "azure" else BURSTGPT_COLUMNS
    known = set(AZURE_COLUMNS) if kind == "azure" else set(_BURSTGPT_KNOWN)
    origin: float | None = None
    parse_stamp = _StampParser()
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.reader(handle)
        header = [c.strip() for c in next(reader)]
        problems.unknown_columns.update(c for c in header if c not in known)
        at = {name: header.index(name) for name in (stamp_col, input_col, output_col)}
        width = len(header)
        for row in reader:
            number = reader.line_num
            if not row:
                continue
            if len(row) != width:
                problems.bad_line(number, f"{len(row)} field(s), the header has {width}")
                continue
            try:
                stamp = parse_stamp(row[at[stamp_col]])
                n_in, n_out = int(row[at[input_col]]), int(row[at[output_col]])
                if n_in < 0 or n_out < 0:
                    raise ValueError("token counts must not be negative")
            except ValueError as exc:
                problems.bad_line(number, f"{exc}")
                continue
            origin = stamp if origin is None else origin
            yield Request(number, stamp - origin, n_in, n_out)


class _StampParser:
    """Seconds from a CSV timestamp: a number, or an ISO date-time (Azure writes 7 fractional digits)."""

    def __init__(self) -> None:
        self._whole: dict[str, float] = {}  # date-time to the second -> epoch; traces repeat seconds many times

    def __call__(self, text: str) -> float:
        text = text.strip()
        try:
            return float(text)
        except ValueError:
            pass
        whole, _, fraction = text.partition(".")
        base = self._whole.get(whole)
        if base is None:
            try:
                base = datetime.fromisoformat(whole).timestamp()
            except ValueError:
                raise ValueError(f"timestamp {text!r} is neither seconds nor an ISO date-time") from None
            self._whole[whole] = base
        if fraction and not fraction.isdigit():
            raise ValueError(f"timestamp {text!r} has a malformed fraction of a second")
        return base + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


# -- tokenization --------------------------------------------------------------------------------------------------
Encoder = Callable[[list[Request]], list[list[int]]]


def with_tokens(requests: Iterable[Request], encode: Encoder | None, *, batch: int = 256) -> Iterator[Request]:
    """``requests`` with ``token_ids`` filled in, text and chats tokenized ``batch`` at a time by ``encode``.

    Without an encoder, requests that have only text raise ``PlanError`` naming the line.
    """
    pending: list[Request] = []

    def flush() -> Iterator[Request]:
        todo = [r for r in pending if r.token_ids is None]  # requests with ids only wait here to keep file order
        if todo and encode is None:
            raise PlanError(f"line {todo[0].line}: a text prompt needs a tokenizer: pass --model CHECKPOINT")
        encoded = iter(encode(todo) if todo and encode is not None else [])
        for request in pending:
            if request.token_ids is not None:
                yield request
            else:
                ids = next(encoded)
                yield replace(request, token_ids=ids, input_tokens=len(ids), text=None, messages=None)
        pending.clear()

    for request in requests:
        if request.token_ids is not None and not pending:
            yield request  # the common fast path: token ids or Mooncake hashes, nothing to wait for
            continue
        pending.append(request)
        if len(pending) >= batch:
            yield from flush()
    if pending:
        yield from flush()


# -- arrays for the simulator --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceArrays:
    """A trace as columns, sorted by arrival: seconds from the first request, prompt and output token counts."""

    arrival: np.ndarray  # float64 seconds, starting at 0
    input_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.arrival.shape[0])

    @classmethod
    def from_columns(cls, arrival: Iterable[float], inputs: Iterable[int], outputs: Iterable[int]) -> TraceArrays:
        """Build from three columns (any order of arrival; sorted here, origin moved to 0)."""
        times = np.asarray(list(arrival), dtype=np.float64)
        order = np.argsort(times, kind="stable")
        times = times[order]
        start = times[0] if times.size else 0.0
        return cls(
            times - start,
            np.asarray(list(inputs), dtype=np.int64)[order],
            np.asarray(list(outputs), dtype=np.int64)[order],
        )


def read_arrays(path: str, problems: Problems) -> TraceArrays:
    """The trace at ``path`` as arrays for ``simulate``: every request needs a timestamp."""
    times: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for request in iter_requests(path, problems):
        if request.timestamp is None:
            problems.bad_line(request.line, "no 'timestamp': the simulator needs arrival times")
            continue
        times.append(request.timestamp)
        inputs.append(request.input_tokens)
        outputs.append(request.output_tokens)
    if not times:
        raise PlanError(f"{os.fspath(path)}: no usable requests in the trace")
    return TraceArrays.from_columns(times, inputs, outputs)
