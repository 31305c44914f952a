"""A checkpoint's tokenizer built in a process of its own while the server imports torch (docs/server.md,
*Start-up order*).

Building SmolLM2's tokenizer (``tokenizer.json``'s 49k-token vocabulary and 49k merges) and compiling its chat
template take ~0.12 s of one core, and both hold the GIL the whole time (the ``tokenizers`` library does not release
it while parsing), as ``import torch`` does. On a thread beside the import they therefore lengthen the import by
their own time: a cold start's critical path is the sum of all GIL-holding work. A process of its own runs them on
another core instead, so they cost the start nothing.

``TokenizerProcess.start()`` runs ``python -m preheat.text.process`` at the very start of ``preheat serve`` (a new
interpreter, not a fork: a forked child shares the server's memory copy-on-write, and every page the server then
wrote cost it a fault, measured ~0.1 s of its weight load alone), handing it one end of a socket pair; the child
waits for the checkpoint's path (known only after the fetch). ``build(root)`` sends it; the child builds the
tokenizer, compiles the template, answers with the few facts the engine needs at once (end-of-sequence ids, special
tokens, vocabulary size), and from then on encodes, renders and decodes for the ``ProcessTokenizer`` the engine
holds, one small JSON message each way (~50 us). Once the replica is serving and has been idle ``SETTLE_IDLE_S``
(after the first answers, not before them), ``ProcessTokenizer.settle`` builds this process's own copy on a thread,
switches to it and lets the child go: a long-lived replica keeps no extra process. Should the child die first, the
next call builds the copy at once. ``PREHEAT_TOKENIZER_PROCESS=0`` keeps everything in the server's process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any, TypedDict

from preheat.core import env
from preheat.core.errors import CheckpointError, ChildGoneError, JSONInputError, PreheatError, RequestError
from preheat.core.jsonsafe import MAX_DEPTH, load_object
from preheat.core.timeline import Timeline
from preheat.text.tokenizer import TextTokenizer

log = logging.getLogger("preheat.server")
SETTLE_IDLE_S = 0.5  # quiet time after which the server builds its own copy (one ~0.12 s pause of the GIL)
SETTLE_LATEST_S = 30.0  # ... or this long after serving began, even under steady traffic
_HEADER = struct.Struct("!I")


class Facts(TypedDict):
    """The child's ``{"ready": ...}`` answer: what a ``ProcessTokenizer`` knows without a tokenizer object (each
    value is converted again where it is read: it comes from another process)."""

    eos_ids: list[int]
    special_tokens: dict[str, str]
    vocab_size: int
_PR_SET_PDEATHSIG = 1


def process_allowed() -> bool:
    """Whether the tokenizer may have a process of its own: ``PREHEAT_TOKENIZER_PROCESS`` is not 0."""
    return env.get(env.TOKENIZER_PROCESS)


def _send(sock: socket.socket, message: object) -> None:
    data = json.dumps(message, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(size - got)
        if not chunk:
            raise ChildGoneError("the other end closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> dict[str, Any]:  # Any: a JSON message of this module's own protocol
    """The next message; ``JSONInputError`` (a ``ValueError``) when the other end wrote anything but one object."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    # The frame's length already bounds the size; the depth is bounded because the tokenizer (its files, its code)
    # may send anything: a request's body nests at most MAX_DEPTH deep, and a message wraps it a few levels more.
    return load_object(_recv_exact(sock, size), max_bytes=size, max_depth=MAX_DEPTH + 8)


