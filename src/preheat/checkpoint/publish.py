"""Publishing a directory atomically: everything fsynced, then one rename; leftovers of killed writers cleaned up.

A reader sees either nothing or the whole directory. A writer killed outright leaves only ``TARGET.tmp-<pid>``, which
the next writer to the same target removes once that process is gone.
"""

from __future__ import annotations

import os
import re
import shutil

from preheat.core import durable
from preheat.core.errors import ConfigError


def write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` (creating its directory) atomically and durably (``durable.write_file``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    durable.write_file(path, data)


def publish_dir(tmp: str, target: str, *, force: bool) -> None:
    """Move the verified ``tmp`` into place; an existing ``target`` (``force`` only) is swapped out first."""
    for current, _, _ in os.walk(tmp):
        durable.fsync_dir(current)
    if os.path.lexists(target):
        if not force:
            raise ConfigError(f"{target}: appeared while it was being written; pass --force to replace it")
        old = f"{target}.old-{os.getpid()}"
        os.replace(target, old)
        try:
            os.replace(tmp, target)
        except BaseException:
            os.replace(old, target)
            raise
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        else:
            os.unlink(old)
    else:
        os.replace(tmp, target)
    # A rename is durable only once its directory is synced; without it a power loss can undo the publish.
    durable.fsync_dir(os.path.dirname(target))


def remove_stale_temps(target: str) -> None:
    """Remove ``target.tmp-<pid>`` directories left by writers that were killed (their process is gone)."""
    parent, base = os.path.split(target)
    pattern = re.compile(re.escape(base) + r"\.tmp-(\d+)")
    for entry in os.listdir(parent):
        match = pattern.fullmatch(entry)
        if match and (int(match.group(1)) == os.getpid() or not _alive(int(match.group(1)))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
