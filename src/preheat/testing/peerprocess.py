"""``python -m preheat.peer ARGS`` as a child process for benchmarks: it prints ``... at ADDRESS`` once it serves."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence

from preheat.core.errors import ProcessError
from preheat.core.procs import end, pdeathsig


class PeerProcess:
    """A seed peer (``python -m preheat.peer DIR``, ``--artifacts`` and the rest in ``args``) that dies with its
    parent; ``address`` is known once the constructor returns. ``ProcessError`` when it exits before serving."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "preheat.peer", *args],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=None if env is None else dict(env),
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " at " not in line:
            self.close()
            raise ProcessError(f"the peer did not start: {line!r}")
        self.address = line.rsplit(" at ", 1)[1].strip()

    def close(self) -> None:
        end(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
