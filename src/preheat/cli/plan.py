"""``preheat analyze`` and ``preheat simulate``: the planning tools (docs/plan.md). Thin: parse, call, print."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from preheat.cli.common import Commands, renamed
from preheat.core.errors import ConfigError

if TYPE_CHECKING:  # imported when a command runs: `preheat --help` stays fast
    from rich.console import Console

    from preheat.plan.simulate import PolicyRecord
    from preheat.plan.traces import Problems, TraceArrays

ANALYZE_HELP = """\
Is a KV cache tier worth it for this workload? Replays TRACE through the same chunk keys the cache and router use
and reports the shared leading-token ratio, the distribution of reusable prefix lengths, hit rates (an unbounded
cache, and LRU tiers of the given sizes: an L1 per replica, one shared L2) under round-robin and prefix-aware
routing, the prefill time saved, and a recommendation.

TRACE (JSON Lines or CSV; docs/plan.md):
  {"prompt": "...", "timestamp": 0.5}          text, tokenized with --model's tokenizer
  {"messages": [{"role": ..., "content": ...}]}  chats, through --model's chat template
  {"token_ids": [1, 2, ...]}                    already tokenized (no --model needed)
  {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}   Mooncake
  Azure LLM inference or BurstGPT CSV (token counts only: useful to simulate, not to analyze)

--model also gives the KV bytes per token (to turn --l1/--l2 sizes into chunks) and a measured prefill cost per
token (a short prefill on this machine) unless --kv-bytes-per-token / --prefill-ms-per-token say otherwise.

examples:
  preheat analyze examples/traces/rag.jsonl --model ./smollm2 --l1 256MiB --l2 2GiB --plot hits.png
  preheat analyze mooncake.jsonl --replicas 8 --kv-bytes-per-token 131072 --l1 16GiB --json
"""

SIMULATE_HELP = """\
Warm pools or scale-to-zero? Replays a request trace through a fleet of replicas, once per --policy, with cold
starts taken stage by stage from a measured `preheat timeline` JSON, and reports p50/p99 time to first token
(queueing behind cold starts included), accelerator-hours, cost and idle cost per policy.

policies (repeat --policy; default: every preset):
  scale-to-zero   no replica while idle (min 0), a replica stops after --idle-timeout seconds without work
  warm-replicas   min 1 replica always up
  node-cache      the model is on the node's disk already: no download stage
  quantized       fewer weight bytes: download and load x --quantized-load-factor
  warm-pool       2 nodes always provisioned (no provisioning stage), replicas beyond them on spot nodes
  all-four        all of the above
  standby         2 `preheat serve --standby` replicas always up (billed), activated from the node cache: a replica
                  placed on one pays only download/load/warm-up (no provisioning, image, imports)
  NAME:SPEC       a preset with changes or a new policy: min=N,max=N,idle=S,pool=N,standby=N,cache,quant,spot
                  e.g. --policy warm-replicas:min=2 --policy mine:min=1,cache,pool=1,spot

scaling: on each arrival the fleet should have ceil(requests in system / (--slots x --target-utilization))
replicas, ready or starting; missing ones start (a cold start each). A replica idle for the policy's idle timeout
stops unless that leaves fewer than min or than that number. Full model and formulas: docs/plan.md.

traces: preheat JSON Lines (timestamp in seconds), Mooncake JSON Lines, Azure LLM inference CSV (TIMESTAMP,
ContextTokens, GeneratedTokens), BurstGPT CSV. Samples: examples/traces/ (made by scripts/make_traces.py).

examples:
  preheat simulate examples/traces/burstgpt-hour.csv --cold-start examples/traces/coldstart-8b.json
  preheat simulate day.jsonl --cold-start http://replica:8000 --policy all-four:pool=1
  preheat simulate AzureLLMInferenceTrace_conv.csv --cold-start t.json --policy scale-to-zero \\
      --policy warm-replicas:min=2 --gpu-cost-per-hour 4 --plot frontier.png --json