class TokenizerProcess:
    """The server's handle on its tokenizer process: ``build(root, ...)`` once, then its ``ProcessTokenizer``."""

    def __init__(self, sock: socket.socket, child: subprocess.Popen[bytes]) -> None:
        self._sock, self._child = sock, child
        self.pid = child.pid

    @classmethod
    def start(cls) -> TokenizerProcess | None:
        """Start the child now (see the module docstring); None where ``process_allowed()`` says no or the start
        fails (the tokenizer is then built on a thread, as without a child)."""
        if not process_allowed():
            return None
        parent_end, child_end = socket.socketpair()
        try:
            child = subprocess.Popen(
                [sys.executable, "-m", "preheat.text.process", str(child_end.fileno()), str(os.getpid())],
                pass_fds=(child_end.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # a reader of the server's stdout must see EOF when the server exits
            )
        except OSError as exc:  # out of processes or memory: build on a thread instead
            log.info("tokenizer process not started: %s", exc)
            parent_end.close()
            return None
        finally:
            child_end.close()
        return cls(parent_end, child)

    def build(self, root: str, config_eos_ids: Iterable[int], timeline: Timeline) -> Future[TextTokenizer]:
        """Ask the child for ``root``'s tokenizer, recorded as the ``tokenizer`` stage; the future holds a
        ``ProcessTokenizer`` (or the ``CheckpointError`` the child met) once the child answers."""
        out: Future[TextTokenizer] = Future()
        started, eos = timeline.now(), sorted(config_eos_ids)  # a list: used again below
        try:
            _send(self._sock, {"root": root, "config_eos_ids": eos})
        except OSError:  # the child is gone already: build here, as without one
            self.close()
            return _build_on_thread(root, eos, timeline, out)

        def wait() -> None:  # blocked in recv, the GIL released: costs the start nothing
            try:
                ready = _recv(self._sock)
            except (ChildGoneError, OSError, ValueError):
                self.close()
                _build_on_thread(root, eos, timeline, out, started=started)
                return
            if "error" in ready:
                self.close()
                timeline.add("tokenizer", started, timeline.now(), process="own", failed=True)
                out.set_exception(_error(ready["error"]))
                return
            timeline.add("tokenizer", started, timeline.now(), process="own", pid=self.pid)
            out.set_result(ProcessTokenizer(self, root, eos, ready["ready"]))

        threading.Thread(target=wait, name="preheat-tokenizer", daemon=True).start()
        return out

    def call(self, request: dict[str, object]) -> Any:  # Any: the op's JSON result
        """One request and its answer; ``ChildGoneError`` when the child is not there to answer."""
        try:
            _send(self._sock, request)
            answer = _recv(self._sock)
        except OSError as exc:
            raise ChildGoneError(str(exc)) from None
        except JSONInputError as exc:  # the channel is out of step: as good as gone
            raise ChildGoneError(f"the tokenizer process's answer was refused ({exc})") from None
        if "error" in answer:
            raise _error(answer["error"])
        return answer["ok"]

    def close(self) -> None:
        """Let the child go: it exits when its end of the channel closes, and a thread reaps it (no zombie)."""
        self._sock.close()
        threading.Thread(target=self._child.wait, name="preheat-tokenizer-reap", daemon=True).start()


def build_tokenizer(
    root: str, config_eos_ids: Iterable[int], timeline: Timeline, process: TokenizerProcess | None = None
) -> Future[TextTokenizer]:
    """``root``'s tokenizer with its template compiled, recorded as the ``tokenizer`` stage: built by ``process``
    (``TokenizerProcess.start()``) when there is one, else on a thread of this process."""
    if process is not None:
        return process.build(root, config_eos_ids, timeline)
    return _build_on_thread(root, config_eos_ids, timeline, Future())


def _build_on_thread(
    root: str,
    config_eos_ids: Iterable[int],
    timeline: Timeline,
    out: Future[TextTokenizer],
    started: float | None = None,
) -> Future[TextTokenizer]:
    eos = list(config_eos_ids)

    def run() -> None:
        begin = timeline.now() if started is None else started
        try:
            tokenizer = _build(root, eos)
        except BaseException as exc:  # handed to whoever asks for the result, on the loading thread
            timeline.add("tokenizer", begin, timeline.now(), failed=True)
            out.set_exception(exc)
        else:
            timeline.add("tokenizer", begin, timeline.now())
            out.set_result(tokenizer)

    threading.Thread(target=run, name="preheat-tokenizer", daemon=True).start()
    return out


def _build(root: str, config_eos_ids: Iterable[int]) -> TextTokenizer:
    tokenizer = TextTokenizer.from_dir(root, config_eos_ids=config_eos_ids)
    if tokenizer.template is not None:
        tokenizer.template.compile()  # jinja2's import and the compile: the first chat request's, else
    return tokenizer


def _error(payload: dict[str, str]) -> PreheatError:
    message = payload.get("message", "tokenizer process error")
    if payload.get("kind") == "CheckpointError":
        return CheckpointError(message, path=payload.get("path"))
    return RequestError(message)


class ProcessTokenizer(TextTokenizer):
    """A ``TextTokenizer`` whose work runs in the tokenizer process until ``settle`` builds this process's own copy.

    Thread-safe: one call at a time goes over the channel. The raw ``tokenizers`` object (``self.tokenizer`` of a
    plain ``TextTokenizer``) exists only after the switch; the server uses the methods alone.
    """

    def __init__(self, process: TokenizerProcess, root: str, config_eos_ids: Iterable[int], facts: Facts) -> None:
        # No super().__init__: there is no tokenizer object here until settle() builds one.
        self.eos_ids = frozenset(int(i) for i in facts["eos_ids"])
        self.special_tokens = {str(k): str(v) for k, v in facts["special_tokens"].items()}
        self.template = None  # compiled in the child; render_chat goes there (or to the local copy)
        self.where = root
        self._vocab_size = int(facts["vocab_size"])
        self._config_eos_ids = list(config_eos_ids)
        self._process: TokenizerProcess | None = process
        self._local: TextTokenizer | None = None
        self._channel = threading.Lock()  # one request/answer at a time on the socket
        self._switch = threading.Lock()  # one local build at a time
        self._busy = 0
        self._last = time.monotonic()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def local(self) -> bool:
        """Whether calls now run in this process (the child has been let go)."""
        return self._local is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        local = self._local
        if local is not None:
            return local.encode(text, add_special_tokens=add_special_tokens)
        return [int(i) for i in self._call({"op": "encode", "text": text, "special": add_special_tokens})]

    def decode(self, ids: list[int]) -> str:
        local = self._local
        if local is not None:
            return local.decode(ids)
        return str(self._call({"op": "decode", "ids": ids}))

    def render_chat(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        local = self._local
        if local is not None:
            return local.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return str(self._call({"op": "render_chat", "messages": messages, "generation": add_generation_prompt}))

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        local = self._local
        if local is not None:
            return local.encode_chat(messages)
        return [int(i) for i in self._call({"op": "encode_chat", "messages": messages})]

    def _call(self, request: dict[str, object]) -> Any:  # Any: the op's JSON result
        with self._channel:
            process = self._process
            if process is not None:
                self._busy += 1
                try:
                    return process.call(request)
                except ChildGoneError:
                    log.warning("the tokenizer process is gone; building the tokenizer here")
                finally:
                    self._busy -= 1
                    self._last = time.monotonic()
        self.settle_now()  # the child is gone (or was let go meanwhile): from now on the copy built here
        local = self._local
        assert local is not None  # settle_now() set it or raised
        return _dispatch(local, request)

    def settle_now(self) -> None:
        """Build this process's own copy (if not yet), switch to it and let the child go."""
        with self._switch:
            if self._local is not None:
                return
            local = _build(self.where, self._config_eos_ids)
            with self._channel:
                self._local = local
                process, self._process = self._process, None
            if process is not None:
                process.close()

    def settle(self, idle_s: float = SETTLE_IDLE_S, latest_s: float = SETTLE_LATEST_S) -> threading.Thread:
        """On a thread: once no call has run for ``idle_s`` (or ``latest_s`` after now), ``settle_now``. Called
        when the replica is ready, so the copy's GIL-holding build never delays the first answers."""

        def run() -> None:
            deadline = time.monotonic() + latest_s
            while self._local is None:
                now = time.monotonic()
                if now >= deadline or (self._busy == 0 and now - self._last >= idle_s):
                    try:
                        self.settle_now()
                    except PreheatError as exc:  # the files changed under a running replica: keep the child
                        log.warning("tokenizer: staying with the tokenizer process: %s", exc)
                    return
                time.sleep(min(idle_s, 0.1))

        self._last = time.monotonic()
        thread = threading.Thread(target=run, name="preheat-tokenizer-settle", daemon=True)
        thread.start()
        return thread


def _dispatch(tokenizer: TextTokenizer, request: dict[str, Any]) -> Any:  # Any: JSON in and out
    op = request.get("op")
    if op == "encode":
        return tokenizer.encode(str(request["text"]), add_special_tokens=bool(request.get("special", True)))
    if op == "decode":
        return tokenizer.decode([int(i) for i in request["ids"]])
    if op == "render_chat":
        return tokenizer.render_chat(request["messages"], add_generation_prompt=bool(request.get("generation", True)))
    if op == "encode_chat":
        return tokenizer.encode_chat(request["messages"])
    raise RequestError(f"tokenizer process: unknown operation {op!r}")


def _child(sock: socket.socket, parent: int) -> int:
    """The tokenizer process: build the tokenizer it is asked for, then answer calls until the channel closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides
    _die_with_parent()
    if os.getppid() != parent:  # the server died before the signal was armed
        return 0
    try:
        request = _recv(sock)
    except (ChildGoneError, OSError, ValueError):
        return 0
    try:
        tokenizer = _build(str(request["root"]), [int(i) for i in request["config_eos_ids"]])
    except PreheatError as exc:
        _send(sock, {"error": _payload(exc)})
        return 0
    except Exception as exc:  # anything else is a bad checkpoint to the user, as in-process
        _send(sock, {"error": {"kind": "CheckpointError", "message": f"{request['root']}: tokenizer: {exc}"}})
        return 0
    facts: Facts = {
        "eos_ids": sorted(tokenizer.eos_ids),
        "special_tokens": tokenizer.special_tokens,
        "vocab_size": tokenizer.vocab_size,
    }
    _send(sock, {"ready": facts})
    while True:
        try:
            request = _recv(sock)
        except (ChildGoneError, OSError, ValueError):
            return 0
        try:
            answer: dict[str, object] = {"ok": _dispatch(tokenizer, request)}
        except PreheatError as exc:
            answer = {"error": _payload(exc)}
        except Exception as exc:  # a malformed call is the parent's bug: report it, keep serving
            answer = {"error": {"kind": "RequestError", "message": f"tokenizer process: {type(exc).__name__}: {exc}"}}
        _send(sock, answer)


def _payload(exc: PreheatError) -> dict[str, str]:
    payload = {"kind": type(exc).__name__, "message": str(exc)}
    path = getattr(exc, "path", None)
    if isinstance(path, str):
        payload["path"] = path
    return payload


def _die_with_parent() -> None:
    """Linux: SIGKILL when the server dies, even by SIGKILL (the channel's EOF covers the rest, and other systems)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> int:
    """``python -m preheat.text.process FD PARENT_PID``: what ``TokenizerProcess.start`` runs."""
    fd, parent = int(argv[0]), int(argv[1])
    with socket.socket(fileno=fd) as sock:
        return _child(sock, parent)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
