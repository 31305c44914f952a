"""Fault soak: a router, 3 replicas and two L2 stores under steady load, while a scheduler breaks them on purpose.

    python bench/soak.py [--duration 150] [--seed 0] [--users 6] [--model tiny|smollm2|DIR] [--json out.json]
                         [--faults replica_kill,replica_stop,hostile_replica,redis_kill,l2_truncate,l2_corrupt,
                                   rogue_publisher,l2_forge] [--mac]

The fleet, all on 127.0.0.1, every process in its own process group:

- replicas 1 and 2 share an ``fs://`` L2 directory, replica 3 uses a ``redis-server`` L2; each has a small L1
  (``--kv-l1``, about two system prompts' K/V), so chunks keep moving between the tiers; each follows the weight
  versions a trainer in this process publishes (``--follow``, a ``file://`` registry, ``--refit-trust-key``: its
  versions are the model's own weights, so every version answers alike);
- one ``preheat router`` (``--policy kv`` by default) in front of them, and of a hostile replica that is out of
  rotation (its ``/health`` says 503) except during a ``hostile_replica`` fault;
- a reference replica with no KV tier, which answers every distinct prompt once before the soak and is then stopped.

Load: ``--users`` client threads, each sending one request after another for ``--duration`` seconds: a chat of one
of ``--systems`` long shared system prompts plus one of the ``--questions`` short questions (seeded choices), greedy,
``--max-tokens`` tokens, streamed with probability ``--stream-share`` (else a plain JSON answer).

Faults, after a fault-free first ``--calm`` share of the run, on three seeded schedulers that run side by side:

- replicas (one fault at a time): ``replica_kill`` (SIGKILL, restarted on the same port at once, then waited for
  until the router has it in rotation again), ``replica_stop`` (SIGSTOP for 1-5 s, then SIGCONT) and
  ``hostile_replica`` (the hostile replica says it is healthy for 2-5 s and answers each request the router sends it
  with a 1 TiB Content-Length, a first event that never ends, or a stream cut mid-event: refusals the router must
  retry on another replica before the client hears anything, and count; bench/soak_attacks.py);
- storage: ``redis_kill`` (SIGKILL, down for 0.5-3 s, restarted empty on the same port), ``l2_truncate`` and
  ``l2_corrupt`` (1-3 chunk files of the ``fs://`` L2 cut short, or one byte of each flipped, in place);
- publishers: ``rogue_publisher`` (under the trainer's name, version 10**17 with a zeroed q_proj signed by another
  key and 10**17+1 unsigned, then the trainer's next version; the fault lasts until every replica serves the
  trainer's: the rogues must be counted as liars and never served);
- on request only (``--faults``): ``l2_forge``, 1-3 chunk files rewritten as an attacker with write access to the
  store would: every K/V value negated and the checksum fixed. Nothing but a fleet secret catches that, so without
  ``--mac`` (the replicas share a ``--kv-secret-file``) answers differ: the negative control that shows the
  comparison below can fail.

Each scheduler runs its kinds in a seeded shuffled order, cycle after cycle, and the fault phase lasts at least until
every kind was injected once (a test on a slow machine then cannot pass without them). Which faults happen in which
order is fixed by ``--seed``; when they land relative to requests depends on the machine.

Every answer is classified:

- ``ok``: identical to the reference answer for its prompt (text, completion tokens and finish reason). The tiny
  random-weight model decodes many of its tokens to U+FFFD, so its text says less than a real model's; ``l2_forge``
  without ``--mac`` shows that wrong K/V still change it (``--model smollm2`` for readable answers);
- ``differ``: complete but not identical (target 0: wrong K/V were used somewhere);
- ``cut``: the replica was SIGKILLed after it had started answering, so the router could not retry it (docs/router.md:
  only failures before the first byte are retried) and ended the answer with ``replica_failed``. A replica sends a
  plain JSON answer's first byte only once it is complete, a streamed one's with its first token, so cuts are
  streamed requests killed mid-generation. A cut counts only if a ``replica_kill`` of that very replica happened
  while the request was open and the partial text is a prefix of the reference; any other cut is ``failed``;
- ``failed``: everything else (an error status, a broken connection, a timeout). Target 0.

Reported: requests per class for the fault-free phase and the fault phase, p50 and p99 TTFT (streamed requests:
request sent -> first event) in each phase and their ratio, faults injected per kind, the router's retries and
ejections, the replicas' KV counters (hits per tier, corrupt chunks caught), the hostile replica's answers beside the
router's refusals of them (``preheat_router_refused_answers_total``), and the versions served beside the lies counted
(``preheat_refit_lies_total``). Exit status 1 when any answer differed or failed, a fault kind was never injected,
a hostile answer was not refused and counted, or a rogue version was served or not counted as a lie.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from soak_attacks import HOSTILE_MODES
from soak_clients import Outcome, Prompt, Users, brief, detail, judge, make_prompts, phase_stats, references, run_users
from soak_fleet import (
    DEFAULT_KINDS,
    FAULT_KINDS,
    START_TIMEOUT,
    Fleet,
    FleetConfig,
    Scheduler,
    kv_counters,
    metrics,
    served_version,
)

FAULT_LABELS = {
    "replica_kill": "replica SIGKILL, restarted",
    "replica_stop": "replica SIGSTOP 1-5 s, SIGCONT",
    "redis_kill": "redis-server SIGKILL 0.5-3 s, restarted empty",
    "l2_truncate": "fs:// L2 chunk files truncated",
    "l2_corrupt": "fs:// L2 chunk files, one byte flipped",
    "l2_forge": "fs:// L2 chunks forged (K/V negated, checksum fixed)",
    "hostile_replica": "hostile replica in rotation 2-5 s (answers the router must refuse)",
    "rogue_publisher": "rogue publishers (zeroed q_proj, far version; other key, unsigned), then the trainer's next",
}
EXTRA_FAULT_SECONDS = 120.0  # how far the fault phase may run past --duration to inject every kind once


# -- the run ------------------------------------------------------------------------------------------------------
def soak(
    fleet: Fleet, prompts: Sequence[Prompt], args: argparse.Namespace, say: Callable[[str], None]
) -> dict[str, Any]:  # Any: the JSON report
    """Start the fleet, compute the references, run the calm phase then the fault phase, and judge every answer."""
    say("starting redis-server, the reference replica and 3 replicas ...")
    fleet.start()
    assert fleet.reference is not None
    say(f"asking the replica with no KV tier for the reference answers of {len(prompts)} prompts ...")
    refs = references(fleet.reference.wait_address(), prompts, args.max_tokens)
    fleet.stop_reference()
    router = fleet.start_router()
    say(f"router {router} ({args.policy}): {args.users} users for {args.duration:.0f} s, faults after {args.calm:.0%}")
    users = Users(args.users, args.seed, args.stream_share, args.max_tokens, args.think, args.request_timeout)
    scheduler = Scheduler(fleet, router, args.seed, args.faults)
    stop = threading.Event()
    result: list[list[Outcome]] = []
    loader = threading.Thread(target=lambda: result.append(run_users(router, prompts, users, stop)), daemon=True)
    t0 = time.monotonic()
    loader.start()
    try:
        time.sleep(args.duration * args.calm)
        fault_start = time.monotonic()
        say(f"faults from now on: {', '.join(scheduler.kinds)}")
        scheduler.start()
        time.sleep(max(0.0, t0 + args.duration - time.monotonic()))
        scheduler.phase_over.set()
        scheduler.join(EXTRA_FAULT_SECONDS)
    finally:
        scheduler.hard_stop.set()
        stop.set()
    # A fault under way finishes its recovery (a restart, a SIGCONT) before the fleet is judged; on Ctrl-C, nothing
    # is waited for: Fleet.close() kills what there is, and no fault can start anything after it.
    scheduler.join(START_TIMEOUT)
    fault_end = time.monotonic()
    say(f"faults over after {fault_end - fault_start:.0f} s; waiting for the last answers and the fleet's recovery")
    loader.join(args.request_timeout + 30)
    recovered = True
    try:
        fleet.wait_in_rotation(router, [r.url for r in fleet.replicas])
    except TimeoutError as exc:
        recovered, scheduler.errors = False, [*scheduler.errors, str(exc)]
    outcomes = result[0] if result else []
    judge(outcomes, refs, scheduler.faults)
    calm = [o for o in outcomes if o.started < fault_start]
    faulty = [o for o in outcomes if o.started >= fault_start]
    stats = {"calm": phase_stats(calm), "faults": phase_stats(faulty), "total": phase_stats(outcomes)}
    router_metrics = metrics(router)
    counters: dict[str, float] = {}
    for replica in fleet.replicas:
        for incarnation in [*replica.counters, kv_counters(replica.url)]:
            for name, value in incarnation.items():
                counters[name] = counters.get(name, 0.0) + value
    hostile = fleet.hostile
    refused = {k: v for k, v in router_metrics.items() if k.startswith("preheat_router_refused_answers_total")}
    assert fleet.trainer is not None
    return {
        "phases": stats,
        "ttft_ratio": {q: ratio(stats["faults"][f"ttft_{q}_s"], stats["calm"][f"ttft_{q}_s"]) for q in ("p50", "p99")},
        "seconds": {"calm": fault_start - t0, "faults": fault_end - fault_start},
        "faults": scheduler.injected(),
        "fault_log": [asdict(f) | {"at": f.at - t0} for f in sorted(scheduler.faults, key=lambda f: f.at)],
        "fault_errors": scheduler.errors,
        "recovered": recovered,
        "router": {
            "retries": router_metrics.get("preheat_router_retries_total", 0.0),
            "ejections": sum(v for k, v in router_metrics.items() if k.startswith("preheat_router_ejections_total")),
            "errors": {k: v for k, v in router_metrics.items() if k.startswith("preheat_router_errors_total")},
        },
        "kv": counters,
        "hostile": {
            "answered": {mode: hostile.answered[mode] for mode in HOSTILE_MODES},
            "refused": {code: refused_by(refused, hostile.url, code) for code in HOSTILE_MODES.values()},
            "refused_from_honest_replicas": sum(v for k, v in refused.items() if hostile.url not in k),
        },
        "refit": {
            "trainer_version": fleet.trainer.version,
            "served": {r.url: served_version(r.url) for r in fleet.replicas},
            "lies": counters.get("refit_lies", 0.0),
            "rogue_tensors_served": fleet.trainer.rogue_tensors_served,
        },
        "problems": [detail(o, t0) for o in outcomes if o.verdict in ("differ", "failed")],
        "cuts": [detail(o, t0) for o in outcomes if o.verdict == "cut"],
        "requests": [brief(o, t0) for o in sorted(outcomes, key=lambda o: o.started)],
        "references": {key: asdict(answer) for key, answer in refs.items()},
    }


def refused_by(refused: dict[str, float], replica: str, code: str) -> float:
    """The router's count of answers from ``replica`` it refused with ``code``."""
    return sum(v for k, v in refused.items() if f'code="{code}"' in k and f'replica="{replica}"' in k)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# -- the report ---------------------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f} ms"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(report: dict[str, Any]) -> str:  # Any: the JSON report
    """The results as Markdown tables (pasted into docs/benchmarks.md as they are)."""
    phases, seconds = report["phases"], report["seconds"]
    lines = [
        "| phase | seconds | sent | ok | differ | cut mid-answer | failed | TTFT p50 | TTFT p99 | latency p99 "
        "| cached |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, label in (("calm", "fault-free"), ("faults", "faults"), ("total", "total")):
        p = phases[name]
        secs = seconds.get(name, seconds["calm"] + seconds["faults"])
        lines.append(
            f"| {label} | {secs:.0f} | {p['sent']} | {p['ok']} | {p['differ']} | {p['cut']} | {p['failed']} | "
            f"{_ms(p['ttft_p50_s'])} | {_ms(p['ttft_p99_s'])} | {_ms(p['latency_p99_s'])} | {p['cached_share']:.0%} |"
        )
    r = report["ttft_ratio"]
    lines += ["", f"TTFT during faults / fault-free: p50 {_x(r['p50'])}, p99 {_x(r['p99'])}", ""]
    lines += ["| fault | injected |", "| --- | ---: |"]
    lines += [f"| {FAULT_LABELS[kind]} | {n} |" for kind, n in report["faults"].items()]
    kv, router = report["kv"], report["router"]
    lines += [
        "",
        f"router: {router['retries']:.0f} retries, {router['ejections']:.0f} ejections; "
        f"replicas: {kv.get('hits_l1', 0):.0f} L1 and {kv.get('hits_l2', 0):.0f} L2 chunk hits, "
        f"{kv.get('corrupt_l2', 0):.0f} corrupt L2 chunks caught, {kv.get('errors_l2', 0):.0f} L2 errors; "
        f"fleet back in rotation at the end: {'yes' if report['recovered'] else 'NO'}",
    ]
    hostile, refit = report["hostile"], report["refit"]
    if sum(hostile["answered"].values()):
        answered = ", ".join(f"{n} {mode}" for mode, n in hostile["answered"].items())
        counted = ", ".join(f"{n:.0f} {code}" for code, n in hostile["refused"].items())
        lines.append(f"hostile replica: answered {answered}; router refused and counted {counted}")
    if "rogue_publisher" in report["faults"]:
        versions = sorted({str(v) for v in refit["served"].values()})
        lines.append(
            f"refit: replicas serve version {', '.join(versions)} (the trainer's: {refit['trainer_version']}); "
            f"{refit['lies']:.0f} lies counted; tensors the rogues served: {refit['rogue_tensors_served']}"
        )
    return "\n".join(lines)


def passed(report: dict[str, Any]) -> bool:  # Any: the JSON report
    """No answer differed or failed, every fault kind struck and the fleet recovered; the attacks were caught: each
    hostile answer refused and counted by the router, the rogue versions counted as lies and never served."""
    total, hostile, refit, faults = report["phases"]["total"], report["hostile"], report["refit"], report["faults"]
    return (
        total["differ"] == 0
        and total["failed"] == 0
        and all(faults.values())
        and report["recovered"]
        and not report["fault_errors"]
        and all(hostile["refused"][code] == hostile["answered"][mode] for mode, code in HOSTILE_MODES.items())
        and ("rogue_publisher" not in faults or (refit["lies"] > 0 and refit["rogue_tensors_served"] == 0
                                                 and set(refit["served"].values()) == {refit["trainer_version"]}))
    )  # fmt: skip


def model_dir(spec: str, workdir: Path) -> str:
    if spec == "tiny":
        from preheat.checkpoint.manifest import MANIFEST_NAME, build_manifest
        from preheat.testing.synthetic import make_tiny_servable_model

        root = make_tiny_servable_model(workdir / "model")
        (root / MANIFEST_NAME).write_bytes(build_manifest(str(root)).to_json())  # the identity an L2 requires
        return str(root)
    if spec == "smollm2":
        from preheat.cli.demo import smollm2_checkpoint

        return smollm2_checkpoint(say=lambda line: print(line, file=sys.stderr))
    return spec


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so that ``finally`` kills every child either way."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def kinds(text: str) -> tuple[str, ...]:
    """``--faults``: known kinds, in the order given."""
    out = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in out if k not in FAULT_KINDS]
    if unknown or not out:
        raise argparse.ArgumentTypeError(f"unknown fault kind(s) {unknown}: choose from {', '.join(FAULT_KINDS)}")
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=150.0, help="seconds of load, calm phase included (150)")
    parser.add_argument("--calm", type=float, default=0.25, help="share of --duration without faults (0.25)")
    parser.add_argument("--seed", type=int, default=0, help="prompts, users' choices and the fault schedule (0)")
    parser.add_argument("--users", type=int, default=6, help="concurrent closed-loop users (6)")
    parser.add_argument("--think", type=float, default=0.05, help="at most this many seconds between requests")
    parser.add_argument("--model", default="tiny", help="tiny (random weights, built here), smollm2, or a DIR")
    parser.add_argument("--systems", type=int, default=4, help="distinct shared system prompts (4)")
    parser.add_argument("--system-words", type=int, default=120, help="words per system prompt (120)")
    parser.add_argument("--questions", type=int, default=6, help="distinct questions after them (6)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream-share", type=float, default=0.5, help="share of streamed requests (0.5)")
    parser.add_argument("--policy", default="kv", help="the router's --policy (kv)")
    parser.add_argument("--kv-l1", default="384KiB", help="each replica's L1: about two system prompts (tiny)")
    parser.add_argument("--chunk-tokens", type=int, default=16, help="the replicas' --kv-chunk-tokens (16)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="a client gives up after this long")
    parser.add_argument(
        "--faults",
        type=kinds,
        default=DEFAULT_KINDS,
        help=f"comma-separated fault kinds (default: {','.join(DEFAULT_KINDS)}; also l2_forge, which only --mac stops)",
    )
    parser.add_argument("--mac", action="store_true", help="the replicas share a fleet secret (--kv-secret-file)")
    parser.add_argument("--workdir", default=None, help="keep the L2, the model and children.log here")
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="preheat-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    fleet: Fleet | None = None
    try:
        with terminate_as_interrupt():
            try:
                model = model_dir(args.model, workdir)
                prompts = make_prompts(args.seed, args.systems, args.system_words, args.questions)
                config = FleetConfig(
                    model, args.policy, args.kv_l1, args.chunk_tokens, args.max_model_len, args.mac, args.seed
                )
                fleet = Fleet(workdir, config)
                report = soak(fleet, prompts, args, say)
            finally:
                if fleet is not None:
                    fleet.close()
    except KeyboardInterrupt:
        say(f"interrupted: every child was stopped; children's output: {workdir / 'children.log'}")
        return 130
    report["config"] = vars(args) | {"model": model}
    report["pids"] = fleet.pids
    ok = passed(report)
    if not ok:
        report["workdir"] = str(workdir)  # kept for children.log
    elif args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"\nfault soak: router ({args.policy}) + 3 replicas ({args.model}), L2 fs:// (replicas 1-2) and redis:// "
        f"(replica 3){', fleet secret' if args.mac else ''}, {args.users} users, seed {args.seed}"
    )
    print(table(report))
    for problem in report["problems"][:10]:
        key, via = problem["prompt"], problem["replica"]
        if problem["verdict"] == "differ":
            why = f"got {problem['answer'] or problem['partial']!r}, want {report['references'][key]!r}"
        else:
            why = problem["error"]
        print(f"  {problem['verdict']}: {key} via {via}: {why}")
    for error in report["fault_errors"]:
        print(f"  fault scheduler: {error}")
    if not ok:
        print(f"  children's output: {workdir / 'children.log'}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
