"""Reading the small JSON files beside a checkpoint (``config.json``, ``tokenizer_config.json``, ...).

Torch-free on purpose: the router and the planning tools read tokenizer files without importing torch.
"""

from __future__ import annotations

import os
from typing import Any

from preheat.core.errors import CheckpointError, JSONInputError
from preheat.core.jsonsafe import read_bounded
from preheat.sources.base import READ_BYTES_LIMIT


def read_json_object(path: str, *, require_object: bool = False) -> dict[str, Any]:  # Any: JSON values
    """The JSON object in ``path``; ``{}`` when the file is absent (or, unless ``require_object``, holds no object);
    ``CheckpointError`` naming the file when it cannot be read or parsed."""
    if not os.path.isfile(path):
        return {}
    try:  # bounded: a checkpoint's files come from wherever it was downloaded; NaN: Python's json.dumps writes it
        doc = read_bounded(path, max_bytes=READ_BYTES_LIMIT, allow_constants=True)
    except (OSError, JSONInputError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})", path=path) from None
    if not isinstance(doc, dict):
        if require_object:
            raise CheckpointError(f"{path}: must hold a JSON object", path=path)
        return {}
    return doc


def read_config(root: str) -> dict[str, object]:
    """The JSON object in ``root/config.json``, or ``{}`` when there is none."""
    return read_json_object(os.path.join(root, "config.json"), require_object=True)
