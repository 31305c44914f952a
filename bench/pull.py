"""Pull benchmark: preheat pull with 1, 4 and 16 parallel streams against a per-connection-throttled HTTP origin and
an S3 server, beside a plain single-stream download of the same files, in ONE run.

    python bench/pull.py [--size 256MB] [--throttle 50MB] [--repeat 1] [--json out.json]

Object stores and CDNs cap each connection (the throttle emulates that: 50 MB/s per connection by default), so a
single stream is bound by the cap and parallel ranged streams multiply it until the link, the server or the CPU is
the limit. The HTTP origin is preheat's own FileServer (real sockets on 127.0.0.1); S3 is moto's standalone server,
which has no throttle and costs ~60 ms per request here whatever its size (one Python process behind a GIL), so it
measures request overhead, not the parallelism a real object store rewards. Each preheat pull lands in a fresh
cache directory, is verified against the manifest's digests and published, all inside the timing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from preheat.checkpoint.manifest import MANIFEST_NAME, Manifest, build_manifest
from preheat.core.config import parse_size
from preheat.store import ModelCache
from preheat.store.pull import pull
from preheat.testing.fileserver import FileServer
from preheat.testing.synthetic import LlamaShape, write_llama_checkpoint


@dataclass
class Row:
    origin: str
    name: str
    seconds: list[float] = field(default_factory=list)
    error: str = ""


def make_origin(root: str, size: int) -> tuple[str, int]:
    marker = os.path.join(root, ".complete")
    if not os.path.exists(marker):
        shape = LlamaShape(8192, 1024, 2816, 1, 8, 4)
        per_layer = shape.nbytes() - LlamaShape(8192, 1024, 2816, 0, 8, 4).nbytes()
        layers = max(1, round((size - (shape.nbytes() - per_layer)) / per_layer))
        shape = LlamaShape(8192, 1024, 2816, layers, 8, 4)
        print(f"building a {shape.nbytes() / 1e6:.0f} MB checkpoint in {root} ...", file=sys.stderr)
        write_llama_checkpoint(root, shape, shards=4)
        with open(os.path.join(root, MANIFEST_NAME), "wb") as out:
            out.write(build_manifest(root).to_json())
        open(marker, "w").close()
    with open(os.path.join(root, MANIFEST_NAME), "rb") as handle:
        manifest = Manifest.from_json(handle.read(), where=root)
    return root, sum(f.size for f in (*manifest.files, *manifest.extra_files))


def single_stream_http(base: str, names: list[str], dest: str) -> None:
    """What a naive downloader does: one sequential GET per file, one at a time."""
    for name in names:
        with urllib.request.urlopen(f"{base}/{name}") as response, open(os.path.join(dest, name), "wb") as out:
            shutil.copyfileobj(response, out, 4 * 1024 * 1024)


def single_stream_s3(client: object, bucket: str, prefix: str, names: list[str], dest: str) -> None:
    for name in names:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"]  # type: ignore[attr-defined]
        with open(os.path.join(dest, name), "wb") as out:
            shutil.copyfileobj(body, out, 4 * 1024 * 1024)


def timed(row: Row, fn: Callable[[str], None], repeat: int) -> None:
    for _ in range(repeat):
        dest = tempfile.mkdtemp(prefix="preheat-pull-bench-")
        try:
            start = time.perf_counter()
            fn(dest)
            row.seconds.append(time.perf_counter() - start)
        except Exception as exc:  # a contender failing must not hide the others' numbers
            row.error = f"{type(exc).__name__}: {exc}"[:160]
            return
        finally:
            shutil.rmtree(dest, ignore_errors=True)


def pull_into(uri: str, threads: int, chunk: int) -> Callable[[str], None]:
    def run(dest: str) -> None:
        pull(uri, ModelCache(dest), threads=threads, chunk_bytes=chunk)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="256MB", help="checkpoint size (default 256MB)")
    parser.add_argument("--throttle", default="50MB", help="per-connection cap of the HTTP origin (default 50MB/s)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per contender (median reported)")
    parser.add_argument("--dir", default=".bench", help="where the generated checkpoint is cached")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 (moto) section")
    parser.add_argument("--chunk", default="16MiB", help="bytes per ranged request of preheat pull (default 16MiB)")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()
    chunk = parse_size(args.chunk)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise

    size = parse_size(args.size)
    root, total = make_origin(os.path.join(args.dir, f"pull-origin-{size // 10**6}MB"), size)
    names = sorted(
        os.path.relpath(os.path.join(d, n), root)
        for d, _, files in os.walk(root)
        for n in files
        if not n.startswith(".")
    )
    rows: list[Row] = []
    throttle = parse_size(args.throttle)
    with FileServer(root, throttle_bps=throttle) as server:
        base = Row("http", "single stream (sequential GETs)")
        timed(base, lambda dest: single_stream_http(server.url, names, dest), args.repeat)
        rows.append(base)
        for threads in (1, 4, 16):
            row = Row("http", f"preheat pull, {threads} stream(s)")
            timed(row, pull_into(server.url, threads, chunk), args.repeat)
            rows.append(row)

    if not args.no_s3:
        try:
            import boto3
            from moto.server import ThreadedMotoServer
        except ImportError as exc:
            rows.append(Row("s3", "all", error=f"not installed ({exc.name})"))
        else:
            moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            moto.start()
            try:
                host, port = moto.get_host_and_port()
                endpoint = f"http://{host}:{port}"
                os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
                os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
                os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                client = boto3.client("s3", endpoint_url=endpoint)
                client.create_bucket(Bucket="bench")
                for name in names:
                    client.upload_file(os.path.join(root, name), "bench", f"model/{name}")
                base = Row("s3", "single stream (sequential GETs)")
                timed(base, lambda dest: single_stream_s3(client, "bench", "model", names, dest), args.repeat)
                rows.append(base)
                for threads in (1, 4, 16):
                    row = Row("s3", f"preheat pull, {threads} stream(s)")
                    timed(row, pull_into("s3://bench/model", threads, chunk), args.repeat)
                    rows.append(row)
            finally:
                moto.stop()

    print(
        f"\ncheckpoint: {total / 1e6:.0f} MB in {len(names)} files; HTTP origin capped at {throttle / 1e6:.0f} MB/s "
        f"per connection; {os.cpu_count()} cores; median of {args.repeat}"
    )
    print(f"{'origin':6s} {'contender':34s} {'MB/s':>8s} {'x single stream':>16s}")
    results = []
    baseline: dict[str, float] = {}
    for row in rows:
        rate = total / statistics.median(row.seconds) / 1e6 if row.seconds else float("nan")
        if row.name.startswith("single"):
            baseline[row.origin] = rate
        ratio = rate / baseline[row.origin] if baseline.get(row.origin) else float("nan")
        print(f"{row.origin:6s} {row.name:34s} {rate:8.1f} {ratio:16.2f}" + (f"  [{row.error}]" if row.error else ""))
        results.append(
            {
                "origin": row.origin,
                "name": row.name,
                "mbps": rate,
                "ratio": ratio,
                "seconds": row.seconds,
                "error": row.error,
            }
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"total_bytes": total, "throttle_bps": throttle, "rows": results}, out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
