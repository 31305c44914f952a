"""The ``preheat`` command. Thin on purpose: parse arguments, call one library function, print the result.

Every flag has a ``PREHEAT_*`` environment variable (see ``preheat --help``); ``--json`` prints machine-readable
output; ``--verbose`` tells the story on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from preheat.config import format_bytes, parse_size
from preheat.errors import PreheatError

EPILOG = """\
environment:
  PREHEAT_THREADS        reader threads (default: tuned to the storage; see docs/loader.md)
  PREHEAT_CHUNK_BYTES    bytes per read operation, e.g. 16MiB (default: tuned)
  PREHEAT_LOAD_MODE      default --mode

docs: README.md (quick start), docs/loader.md (how loading works), docs/architecture.md (layers)
"""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="preheat",
        description="Take an LLM replica from cold to serving in seconds.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens, stage by stage, to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

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
    load.add_argument("--threads", type=int, default=None, help="reader threads (default: tuned)")
    load.add_argument("--chunk-bytes", default=None, help="bytes per read, e.g. 16MiB (default: tuned)")
    load.add_argument("--repeat", type=int, default=1, help="load N times and report each run and the median")
    load.add_argument("--json", action="store_true", help="print the load reports as JSON")
    load.set_defaults(func=_cmd_load)
    return parser


def _tp_plan(value: str) -> str | dict[str, int | None]:
    if value == "auto":
        return value
    try:
        with open(value, encoding="utf-8") as handle:
            plan = json.load(handle)
    except (OSError, ValueError) as exc:
        raise PreheatError(f"--tp-plan {value}: cannot read a JSON mapping of patterns to dims ({exc})") from None
    if not isinstance(plan, dict) or not all(v is None or isinstance(v, int) for v in plan.values()):
        raise PreheatError(f"--tp-plan {value}: must map name patterns to an integer dim or null")
    return plan


def _cmd_load(args: argparse.Namespace) -> int:
    from preheat.loader import LoadReport, load

    chunk = parse_size(args.chunk_bytes) if args.chunk_bytes else None
    plan = _tp_plan(args.tp_plan)
    reports: list[LoadReport] = []
    for _ in range(max(1, args.repeat)):
        with _LazyProgress(enabled=not args.json and sys.stderr.isatty(), label=f"loading {args.path}") as bar:
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

    from preheat.loader import LoadReport

    runs = [r for r in reports if isinstance(r, LoadReport)]
    median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
    console = Console()
    table = Table(
        title=f"{median.source} — mode {median.mode}, device {median.device}, rank {median.rank}/{median.world_size}"
    )
    table.add_column("stage")
    table.add_column("seconds", justify="right")
    table.add_column("GB/s", justify="right")
    for stage, seconds in median.stages.items():
        rate = f"{median.bytes / seconds / 1e9:.2f}" if stage in ("read", "map") and seconds > 0 else ""
        table.add_row(stage, f"{seconds:.4f}", rate)
    table.add_row("total", f"{median.seconds:.4f}", f"{median.gbps:.2f}", style="bold")
    console.print(table)
    console.print(
        f"{median.tensors} tensors, {format_bytes(median.bytes)} in {median.files} file(s); "
        f"read {format_bytes(median.bytes_read)} from storage; {median.tuning}"
    )
    for note in median.notes:
        console.print(f"note: {note}", style="yellow")
    if len(runs) > 1:
        durations = [r.seconds for r in runs]
        console.print(
            "runs: "
            + ", ".join(f"{d:.3f} s" for d in durations)
            + f"; median {statistics.median(durations):.3f} s ({median.gbps:.2f} GB/s)"
        )


class _LazyProgress:
    """A progress bar that appears only once a load has taken ~2 s, so quick loads print nothing extra."""

    def __init__(self, *, enabled: bool, label: str, delay: float = 2.0) -> None:
        self.enabled, self.label, self.delay = enabled, label, delay
        self.start = time.monotonic()
        self._progress: object | None = None
        self._task: object | None = None

    def __enter__(self) -> _LazyProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()  # type: ignore[attr-defined]

    def update(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            if time.monotonic() - self.start < self.delay:
                return
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            progress = Progress(
                "[progress.description]{task.description}",
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                transient=True,
            )
            progress.start()
            self._task = progress.add_task(self.label, total=total)
            self._progress = progress
        self._progress.update(self._task, completed=done)  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from preheat import __version__

        print(__version__)
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
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


if __name__ == "__main__":
    raise SystemExit(main())
