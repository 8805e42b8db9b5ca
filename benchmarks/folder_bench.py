"""A publish into a folder that already holds many versions (a trainer keeping every one):
milliseconds per publish, and on S3 requests per publish, at each folder size.

The folder is filled with ``--files`` copies of one small version (hard links locally, plain
uploads to moto's S3 server on 127.0.0.1 in its own process), then ``--publishes`` full versions
and as many delta versions (``ws.Delta()``) are published above them with ``keep=None``; the
median per publish is shown. What grows with the folder is its listing, once per publish.

    python -m benchmarks.folder_bench                          # 10, 1,000, 10,000 local; 10, 1,000 on S3
    python -m benchmarks.folder_bench --files 10 1000 10000 --s3-files 10 1000 10000
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid

import numpy as np

import weightstore as ws
from benchmarks.common import machine_line, table
from benchmarks.s3_server import ServerProcess, restore_environment, use_environment

BUCKET = "weightstore-folder-bench"


def weights(step: int) -> dict[str, np.ndarray]:
    """64 KB in 8 tensors, one element changed each step (a delta is small)."""
    found = {f"layer{i}/kernel": np.zeros(2048, np.float32) for i in range(8)}
    found["layer0/kernel"][step % 2048] = step
    return found


def fill_local(folder: str, files: int) -> None:
    """``files`` version files: one published, the rest hard links to it under older steps."""
    ws.publish(folder, weights(files), step=files, keep=None)
    first = os.path.join(folder, f"step-{files:012d}.npz")
    for step in range(1, files):
        os.link(first, os.path.join(folder, f"step-{step:012d}.npz"))


def fill_s3(folder: str, files: int) -> None:
    import s3fs

    ws.publish(folder, weights(files), step=files, keep=None)
    fs = s3fs.S3FileSystem()
    data = fs.cat_file(f"{folder}/step-{files:012d}.npz")
    for step in range(1, files):
        fs.pipe_file(f"{folder}/step-{step:012d}.npz", data)


def per_publish(folder: str, first: int, publishes: int, delta: ws.Delta | None,
                server: ServerProcess | None) -> tuple[float, float]:
    """Median milliseconds and mean requests (0 locally) per publish of ``publishes`` steps."""
    spent, requests = [], 0
    for step in range(first, first + publishes):
        if server is not None:
            server.reset()
        started = time.perf_counter()
        ws.publish(folder, weights(step), step=step, keep=None, delta=delta if delta is not None else False)
        spent.append(time.perf_counter() - started)
        if server is not None:
            requests += server.counts()["requests"]
    return statistics.median(spent) * 1000, requests / publishes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.folder_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, nargs="*", default=[10, 1000, 10000])
    parser.add_argument("--s3-files", type=int, nargs="*", default=[10, 1000])
    parser.add_argument("--publishes", type=int, default=10)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for files in args.files:
            for kind in ("full", "delta"):
                folder = os.path.join(scratch, f"{kind}-{files}")
                fill_local(folder, files)
                ms, _ = per_publish(folder, files + 1, args.publishes, ws.Delta() if kind == "delta" else None, None)
                rows.append(["local", f"{files:,}", kind, f"{ms:.1f}", "-"])
    if args.s3_files:
        import s3fs

        server = ServerProcess()
        saved = use_environment(server)
        try:
            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
            for files in args.s3_files:
                for kind in ("full", "delta"):
                    folder = f"s3://{BUCKET}/{kind}-{files}-{uuid.uuid4().hex[:8]}"
                    fill_s3(folder, files)
                    ms, requests = per_publish(folder, files + 1, args.publishes,
                                               ws.Delta() if kind == "delta" else None, server)
                    rows.append(["S3 (moto)", f"{files:,}", kind, f"{ms:.1f}", f"{requests:.1f}"])
        finally:
            restore_environment(saved)
            server.stop()
    print(machine_line())
    print(table(["folder", "files", "version", "ms/publish (median)", "requests/publish"], rows))


if __name__ == "__main__":
    main()