"""


def register(commands: Commands) -> None:
    """Add ``analyze`` and ``simulate`` to the ``preheat`` command."""
    analyze = commands.add_parser(
        "analyze",
        help="measure prefix sharing and KV cache hit rates of a request trace",
        description=ANALYZE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    analyze.add_argument("trace", help="request trace: JSON Lines (prompt/messages/token_ids, or Mooncake)")
    analyze.add_argument("--model", default=None, help="checkpoint directory: tokenizer, KV size, prefill speed")
    analyze.add_argument("--replicas", type=int, default=4, help="replicas behind the router (default: 4)")
    analyze.add_argument("--l1", default=None, help="host-DRAM KV cache per replica, e.g. 16GiB (default: none)")
    analyze.add_argument("--l2", default=None, help="shared KV cache all replicas see, e.g. 1TiB (default: none)")
    chunk = analyze.add_argument(
        "--kv-chunk-tokens", type=int, default=256, metavar="C", help="tokens per KV chunk (default: 256)"
    )
    renamed(analyze, "--chunk", chunk)
    analyze.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV bytes per token (default: model)")
    analyze.add_argument("--prefill-ms-per-token", type=float, default=None, help="default: measured on --model")
    analyze.add_argument("--l2-gbps", type=float, default=None, help="L2 read speed in GB/s (default: 4.4)")
    analyze.add_argument("--l2-read-ms-per-token", type=float, default=None, help="default: KV bytes / --l2-gbps")
    analyze.add_argument("--plot", default=None, help="draw hit rate against cache size to out.png")
    analyze.add_argument("--strict", action="store_true", help="stop at the first malformed line (default: skip)")
    analyze.add_argument("--json", action="store_true", help="print the report as JSON")
    analyze.set_defaults(func=_cmd_analyze)

    simulate = commands.add_parser(
        "simulate",
        help="simulate warm pools vs scale-to-zero on a trace: p99 TTFT and cost per policy",
        description=SIMULATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # TRACE is positional, as in `analyze`; --trace, its spelling before, still works (into ``trace_flag``).
    trace = simulate.add_argument(
        "trace", nargs="?", default=None, metavar="TRACE", help="request trace (JSON Lines, Azure or BurstGPT CSV)"
    )
    renamed(simulate, "--trace", trace, dest="trace_flag")
    simulate.add_argument("--cold-start", required=True, help="timeline: a saved JSON file or a server URL")
    simulate.add_argument("--policy", action="append", default=None, help="a policy (repeat; default: all presets)")
    simulate.add_argument(
        "--gpu-cost-per-hour", type=float, default=32.0, metavar="USD", help="per replica (default: 32)"
    )
    simulate.add_argument(
        "--spot-discount", type=float, default=0.6, help="spot price = (1 - this) x price (default: 0.6)"
    )
    simulate.add_argument("--slots", type=int, default=16, help="requests a replica serves at once (default: 16)")
    simulate.add_argument(
        "--target-utilization", type=float, default=0.7, help="busy share of slots to scale for (default: 0.7)"
    )
    simulate.add_argument("--max-replicas", type=int, default=64, help="fleet size limit (default: 64)")
    simulate.add_argument(
        "--idle-timeout", type=float, default=300.0, help="seconds idle before a replica stops (default: 300)"
    )
    simulate.add_argument("--provision-s", type=float, default=90.0, help="node provisioning (default: 90)")
    simulate.add_argument(
        "--image-s", type=float, default=45.0, help="image pull when the timeline has no 'platform' stage (default: 45)"
    )
    simulate.add_argument("--download-s", type=float, default=None, help="replace the timeline's fetch stage")
    simulate.add_argument("--quantized-load-factor", type=float, default=0.5, help="quantized bytes (default: 0.5)")
    simulate.add_argument("--model", default=None, help="measure prefill/decode speed on this checkpoint")
    simulate.add_argument("--prefill-ms-per-token", type=float, default=None, help="default: measured, else 0.1")
    simulate.add_argument("--decode-ms-per-token", type=float, default=None, help="default: measured, else 20")
    simulate.add_argument("--plot", default=None, help="draw cost against p99 TTFT to out.png")
    simulate.add_argument(
        "--emit-values",
        default=None,
        metavar="FILE",
        help="write the recommended policy as Kubernetes deployment values (`preheat deploy render --values`)",
    )
    simulate.add_argument(
        "--ttft-p99-target",
        type=float,
        default=2.0,
        metavar="S",
        help="--emit-values recommends the cheapest policy with p99 TTFT within S seconds (default: 2)",
    )
    simulate.add_argument("--strict", action="store_true", help="stop at the first malformed line (default: skip)")
    simulate.add_argument("--json", action="store_true", help="print the results as JSON")
    simulate.set_defaults(func=_cmd_simulate)


@contextmanager
def _status(enabled: bool, label: str) -> Iterator[Callable[[str], None]]:
    """A rich status line (spinner, elapsed time, what is happening) on a terminal; a no-op callback otherwise."""
    if not enabled:
        yield lambda _text: None
        return
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(label)
        yield lambda text: bar.update(task, description=f"{label}: {text}")


def _positive(name: str, value: float | None) -> None:
    if value is not None and value < 0:
        raise ConfigError(f"{name} must not be negative (got {value})")


def _cmd_analyze(args: argparse.Namespace) -> int:
    from preheat.core.config import parse_size
    from preheat.kv.keys import fingerprint
    from preheat.plan import analyze as plan
    from preheat.plan.prefix import KeyTable
    from preheat.plan.traces import Problems, iter_requests, with_tokens

    if args.replicas < 1 or args.kv_chunk_tokens < 1:
        raise ConfigError(
            f"--replicas and --kv-chunk-tokens must be at least 1 (got {args.replicas}, {args.kv_chunk_tokens})"
        )
    if args.l2_gbps is not None and args.l2_gbps <= 0:
        raise ConfigError(f"--l2-gbps must be positive (got {args.l2_gbps})")
    for name in ("prefill_ms_per_token", "l2_read_ms_per_token", "kv_bytes_per_token", "l2_gbps"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    l1 = parse_size(args.l1) if args.l1 else None
    l2 = parse_size(args.l2) if args.l2 else None
    kv_bytes, prefill, seed, encode = args.kv_bytes_per_token, args.prefill_ms_per_token, None, None
    if args.model:
        from preheat.plan.measure import batch_encoder, model_facts

        facts = model_facts(args.model)
        seed = facts.fingerprint(args.kv_chunk_tokens)
        kv_bytes = kv_bytes or facts.kv_bytes_per_token
        encode = batch_encoder(args.model)
    if (l1 or l2) and not kv_bytes:
        raise ConfigError("--l1/--l2 are sizes in bytes: pass --model or --kv-bytes-per-token to turn them into chunks")
    for flag, size in (("--l1", l1), ("--l2", l2)):
        if size is not None and kv_bytes and size < kv_bytes * args.kv_chunk_tokens:
            raise ConfigError(
                f"{flag} {size} bytes holds no chunk: one is {kv_bytes * args.kv_chunk_tokens} bytes "
                f"({args.kv_chunk_tokens} tokens x {kv_bytes} KV bytes per token)"
            )
    # Without a model any fixed seed will do: keys only have to agree within this one analysis.
    seed = seed or fingerprint(identity=f"trace:{args.trace}", layout={}, chunk_tokens=args.kv_chunk_tokens)
    problems = Problems(args.trace, strict=args.strict)
    table = KeyTable()
    settings = plan.AnalyzeSettings(
        fingerprint=seed,
        chunk_tokens=args.kv_chunk_tokens,
        replicas=args.replicas,
        l1_bytes=l1,
        l2_bytes=l2,
        kv_bytes_per_token=kv_bytes,
        prefill_ms_per_token=prefill,
        l2_read_ms_per_token=args.l2_read_ms_per_token
        if args.l2_read_ms_per_token is not None
        else plan.l2_read_ms_per_token(kv_bytes, args.l2_gbps or plan.L2_GBPS),
    )
    with _status(not args.json and sys.stderr.isatty(), "reading and keying prompts") as status:
        requests = with_tokens(iter_requests(args.trace, problems), encode)
        keyed = plan.key_requests(requests, settings, table, lambda n: status(f"{n:,} requests"))
    if not keyed:
        raise ConfigError(f"{args.trace}: no usable requests in the trace")
    if prefill is None and args.model:
        from dataclasses import replace

        from preheat.plan.measure import measure_speeds

        settings = replace(settings, prefill_ms_per_token=measure_speeds(args.model).prefill_ms_per_token)
    report = plan.analyze(keyed, settings, len(table))
    if args.plot:
        from preheat.plan.plots import plot_hit_rates

        written = plot_hit_rates(report.sweep, args.plot, shared_prefix_ratio=report.shared_prefix_ratio)
        print(f"wrote {written}", file=sys.stderr)
    if args.json:
        print(json.dumps({**report.to_dict(), "problems": _problems(problems)}, indent=2))
        return 0
    for note in problems.summary():
        print(note, file=sys.stderr)
    _print_analyze(report.to_dict())
    return 0


def _problems(problems: Problems) -> dict[str, object]:
    return {
        "skipped_lines": len(problems.skipped),
        "first_skipped": [{"line": line, "error": message} for line, message in problems.skipped[:20]],
        "unknown_columns": sorted(problems.unknown_columns),
    }


def _console() -> Console:
    from rich.console import Console

    # A pipe or a log gets 120 columns (rich's 80 would fold the tables); a terminal its own width.
    return Console(width=None if sys.stdout.isatty() else 120)


def _pct(value: object) -> str:
    return f"{float(value):.1%}" if isinstance(value, (int, float)) else "-"


def _print_analyze(doc: dict[str, Any]) -> None:  # Any: AnalyzeReport.to_dict(), nested, its tiers keyed at run time
    from rich.table import Table

    console = _console()
    reuse = doc["reusable_prefix_tokens"]
    console.print(
        f"{doc['requests']:,} requests, {doc['prompt_tokens']:,} prompt tokens, chunks of {doc['chunk_tokens']} "
        f"tokens ({doc['unique_chunks']:,} distinct), {doc['replicas']} replicas"
    )
    console.print(
        f"shared prefix ratio [bold]{_pct(doc['shared_prefix_ratio'])}[/bold]; reusable prefix per request: "
        f"mean {reuse['mean']:.0f}, p50 {reuse['p50']}, p90 {reuse['p90']}, p99 {reuse['p99']} tokens"
    )
    table = Table(title="prompt tokens served from cache")
    for column in ("cache", "routing", "hit rate", "L1", "L2", "prefill saved (s)"):
        table.add_column(column, justify="left" if column in ("cache", "routing") else "right")

    def row(cache: str, routing: str, tier: dict[str, Any]) -> None:  # Any: JSON values
        saved = tier.get("prefill_seconds_saved")
        table.add_row(
            cache,
            routing,
            _pct(tier["hit_rate"]),
            _pct(tier["l1_hit_rate"]),
            _pct(tier["l2_hit_rate"]),
            "-" if saved is None else f"{saved:,.1f}",
        )

    row("unbounded, shared", "any", doc["infinite_shared"])
    for routing, tier in doc["infinite_per_replica"].items():
        row("unbounded, per replica", routing.replace("_", "-"), tier)
    configured = doc["configured"]
    if configured is not None:
        for routing in ("round_robin", "prefix_aware"):
            row(
                f"L1 {configured['l1_chunks']} + L2 {configured['l2_chunks']} chunks",
                routing.replace("_", "-"),
                configured[routing],
            )
    console.print(table)
    if doc["prefill_ms_per_token"] is not None:
        console.print(f"prefill cost: {doc['prefill_ms_per_token']:.4f} ms per token")
    for line in doc["recommendation"]:
        console.print(f"• {line}")


def _cmd_simulate(args: argparse.Namespace) -> int:
    from preheat.plan import simulate as sim
    from preheat.plan.coldstart import ColdStart
    from preheat.plan.traces import Problems, read_arrays
    from preheat.timeline.fetch import fetch

    for name in ("gpu_cost_per_hour", "provision_s", "image_s", "download_s", "idle_timeout", "quantized_load_factor"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if not 0 <= args.spot_discount < 1:
        raise ConfigError(f"--spot-discount must be in [0, 1) (got {args.spot_discount})")
    args.trace = args.trace or args.trace_flag
    if args.trace is None:
        raise ConfigError("simulate needs a request trace: preheat simulate TRACE --cold-start TIMELINE (see --help)")
    policies = [
        sim.parse_policy(text, max_replicas=args.max_replicas, idle_timeout_s=args.idle_timeout)
        for text in (args.policy or list(sim.PRESETS))
    ]
    cold = ColdStart.from_timeline(
        fetch(args.cold_start),
        where=args.cold_start,
        provision_s=args.provision_s,
        image_s=args.image_s,
        download_s=args.download_s,
    )
    problems = Problems(args.trace, strict=args.strict)
    trace = read_arrays(args.trace, problems)
    prefill, decode = args.prefill_ms_per_token, args.decode_ms_per_token
    if args.model and (prefill is None or decode is None):
        from preheat.plan.measure import measure_speeds

        speeds = measure_speeds(args.model)
        prefill = speeds.prefill_ms_per_token if prefill is None else prefill
        decode = speeds.decode_ms_per_token if decode is None else decode
    defaults = sim.SimSettings()
    settings = sim.SimSettings(
        prefill_ms_per_token=defaults.prefill_ms_per_token if prefill is None else prefill,
        decode_ms_per_token=defaults.decode_ms_per_token if decode is None else decode,
        slots=args.slots,
        gpu_cost_per_hour=args.gpu_cost_per_hour,
        spot_discount=args.spot_discount,
        quantized_load_factor=args.quantized_load_factor,
        target_utilization=args.target_utilization,
    )
    with _status(not args.json and sys.stderr.isatty(), f"simulating {len(trace):,} requests") as status:
        results = sim.simulate_all(trace, cold, policies, settings, progress=status)
    docs = [r.to_dict() for r in results]
    from preheat.plan.plots import frontier, plot_frontier

    points = [(str(d["policy"]), float(d["cost"]), float(d["ttft_p99_s"])) for d in docs]
    best = set(frontier(points))
    if args.plot:
        print(f"wrote {plot_frontier(points, args.plot)}", file=sys.stderr)
    if args.emit_values:
        _emit_values(args, docs)
    if args.json:
        print(
            json.dumps(
                {
                    "trace": {"path": args.trace, "requests": len(trace), "span_s": float(trace.arrival[-1])},
                    "cold_start_phases_s": cold.to_dict(),
                    "settings": vars(settings),
                    "policies": [{**d, "on_frontier": i in best} for i, d in enumerate(docs)],
                    "problems": _problems(problems),
                },
                indent=2,
            )
        )
        return 0
    for note in problems.summary():
        print(note, file=sys.stderr)
    _print_simulate(args, trace, cold.to_dict(), docs, best)
    return 0


def _emit_values(args: argparse.Namespace, docs: list[PolicyRecord]) -> None:
    """Write the recommended policy as deployment values, with why in comments (docs/kubernetes.md)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("--emit-values writes YAML: pip install 'preheat[deploy]'") from None
    from preheat.plan.fleet import fleet_values, recommend

    chosen = docs[recommend(docs, args.ttft_p99_target)]
    values, notes = fleet_values(chosen, slots=args.slots, target_utilization=args.target_utilization)
    header = [
        f"# preheat simulate --emit-values: policy {chosen['policy']} on {args.trace}",
        f"# p99 TTFT {chosen['ttft_p99_s']:.3f} s (target {args.ttft_p99_target:g} s), cost {chosen['cost']:,.2f}, "
        f"peak {chosen['peak_replicas']} replicas",
        "# merge over your fleet's values: preheat deploy render --values fleet.yaml --values THIS_FILE",
        *(f"# note: {note}" for note in notes),
    ]
    try:
        with open(args.emit_values, "w", encoding="utf-8") as handle:
            handle.write("\n".join(header) + "\n" + yaml.safe_dump(values, sort_keys=False))
    except OSError as exc:
        raise ConfigError(f"--emit-values {args.emit_values}: cannot write ({exc.strerror})") from None
    print(f"wrote {args.emit_values} (policy {chosen['policy']})", file=sys.stderr)


