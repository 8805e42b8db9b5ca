"""Checksums and shuffle decoding on one thread against two, on a busy machine too.

``core_bench`` times each case in its own process; on a machine other people share, those
medians mostly measure the neighbours. Here every variant runs in one process, round-robin,
so all of them see the same load, and each run is also reported minus the time the calling
thread sat runnable but off a core (``/proc/thread-self/schedstat``): roughly what a quiet
machine would take, conservatively (time the caller waited for a helper that was itself
kept off a core still counts). Loads are ``ws.load`` then a sum of every array, as in
``core_bench``.

    python -m benchmarks.split_bench                 # 1 GB, 10 rounds
    python -m benchmarks.split_bench --size-mb 256 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import MB, machine_line, table, touch
from benchmarks.core_bench import prepare, read_weights, trained_like


def _scheduled() -> tuple[float, float]:
    """(seconds this thread ran, seconds it waited runnable for a core)."""
    with open("/proc/thread-self/schedstat") as handle:
        ran, waited, _ = handle.read().split()
    return int(ran) / 1e9, int(waited) / 1e9


def _timed(run: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, wall seconds minus the run-queue wait)."""
    _, waited = _scheduled()
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    return wall, wall - (_scheduled()[1] - waited)


def round_robin(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[tuple[float, float]]]:
    """Each variant once per round, after one untimed round."""
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for index in range(rounds + 1):
        for name, run in variants.items():
            timing = _timed(run)
            if index:
                results[name].append(timing)
    return results


def _load(path: str, *, verify: bool, threads: int, as_words: bool = False) -> Callable[[], object]:
    import weightstore as ws
    from weightstore.core import _parallel as parallel

    def run() -> None:
        parallel.THREADS = threads
        loaded = ws.load(path, verify=verify)
        touch([v.view(f"u{v.dtype.itemsize}") for v in loaded.values()] if as_words else loaded)

    return run


def bench(size_mb: float, rounds: int) -> None:
    import weightstore as ws

    folder = tempfile.mkdtemp(prefix="ws-split-", dir=os.environ.get("WS_BENCH_DIR"))
    try:
        facts = prepare(folder, size_mb)
        plain, shuffled, trained = (os.path.join(folder, name) for name in ("p.npz", "s.npz", "t.npz"))
        weights = read_weights(folder)
        ws.save(plain, weights)
        ws.save(shuffled, weights, compress="shuffle")
        del weights
        ws.save(trained, trained_like(folder), compress="shuffle")
        trained_bytes = sum(v.nbytes for v in ws.load(trained).values())
        print(f"split benchmark: {facts['arrays']} float32 arrays, {facts['bytes'] / MB:,.0f} MB "
              f"(trained-like shuffle file {trained_bytes / MB:,.0f} MB); {rounds} rounds; {machine_line()}; "
              f"load average {os.getloadavg()[0]:.1f}")
        groups = {
            "checksums": ({"verify=False": _load(plain, verify=False, threads=2),
                           "verified, one thread": _load(plain, verify=True, threads=1),
                           "verified, two threads": _load(plain, verify=True, threads=2)}, facts["bytes"]),
            "shuffle, random-normal": ({"one thread": _load(shuffled, verify=True, threads=1, as_words=True),
                                        "two threads": _load(shuffled, verify=True, threads=2, as_words=True)},
                                       facts["bytes"]),
            "shuffle, trained-like": ({"one thread": _load(trained, verify=True, threads=1, as_words=True),
                                       "two threads": _load(trained, verify=True, threads=2, as_words=True)},
                                      trained_bytes),
        }
        rows = []
        for group, (variants, nbytes) in groups.items():
            results = round_robin(variants, rounds)
            first = statistics.median(quiet for _, quiet in next(iter(results.values())))
            for name, timings in results.items():
                wall = statistics.median(w for w, _ in timings)
                quiet = statistics.median(q for _, q in timings)
                rows.append([group, name, f"{wall:.3f}", f"{quiet:.3f}", f"{nbytes / quiet / 1e9:.2f}",
                             f"{quiet / first:.2f}x"])
        print(table(["load + sum", "variant", "wall s", "minus run-queue wait s", "GB/s (that)",
                     "x first row"], rows))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.split_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="bytes of weights to build (default 1024)")
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (default 10)")
    args = parser.parse_args(argv)
    np.seterr(all="ignore")
    bench(args.size_mb, args.rounds)


if __name__ == "__main__":
    main()
