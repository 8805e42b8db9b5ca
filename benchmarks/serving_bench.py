"""Serving stall benchmark: how long a swap holds ``Follower.reading()`` out.

A serving process keeps TF2 variables of ``size_mb`` (``--tensors`` float32 tensors) current
with a :class:`~weightstore.adapters.serving.follower.Follower`, while a prober thread enters
``reading()`` over and over (holding it 0.5 ms, an inference call) and records how long each
entry waited. A publisher in another process publishes ``--versions`` versions, every tensor
changed each time, from a local folder or through moto's S3 server on 127.0.0.1 (itself a
third process, so its Python work does not share the serving process's interpreter lock).

Per swap, the **stall** is the longest entry wait of the probes that entered under the new
version (they were the ones held back by it). The reference is **assign from memory**:
``tf2.assign`` of the same model from a dict of arrays already in memory, the least a swap
can hold serving for. The target is stall <= 1.5x that. **+anon** is the peak of ``RssAnon``
while the later versions come in, above what the process held serving the first, against the
model's bytes: staging a version costs about one model (its buffers then become the
variables'; a local one's are copied from its mapping while staging).

    python -m benchmarks.serving_bench                             # 32 and 256 MB, local and S3
    python -m benchmarks.serving_bench --size-mb 4 --versions 5    # a smoke check
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import numpy as np

import weightstore as ws
from benchmarks.common import MB, AnonPeak, anon_bytes, fmt_mb, fmt_ratio, fmt_seconds, machine_line, table
from benchmarks.sync_bench import Target, bump, make_weights

MODULE = "benchmarks.serving_bench"
BUCKET = "weightstore-serving-bench"
HOLD = 0.0005  # seconds each probe holds reading(), as an inference call would


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def publish_versions(folder: str, size_mb: float, tensors: int, versions: int, interval: float) -> None:
    """The publisher process: step 1 at once, then one version every ``interval`` seconds."""
    weights = make_weights(size_mb, tensors)
    for step in range(1, versions + 2):
        bump(weights, 1.0, step)
        started = time.monotonic()
        ws.publish(folder, weights, step=step, keep=3)
        time.sleep(max(0.0, interval - (time.monotonic() - started)))


def assign_from_memory(size_mb: float, tensors: int, repeat: int) -> list[float]:
    """Seconds of ``tf2.assign`` from a dict in memory, every tensor changed each time."""
    from weightstore.adapters import tf2

    weights = make_weights(size_mb, tensors)
    target = Target("tf2", weights)
    times = []
    for step in range(repeat + 1):
        bump(weights, 1.0, step)
        start = time.perf_counter()
        tf2.assign(target.obj, weights)
        if step:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return times


def serve(folder: str, size_mb: float, tensors: int, versions: int, interval: float) -> dict[str, object]:
    """Follow ``folder`` while a publisher process publishes; the stalls per swap, in seconds."""
    from weightstore.adapters.serving.follower import Follower

    weights = make_weights(size_mb, tensors)
    target = Target("tf2", weights)
    del weights
    waits: dict[int, list[float]] = {}
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            with follower.reading():
                waited = time.perf_counter() - start
                step = follower.version.step if follower.version is not None else -1
                time.sleep(HOLD)
            waits.setdefault(step, []).append(waited)

    publisher = subprocess.Popen([sys.executable, "-m", MODULE, "--publish", folder, "--size-mb", str(size_mb),
                                  "--tensors", str(tensors), "--versions", str(versions), "--interval", str(interval)])
    try:
        with Follower(target.obj, folder, poll=0.01) as follower:
            if follower.wait(1, timeout=600) is None:
                raise RuntimeError(f"no first version: {follower.error}")
            before = anon_bytes()
            with AnonPeak(every=0.005) as anon:
                prober = threading.Thread(target=probe, daemon=True)
                prober.start()
                if follower.wait(versions + 1, timeout=600) is None:
                    raise RuntimeError(f"the follower never reached step {versions + 1}: {follower.error}")
                time.sleep(0.05)  # let probes held back by the last swap enter
                stop.set()
                prober.join()
    finally:
        publisher.wait(600)
    stalls = [max(found) for step, found in waits.items() if step > 1]
    every = [wait for found in waits.values() for wait in found]
    return {"stalls": stalls, "probe_p99": percentile(every, 99), "anon": max(0, anon.peak - before)}


def bench(sizes: list[float], stores: list[str], tensors: int, versions: int, out=sys.stdout) -> list[dict]:
    from benchmarks.s3_server import ServerProcess, restore_environment, use_environment

    rows, results = [], []
    server = ServerProcess() if "s3" in stores else None
    saved = use_environment(server) if server else {}
    try:
        if server is not None:
            import s3fs

            s3fs.S3FileSystem.clear_instance_cache()
            s3fs.S3FileSystem().mkdir(BUCKET)
        with tempfile.TemporaryDirectory(prefix="weightstore-serving-bench-") as scratch:
            for size in sizes:
                reference = assign_from_memory(size, tensors, versions)
                ref_median = float(np.median(reference))
                rows.append([f"assign from memory {size:g} MB", fmt_seconds(ref_median),
                             fmt_seconds(percentile(reference, 99)), "", "", "", ""])
                for store in stores:
                    folder = (os.path.join(scratch, f"{store}-{size:g}") if store == "local"
                              else f"s3://{BUCKET}/{uuid.uuid4().hex}")
                    # long enough between publishes for the upload and the swap to be over before the
                    # next: the S3 server (a Python process on the same cores) moves 50-100 MB/s, and
                    # 25 on a loaded machine, where it also answers a read of a version pruned under
                    # it with a 500 (moto closes the object's buffer), so a follower must keep up
                    interval = max(0.5, size / (10 if store == "s3" else 400))
                    result = serve(folder, size, tensors, versions, interval)
                    stalls = result["stalls"]
                    assert isinstance(stalls, list)
                    median_stall = float(np.median(stalls)) if stalls else float("nan")
                    rows.append([f"follower stall, {store} {size:g} MB", fmt_seconds(median_stall),
                                 fmt_seconds(percentile(stalls, 99)), fmt_ratio(median_stall / ref_median),
                                 str(len(stalls)), fmt_seconds(float(result["probe_p99"])),  # type: ignore[arg-type]
                                 f"{fmt_mb(float(result['anon']))} ({result['anon'] / (size * MB):.2f}x)"])  # type: ignore[operator]
                    results.append({"store": store, "size_mb": size, "median": median_stall,
                                    "reference": ref_median, **result})
    finally:
        if server is not None:
            server.stop()
            restore_environment(saved)
    print(f"serving stall: {tensors} float32 tensors, {versions} versions each; {machine_line()}", file=out)
    print(table(["case", "median", "p99", "x assign", "swaps", "probe p99", "+anon"], rows), file=out)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, nargs="+", default=[32, 256], help="model sizes (default 32 256)")
    parser.add_argument("--stores", default="local,s3", help="local and/or s3 (default both)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors per model (default 64)")
    parser.add_argument("--versions", type=int, default=20, help="versions published per case (default 20)")
    parser.add_argument("--publish", metavar="FOLDER", help=argparse.SUPPRESS)  # the publisher process
    parser.add_argument("--interval", type=float, default=0.3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if args.publish:
        publish_versions(args.publish, args.size_mb[0], args.tensors, args.versions, args.interval)
        return
    bench(args.size_mb, args.stores.split(","), args.tensors, args.versions)


if __name__ == "__main__":
    main()