def _print_simulate(
    args: argparse.Namespace, trace: TraceArrays, phases: dict[str, float], docs: list[PolicyRecord], best: set[int]
) -> None:
    from rich.table import Table

    console = _console()
    span = float(trace.arrival[-1]) / 3600.0
    console.print(
        f"{len(trace):,} requests over {span:.2f} h; cold-start phases (s): "
        + ", ".join(f"{name} {seconds:.1f}" for name, seconds in phases.items() if seconds)
    )
    table = Table(
        title=f"per policy: seconds, $ at ${args.gpu_cost_per_hour:g}/h per replica (* = on the cost/p99 frontier)",
        caption="start: cold start on a new node / on a warm pool node / from standby; starts: cold starts; "
        "peak: most replicas",
    )
    for column in ("policy", "start", "TTFT p50", "TTFT p99", "accel-h", "cost", "idle cost", "starts", "peak"):
        table.add_column(column, justify="left" if column == "policy" else "right", no_wrap=column == "policy")
    for i, d in enumerate(docs):
        table.add_row(
            ("* " if i in best else "  ") + str(d["policy"]),
            _starts(d),
            f"{d['ttft_p50_s']:.3f}",
            f"{d['ttft_p99_s']:.3f}",
            f"{d['accelerator_hours']:.1f}",
            f"{d['cost']:,.2f}",
            f"{d['idle_cost']:,.2f}",
            str(d["cold_starts"]),
            str(d["peak_replicas"]),
        )
    console.print(table)


def _starts(doc: PolicyRecord) -> str:
    """The start column: new node, then the warm pool node's and the standby's when the policy has them."""
    start, settings = doc["cold_start_s"], doc["settings"]
    parts = [f"{start['new_node']:.0f}"]
    if settings["warm_pool"]:
        parts.append(f"{start['warm_pool_node']:.0f}")
    if settings.get("standby"):
        parts.append(f"{start['standby']:.1f}")
    return "/".join(parts)
