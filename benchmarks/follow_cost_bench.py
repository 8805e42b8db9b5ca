"""What followers cost the store: requests and bytes per follower-hour idle, and per version.

``--followers`` readers (1 and 16 by default; threads of this process, each with its own
watch) follow one folder on moto's S3 server on 127.0.0.1, which runs in its own process and
counts every request and body byte. Two ways of looking at ``LATEST``:

- ``before``: a GET of ``LATEST`` every ``--poll`` seconds (what ``follow`` did before it looked at ``LATEST``'s ETag);
- ``conditional``: ``ws.follow`` now: a HEAD while the ETag is unchanged (no body), the interval
  backing off from ``--poll`` to ``--max-poll`` while idle, reset by each new version.

**Idle**: ``--idle`` seconds with nothing published, scaled to one follower-hour. **Per
version**: ``--versions`` publishes of a small model (one tensor of ``--size-kb``), the
followers' requests and bytes in that window (their looks included) per version and follower;
the publisher's own requests (measured alone first) are left out.

    python -m benchmarks.follow_cost_bench                               # poll 1 s, max 4 s
    python -m benchmarks.follow_cost_bench --poll 0.2 --max-poll 0.8 --idle 10   # quicker
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid

import numpy as np

import weightstore as ws
from benchmarks.common import table
from benchmarks.s3_server import ServerProcess, restore_environment, use_environment
from weightstore import sync as versions
from weightstore.io.folders import folder_for

BUCKET = "weightstore-follow-cost"
HOUR = 3600.0


def _follow(folder: str, mode: str, poll: float, max_poll: float, stop: threading.Event, seen: list[int]) -> None:
    if mode == "before":
        while not stop.is_set():
            version = versions.latest(folder)
            if version is not None and (not seen or version.step > seen[-1]):
                version.pin()
                seen.append(version.step)
                version.release()
            stop.wait(poll)
        return
    watch = versions.PointerWatch(folder_for(folder), poll, max_poll)
    while not stop.is_set():
        version = watch.newer(seen[-1] if seen else None)
        if version is not None:
            seen.append(version.step)
            version.release()
            continue
        stop.wait(watch.interval)


def _publish(folder: str, step: int, size_kb: float) -> None:
    ws.publish(folder, {"w": np.full(max(1, int(size_kb * 256)), step, np.float32)}, step=step, keep=3)


def measure(server: ServerProcess, mode: str, followers: int, poll: float, max_poll: float, idle: float,
            count: int, size_kb: float, publisher: dict[str, int]) -> dict[str, float]:
    folder = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    _publish(folder, 1, size_kb)
    stop = threading.Event()
    seen: list[list[int]] = [[] for _ in range(followers)]
    threads = [threading.Thread(target=_follow, args=(folder, mode, poll, max_poll, stop, seen[i]), daemon=True)
               for i in range(followers)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while any(not s for s in seen) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(max_poll * 2)  # past the first looks and the backoff's climb
    server.reset()
    time.sleep(idle)
    quiet = server.counts()
    server.reset()
    for step in range(2, count + 2):
        _publish(folder, step, size_kb)
        deadline = time.monotonic() + 60
        while any(s[-1] < step for s in seen) and time.monotonic() < deadline:
            time.sleep(0.005)
    busy = server.counts()
    stop.set()
    for thread in threads:
        thread.join()
    per_hour = HOUR / idle / followers
    return {
        "idle_requests": quiet["requests"] * per_hour, "idle_bytes": (quiet["sent"] + quiet["received"]) * per_hour,
        "version_requests": (busy["requests"] - publisher["requests"]) / count / followers,
        "version_bytes": (busy["sent"] + busy["received"] - publisher["bytes"]) / count / followers,
    }


def bench(followers: list[int], poll: float, max_poll: float, idle: float, count: int, size_kb: float) -> None:
    server = ServerProcess()
    saved = use_environment(server)
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(BUCKET)
        alone = f"s3://{BUCKET}/{uuid.uuid4().hex}"
        _publish(alone, 1, size_kb)
        server.reset()
        for step in range(2, count + 2):
            _publish(alone, step, size_kb)
        counts = server.counts()
        publisher = {"requests": counts["requests"], "bytes": counts["sent"] + counts["received"]}
        rows = []
        for mode in ("before", "conditional"):
            for n in followers:
                r = measure(server, mode, n, poll, max_poll, idle, count, size_kb, publisher)
                rows.append([mode, str(n), f"{r['idle_requests']:,.0f}", f"{r['idle_bytes'] / 1024:,.0f}",
                             f"{r['version_requests']:.1f}", f"{r['version_bytes'] / 1024:.1f}"])
    finally:
        server.stop()
        restore_environment(saved)
    print(f"follow cost on loopback S3: poll {poll:g} s, max poll {max_poll:g} s, {idle:g} s idle, "
          f"{count} versions of {size_kb:g} KB")
    print(table(["looks", "followers", "idle requests/follower-hour", "idle KB/follower-hour",
                 "requests/version/follower", "KB/version/follower"], rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.follow_cost_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--max-poll", type=float, default=4.0)
    parser.add_argument("--idle", type=float, default=60.0, help="idle seconds measured (default 60)")
    parser.add_argument("--versions", type=int, default=5)
    parser.add_argument("--size-kb", type=float, default=64.0)
    args = parser.parse_args(argv)
    bench(args.followers, args.poll, args.max_poll, args.idle, args.versions, args.size_kb)


if __name__ == "__main__":
    main()
