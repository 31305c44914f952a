"""The ``preheat`` command. Thin on purpose: parse arguments, call one library function, print the result.

Every flag has a ``PREHEAT_*`` environment variable (see ``preheat --help``); ``--json`` prints machine-readable
output; ``--verbose`` tells the story on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable, Sequence

from preheat.cli.common import CommandParser, progress_for
from preheat.core import env
from preheat.core.config import format_bytes, parse_size
from preheat.core.errors import ConfigError, PreheatError

EPILOG = """\
environment (of preheat load and preheat.load(); every variable: docs/environment.md):
@VARIABLES@

docs: README.md (quick start), docs/loader.md (how loading works), docs/architecture.md (layers),
      docs/security.md (trust model: tokens, KV MAC, signed artifacts)
"""


# The modules that add commands, in the order ``preheat --help`` lists them, and the commands each adds. A command
# line naming one of these builds only that module's parsers: a replica's start (``preheat serve``) then imports and
# builds its own flags, not the other commands' (~10 ms of a cold start). tests/integration/cli/test_cli.py checks
# the table.
COMMAND_MODULES: dict[str, tuple[str, ...]] = {
    "store": ("pull", "cache"),
    "kv": ("kv",),
    "serve": ("serve", "activate", "timeline", "demo"),
    "plan": ("analyze", "simulate"),
    "router": ("router", "up"),
    "artifacts": ("artifacts",),
    "doctor": ("doctor",),
    "deploy": ("deploy",),
    "refit": ("refit",),
    "vllm_standby": ("vllm-standby",),
}


def _command_module(argv: Sequence[str]) -> str | None:
    """The module of the command ``argv`` names (its first word that is not an option), if a module adds it."""
    command = next((word for word in argv if not word.startswith("-")), None)
    return next((module for module, names in COMMAND_MODULES.items() if command in names), None)


def _build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or (``only``, a ``COMMAND_MODULES`` key) just that module's commands."""
    parser = CommandParser(  # every subcommand inherits its class: a misspelt flag gets that command's usage
        prog="preheat",
        description="Take an LLM replica from cold to serving in seconds.",
        epilog=EPILOG.replace("@VARIABLES@", env.help_lines("load")),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens, stage by stage, to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    if only is not None:
        importlib.import_module(f"preheat.cli.{only}").register(commands)
        return parser

    load = commands.add_parser(
        "load",
        help="load a checkpoint into memory and report how fast each stage was",
        description=(
            "Load every tensor of a checkpoint (a .safetensors file, a Hugging Face directory, or a preheat\n"
            "checkpoint) the way a server would, then print bytes, seconds and GB/s per stage.\n\n"
            "modes:\n"
            "  auto    CPU: mmap; CUDA: gds when GPUDirect Storage is active, else read through pinned buffers\n"
            "  mmap    map the files (zero-copy, read lazily on first touch); CPU only\n"
            "  read    parallel preadv into one private buffer per file; tensors are views of it\n"
            "  direct  like read, with O_DIRECT (bypasses the page cache: honest cold-read numbers)\n"
            "  gds     GPUDirect Storage through kvikio (CUDA only)\n\n"
            "examples:\n"
            "  preheat load ./Llama-3-8B --mode read --repeat 3\n"
            "  preheat load ./Llama-3-8B --rank 1 --world-size 4 --json\n"
            "  preheat load ./model.safetensors --device cuda"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    load.add_argument("path", help="checkpoint file or directory")
    load.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    load.add_argument(
        "--mode",
        default=None,
        choices=["auto", "mmap", "read", "direct", "gds"],
        help="how bytes are read (default: auto, or PREHEAT_LOAD_MODE)",
    )
    load.add_argument("--rank", type=int, default=0, help="tensor-parallel rank to load (default: 0)")
    load.add_argument("--world-size", type=int, default=1, help="tensor-parallel world size (default: 1)")
    load.add_argument(
        "--tp-plan",
        default="auto",
        help="'auto' (Llama/Mistral/Qwen2 names) or a JSON file mapping name patterns to a dim or null",
    )
    load.add_argument("--threads", type=int, default=None, metavar="N", help="reader threads (default: tuned)")
    load.add_argument("--chunk-bytes", default=None, metavar="SIZE", help="bytes per read, e.g. 16MiB (default: tuned)")
    load.add_argument("--repeat", type=int, default=1, help="load N times and report each run and the median")
    load.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="check every tensor against preheat.json as it lands (default: always for URLs; for local paths when "
        "there is a manifest and the mode reads into memory); --no-verify loads without checking",
    )
    load.add_argument("--json", action="store_true", help="print the load reports as JSON")
    load.set_defaults(func=_cmd_load)
    _add_checkpoint_commands(commands)
    for module in COMMAND_MODULES:
        importlib.import_module(f"preheat.cli.{module}").register(commands)
    return parser


def _tp_plan(value: str) -> str | dict[str, int | None]:
    if value == "auto":
        return value
    from preheat.core.errors import JSONInputError
    from preheat.core.jsonsafe import read_bounded

    try:
        plan = read_bounded(value, max_bytes=1 << 20)  # a plan lists a few dozen patterns
    except (OSError, JSONInputError) as exc:
        raise ConfigError(f"--tp-plan {value}: cannot read a JSON mapping of patterns to dims ({exc})") from None
    if not isinstance(plan, dict) or not all(v is None or isinstance(v, int) for v in plan.values()):
        raise ConfigError(f"--tp-plan {value}: must map name patterns to an integer dim or null")
    return plan


def _cmd_load(args: argparse.Namespace) -> int:
    from preheat.loader.load import LoadReport, load

    chunk = parse_size(args.chunk_bytes) if args.chunk_bytes else None
    plan = _tp_plan(args.tp_plan)
    reports: list[LoadReport] = []
    for _ in range(max(1, args.repeat)):
        with progress_for(args, label=f"loading {args.path}", transient=True) as bar:
            weights = load(
                args.path,
                args.device,
                rank=args.rank,
                world_size=args.world_size,
                tp_plan=plan,
                mode=args.mode,
                threads=args.threads,
                chunk_bytes=chunk,
                progress=bar.update,
                verify=args.verify,
            )
        reports.append(weights.report)
        del weights
    if args.json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        _print_reports(reports)
    return 0


def _print_reports(reports: Sequence[object]) -> None:
    from rich.console import Console
    from rich.table import Table

    from preheat.loader.load import LoadReport

    runs = [r for r in reports if isinstance(r, LoadReport)]
    median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    console = Console()
    # The source on a line of its own, never wrapped by rich: a table title wraps at the table's width, which cut a
    # long path mid-word; a terminal wraps this line instead, and the path stays one word to copy.
    console.print(
        f"{median.source}: mode {median.mode}, device {median.device}, rank {median.rank}/{median.world_size}",
        soft_wrap=True,
        highlight=False,
        markup=False,
    )
    table = Table()
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("GB/s", justify="right")
    for stage, seconds in median.stages.items():
        rate = f"{median.bytes / seconds / 1e9:.2f}" if stage in ("read", "map") and seconds > 0 else ""
        table.add_row(stage, f"{seconds:.4f}", rate)
    table.add_row("total", f"{median.seconds:.4f}", f"{median.gbps:.2f}", style="bold")
    console.print(table)
    facts = [
        f"{median.tensors} tensors, {format_bytes(median.bytes)} in {median.files} file(s)",
        f"read {format_bytes(median.bytes_read)} from storage",
        median.tuning,  # empty for mmap: nothing tuned
        "every tensor checked against preheat.json" if median.verified else "",
    ]
    console.print("; ".join(fact for fact in facts if fact))
    for note in median.notes:
        console.print(f"note: {note}", style="yellow")
    if len(runs) > 1:
        import statistics  # here: every command's start (a server's too) would pay for it

        durations = [r.seconds for r in runs]
        console.print(
            "runs: "
            + ", ".join(f"{d:.3f} s" for d in durations)
            + f"; median {statistics.median(durations):.3f} s ({median.gbps:.2f} GB/s)"
        )


def _add_checkpoint_commands(commands: argparse._SubParsersAction[CommandParser]) -> None:
    """``convert``, ``verify`` and ``info``: making and checking preheat checkpoints (docs/checkpoint-format.md)."""
    convert = commands.add_parser(
        "convert",
        help="convert a HF directory, safetensors file or GGUF file into a verified preheat checkpoint",
        description=(
            "Convert SRC (a Hugging Face directory, a .safetensors file, a preheat checkpoint, or a GGUF file)\n"
            "into DST: plain safetensors files (~2 GiB each) + preheat.json (per-tensor digests; its digest is the\n"
            "checkpoint's identity) + config.json and tokenizer files. DST is written to DST.tmp-<pid>, read back\n"
            "and verified, then renamed into place: an interrupted conversion never leaves a DST that looks done.\n\n"
            "dtypes:\n"
            "  keep   store tensors as they are in SRC (GGUF: the float32 its dequantization gives)\n"
            "  bf16   cast floating-point tensors to bfloat16\n"
            "  fp16   cast floating-point tensors to float16\n"
            "  int8   weight-only int8 for the linear projections, one F32 scale per output row\n"
            "  fp8    weight-only float8_e4m3fn for the linear projections, one F32 scale per output row and\n"
            "         32 input columns (the MX block size)\n"
            "         (embeddings, norms and lm_head stay as they are; load with dequantize=True to restore)\n\n"
            "--tp N writes rank-0000r-of-0000N/ directories with each rank's slices, so that rank r of N reads\n"
            "only its own files: preheat.load(DST, rank=r, world_size=N).\n\n"
            "examples:\n"
            "  preheat convert ./Llama-3-8B ./llama-3-8b-tp2 --tp 2 --dtype bf16\n"
            "  preheat convert SmolLM2-135M-Instruct.Q4_1.gguf ./smollm2 --dtype int8\n"
            "  preheat convert ./model.safetensors ./model-fp8 --dtype fp8 --force --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    convert.add_argument("src", help="Hugging Face directory, .safetensors file, preheat checkpoint or .gguf file")
    convert.add_argument("dst", help="directory to create (must not exist unless --force)")
    convert.add_argument("--tp", type=int, default=1, help="pre-shard for N tensor-parallel ranks (default: 1)")
    convert.add_argument(
        "--dtype",
        default="keep",
        choices=["keep", "bf16", "fp16", "fp8", "int8"],
        metavar="DTYPE",
        help="stored dtype: keep, bf16, fp16, fp8 or int8 (default: keep)",
    )
    convert.add_argument("--force", action="store_true", help="replace DST if it exists (only once DST is verified)")
    convert.add_argument("--shard-size", default="2GiB", help="largest weights file, e.g. 2GiB (default: 2GiB)")
    convert.add_argument("--json", action="store_true", help="print a JSON summary")
    convert.set_defaults(func=_cmd_convert)

    verify = commands.add_parser(
        "verify",
        help="recompute every digest of a preheat checkpoint; exit 1 naming the first bad tensor",
        description=(
            "Read every file of a preheat checkpoint and compare the digest of each tensor, each file and each\n"
            "side file (config, tokenizer) with preheat.json. Exit 0 when all match; otherwise print the first bad\n"
            "tensor (or file) and exit 1.\n\n"
            "examples:\n"
            "  preheat verify ./llama-3-8b-tp2\n"
            "  preheat verify ./smollm2 --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    verify.add_argument("path", help="preheat checkpoint directory (one with preheat.json)")
    verify.add_argument(
        "--threads", type=int, default=None, metavar="N", help="files hashed at once (default: cores, up to 8)"
    )
    verify.add_argument("--json", action="store_true", help="print the full report as JSON")
    verify.set_defaults(func=_cmd_verify)

    info = commands.add_parser(
        "info",
        help="show a preheat checkpoint's identity, size, tensors, dtypes and TP layout",
        description=(
            "Describe a preheat checkpoint from its manifest alone (no weights are read): its identity (the\n"
            "digest of preheat.json's content, used as its name by caches and peers), size, tensor count, dtypes,\n"
            "tensor-parallel layout and quantization.\n\n"
            "examples:\n"
            "  preheat info ./smollm2\n"
            "  preheat info ./llama-3-8b-tp2 --json | jq -r .identity"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    info.add_argument("path", help="preheat checkpoint directory (one with preheat.json)")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.set_defaults(func=_cmd_info)


def _cmd_convert(args: argparse.Namespace) -> int:
    from preheat.convert import convert

    with progress_for(args) as bar:
        result = convert(
            args.src,
            args.dst,
            tp=args.tp,
            dtype=args.dtype,
            force=args.force,
            shard_bytes=parse_size(args.shard_size),
            progress=bar.stage,
        )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(
        f"converted {result.source} ({result.source_format}) -> {result.destination}\n"
        f"  identity {result.identity}\n"
        f"  {result.tensors} tensors, {format_bytes(result.bytes)} in {result.files} file(s), dtype {result.dtype}, "
        f"tp {result.tp}, verified, {result.seconds:.1f} s"
    )
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from preheat.checkpoint.verify import verify_checkpoint

    with progress_for(args, label=f"verifying {args.path}", transient=True) as bar:
        report = verify_checkpoint(args.path, progress=bar.update, threads=args.threads)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif report.first_bad is None:
        print(
            f"ok: {report.tensors} tensors in {report.files} file(s), {format_bytes(report.bytes)} match "
            f"{report.root}/preheat.json (identity {report.identity})"
        )
    else:
        bad = report.first_bad
        print(f"FAILED: {bad.message}")
        if len(report.problems) > 1:
            print(f"  and {len(report.problems) - 1} more problem(s); --json lists them all")
    return 0 if report.ok else 1


def _cmd_info(args: argparse.Namespace) -> int:
    from preheat.checkpoint.info import checkpoint_info

    info = checkpoint_info(args.path)
    if args.json:
        print(json.dumps(info.to_dict(), indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=info.path, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("identity", info.identity)
    table.add_row("size", f"{format_bytes(info.size)} in {info.files} weights file(s)")
    table.add_row("tensors", f"{info.tensors} ({info.elements:,} elements)")
    table.add_row("dtypes", ", ".join(f"{dtype}×{count}" for dtype, count in info.dtypes.items()))
    if info.tp_world_size == 1:
        table.add_row("tensor parallel", "not pre-sharded (the loader slices at load time)")
    else:
        split = ", ".join(f"{how}: {count}" for how, count in info.tp_split.items())
        table.add_row("tensor parallel", f"{info.tp_world_size} ranks ({split})")
        for rank in info.ranks:
            table.add_row(f"  rank {rank.rank}", f"{format_bytes(rank.bytes)}: {', '.join(rank.files)}")
    quant = info.quantization
    table.add_row("quantization", "none" if quant is None else ", ".join(f"{k}={v}" for k, v in quant.items()))
    table.add_row("model", ", ".join(f"{k}={v}" for k, v in info.model.items()))
    table.add_row("side files", ", ".join(info.extra_files) or "none")
    Console().print(table)
    return 0


def configure_logging(level: int) -> None:
    """Log lines as every ``preheat`` command prints them (also in a router worker process, router/workers.py)."""
    logging.basicConfig(level=level, format="%(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    parser = _build_parser(_command_module(words))
    args = parser.parse_args(words)
    if args.version:
        from preheat import __version__

        print(__version__)
        return 0
    configure_logging(logging.INFO if args.verbose else logging.WARNING)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return func(args)
    except PreheatError as exc:
        print(f"preheat: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
