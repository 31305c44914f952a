"""Reading the small JSON files beside a checkpoint (``config.json``, ``tokenizer_config.json``, ...).

Torch-free on purpose: the router and the planning tools read tokenizer files without importing torch.
"""

from __future__ import annotations

import json
import os
from typing import Any

from preheat.core.errors import CheckpointError


def read_json_object(path: str, *, require_object: bool = False) -> dict[str, Any]:  # Any: JSON values
    """The JSON object in ``path``; ``{}`` when the file is absent (or, unless ``require_object``, holds no object);
    ``CheckpointError`` naming the file when it cannot be read or parsed."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})", path=path) from None
    if not isinstance(doc, dict):
        if require_object:
            raise CheckpointError(f"{path}: must hold a JSON object", path=path)
        return {}
    return doc


def read_config(root: str) -> dict[str, object]:
    """The JSON object in ``root/config.json``, or ``{}`` when there is none."""
    return read_json_object(os.path.join(root, "config.json"), require_object=True)
