"""The soak's users: the prompts they send, the requests themselves, and the verdict on every answer.

Pure parts (prompts, verdicts, statistics) take values and return values; ``ask``, ``run_users`` and ``references``
speak HTTP. Used by ``bench/soak.py`` (its docstring describes the workload and the verdicts).
"""

from __future__ import annotations

import http.client
import json
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

_TOPICS = ("harbour", "lantern", "ledger", "compass", "tide", "anchor", "beacon", "chart", "keeper", "signal", "storm",
           "current", "reef", "island", "channel", "buoy", "pilot", "cargo", "sail", "rope", "mast", "deck", "hull",
           "keel", "rudder", "voyage", "port", "starboard", "latitude", "longitude")  # fmt: skip
_QUESTIONS = (
    "Summarise the rules above in one line.", "Which rule matters most at night?", "What should a new keeper learn?",
    "Name one thing to check every morning.", "What happens when the lamp fails?", "Who must be told of a wreck?",
    "How often is the ledger signed?", "What is forbidden in a storm?", "Give an example of a good signal.",
    "Why does the chart matter?", "What comes after the evening round?", "Which tool is kept by the door?",
)  # fmt: skip
VERDICTS = ("ok", "differ", "cut", "failed")


# -- the workload -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One distinct prompt: a shared system prompt and a short question."""

    system: int
    question: int
    messages: tuple[tuple[str, str], ...]

    @property
    def key(self) -> str:
        return f"s{self.system}q{self.question}"

    def body(self, max_tokens: int, stream: bool) -> dict[str, Any]:  # Any: a JSON request body
        body: dict[str, Any] = {
            "messages": [{"role": role, "content": content} for role, content in self.messages],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def make_prompts(seed: int, systems: int, system_words: int, questions: int) -> list[Prompt]:
    """``systems`` x ``questions`` prompts; every system prompt is shared by ``questions`` of them."""
    rng = random.Random(f"{seed}:prompts")
    out = []
    for s in range(systems):
        rules = " ".join(rng.choice(_TOPICS) for _ in range(system_words))
        system = f"You are keeper number {s} of the lighthouse. The rules of the house: {rules}."
        for q in range(questions):
            question = _QUESTIONS[q % len(_QUESTIONS)] + ("" if q < len(_QUESTIONS) else f" ({q})")
            out.append(Prompt(s, q, (("system", system), ("user", question))))
    return out


# -- answers, faults and verdicts ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """What greedy decoding must reproduce exactly."""

    text: str
    completion_tokens: int
    finish_reason: str | None


@dataclass
class Outcome:
    """One request as the client saw it; times are ``time.monotonic()``."""

    user: int
    prompt: str
    stream: bool
    started: float
    ended: float = 0.0
    first_event: float | None = None
    status: int | None = None
    replica: str | None = None
    route: str | None = None
    answer: Answer | None = None  # set when the answer is complete
    partial: str = ""  # the text received before the answer was cut
    error: str | None = None  # why it was cut or failed
    cut: bool = False  # the router ended it with replica_failed: the replica died after it started answering
    cached_tokens: int = 0
    prompt_tokens: int = 0
    verdict: str = ""  # one of VERDICTS, set by judge()

    @property
    def ttft(self) -> float | None:
        return None if self.first_event is None else self.first_event - self.started


@dataclass(frozen=True)
class Fault:
    """One injected fault; ``at`` is ``time.monotonic()`` when it struck."""

    kind: str
    target: str  # a replica URL, the Redis URL, or the L2 files damaged
    at: float
    seconds: float = 0.0  # how long the target was out: kill -> back in rotation, stop -> cont, Redis down


def judge(outcomes: Sequence[Outcome], references: dict[str, Answer], faults: Sequence[Fault]) -> None:
    """Set each outcome's verdict. A cut is honest only if a ``replica_kill`` of its replica struck while it was
    open and what it received so far is a prefix of the reference; any other cut is a failure."""
    kills = [f for f in faults if f.kind == "replica_kill"]
    for o in outcomes:
        want = references[o.prompt]
        if o.answer is not None:
            o.verdict = "ok" if o.answer == want else "differ"
        elif o.cut and not want.text.startswith(o.partial):
            o.verdict = "differ"
        elif o.cut and any(k.target == o.replica and o.started <= k.at <= o.ended for k in kills):
            o.verdict = "cut"
        else:
            o.verdict = "failed"
            if o.cut:
                o.error = f"cut with no kill of {o.replica} while it was open: {o.error}"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def phase_stats(outcomes: Sequence[Outcome]) -> dict[str, Any]:  # Any: JSON-ready values
    """Requests per verdict, TTFT (streamed, complete answers) and latency percentiles, and the share of prompt
    tokens restored from a KV tier."""
    complete = [o for o in outcomes if o.verdict in ("ok", "differ")]
    ttfts = [o.ttft for o in complete if o.ttft is not None]
    latencies = [o.ended - o.started for o in complete]
    prompt_tokens = sum(o.prompt_tokens for o in outcomes)
    return {
        "sent": len(outcomes),
        **{v: sum(o.verdict == v for o in outcomes) for v in VERDICTS},
        "streamed": sum(o.stream for o in outcomes),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "latency_p50_s": percentile(latencies, 0.5),
        "latency_p99_s": percentile(latencies, 0.99),
        "cached_share": sum(o.cached_tokens for o in outcomes) / prompt_tokens if prompt_tokens else 0.0,
    }


def detail(outcome: Outcome, t0: float) -> dict[str, Any]:  # Any: JSON-ready values
    """Everything about one outcome, its times in seconds since the load started."""
    return asdict(outcome) | {"started": outcome.started - t0, "ended": outcome.ended - t0}


def brief(outcome: Outcome, t0: float) -> dict[str, Any]:  # Any: JSON-ready values
    """One line of the report's request log."""
    o = outcome
    return {"started": o.started - t0, "ttft": o.ttft, "seconds": o.ended - o.started, "verdict": o.verdict,
            "stream": o.stream, "replica": o.replica, "route": o.route, "cached_tokens": o.cached_tokens}  # fmt: skip


# -- requests (I/O) -----------------------------------------------------------------------------------------------
def ask(url: str, prompt: Prompt, *, user: int, stream: bool, max_tokens: int, timeout: float) -> Outcome:
    """Send one chat request to ``url`` and record what came back; a network failure is recorded, not raised."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    outcome = Outcome(user, prompt.key, stream, time.monotonic())
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        body = json.dumps(prompt.body(max_tokens, stream))
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        outcome.status = response.status
        outcome.replica = response.getheader("X-Preheat-Replica")
        outcome.route = response.getheader("X-Preheat-Route")
        if stream and response.status == 200:
            _read_stream(response, outcome)
        else:
            _read_whole(response, outcome)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        outcome.ended = time.monotonic()
    return outcome


def _read_whole(response: http.client.HTTPResponse, outcome: Outcome) -> None:
    payload = json.loads(response.read() or b"{}")
    if response.status != 200:
        error = payload.get("error") or {}
        outcome.cut = response.status == 502 and error.get("code") == "replica_failed"
        outcome.error = f"{response.status} {error.get('code')}: {error.get('message')}"
        return
    choice, usage = payload["choices"][0], payload.get("usage") or {}
    outcome.answer = Answer(choice["message"]["content"], int(usage["completion_tokens"]), choice["finish_reason"])
    _count_cached(outcome, usage)


def _read_stream(response: http.client.HTTPResponse, outcome: Outcome) -> None:
    parts: list[str] = []
    finish: str | None = None
    usage: dict[str, Any] = {}  # Any: OpenAI usage JSON
    done = False
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        if outcome.first_event is None:
            outcome.first_event = time.monotonic()
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            outcome.cut = event["error"].get("code") == "replica_failed"
            outcome.error = f"stream error {event['error'].get('code')}: {event['error'].get('message')}"
            outcome.partial = "".join(parts)
            return
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            parts.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    if not done or "completion_tokens" not in usage:
        outcome.error = "stream ended without [DONE] and usage"
        return
    outcome.answer = Answer("".join(parts), int(usage["completion_tokens"]), finish)
    _count_cached(outcome, usage)


def _count_cached(outcome: Outcome, usage: dict[str, Any]) -> None:  # Any: OpenAI usage JSON
    outcome.prompt_tokens = int(usage.get("prompt_tokens", 0))
    outcome.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def references(url: str, prompts: Sequence[Prompt], max_tokens: int) -> dict[str, Answer]:
    """Each prompt's answer from a replica with no KV tier, asked once (streamed answers are compared with it too:
    a stream's text must be the same as the whole answer's)."""
    out = {}
    for prompt in prompts:
        reply = ask(url, prompt, user=-1, stream=False, max_tokens=max_tokens, timeout=300)
        if reply.answer is None:
            raise SystemExit(f"the reference replica did not answer {prompt.key}: {reply.error}")
        out[prompt.key] = reply.answer
    return out


@dataclass(frozen=True)
class Users:
    """The closed-loop users: each sends its next request as soon as its last one ended (after up to ``think`` s)."""

    count: int
    seed: int
    stream_share: float  # probability that a request is streamed
    max_tokens: int
    think: float
    timeout: float  # a client gives up on a request after this long


def run_users(url: str, prompts: Sequence[Prompt], users: Users, stop: threading.Event) -> list[Outcome]:
    """Run ``users`` against ``url`` until ``stop`` is set; every outcome, in no particular order."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        rng = random.Random(f"{users.seed}:user:{u}")
        while not stop.is_set():
            prompt, stream = rng.choice(prompts), rng.random() < users.stream_share
            outcome = ask(url, prompt, user=u, stream=stream, max_tokens=users.max_tokens, timeout=users.timeout)
            with lock:
                outcomes.append(outcome)
            stop.wait(rng.uniform(0.0, users.think))

    threads = [threading.Thread(target=user, args=(u,), name=f"user {u}", daemon=True) for u in range(users.count)]
    for thread in threads:
        thread.start()
    stop.wait()
    for thread in threads:
        thread.join(users.timeout + 5)
    with lock:
        return list(outcomes)
