"""safetensors through weightstore against the ``safetensors`` library itself.

Two shapes of weights: ``size_mb`` of float32 in 50 tensors, and 50,000 tensors of 256
floats (50 MB, where per-tensor costs dominate). For each, in one run:

- save: ``weightstore.save`` (atomic and durable: fsync of the file, rename, fsync of the
  folder) against ``safetensors.numpy.save_file`` (which writes a temporary and renames it)
  plus the same fsyncs, after its rename; and the floors: the raw bytes written and made
  durable in each of those two orders, which differ by themselves (see :func:`raw_save`);
- load: ``weightstore.load`` (checksums verified, and not) against
  ``safetensors.numpy.load_file``; a load counts once every byte has been touched (each array
  is summed), so a lazy map cannot hide its cost. Files are in the page cache when read.

The cases take turns, repetition by repetition, so a noisy shared machine weighs on all of
them alike; the table shows medians and the ratio to the library's row (the issue's bar is
1.1x).

    python -m benchmarks.safetensors_bench                 # 1 GB, 6 repetitions
    python -m benchmarks.safetensors_bench --size-mb 256   # quicker
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import safetensors.numpy

import weightstore
from benchmarks.common import MB, fmt_ratio, fmt_seconds, fsync_path, machine_line, median, table, touch
from weightstore.io.files import fsync_folder
from weightstore.io.files import fsync_path as fsync_file

BIG_TENSORS = 50
SMALL_TENSORS, SMALL_FLOATS = 50_000, 256


def big_weights(size_mb: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    floats = int(size_mb * MB / 4 / BIG_TENSORS) // 256 * 256
    return {f"block_{i:02d}/kernel": rng.standard_normal((floats // 256, 256), dtype=np.float32)
            for i in range(BIG_TENSORS)}


def small_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    flat = rng.standard_normal(SMALL_TENSORS * SMALL_FLOATS, dtype=np.float32)
    return {f"layer_{i // 100:03d}/unit_{i % 100:02d}/w": flat[i * SMALL_FLOATS : (i + 1) * SMALL_FLOATS].copy()
            for i in range(SMALL_TENSORS)}


def interleaved(runs: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """Median seconds of each run, taking turns (one warm-up each first), in an order that
    rotates every round: on a shared, noisy machine, load that comes and goes weighs on every
    case alike, and so does whatever one case leaves to the next (such as writeback of the
    file it just replaced)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for round_ in range(repeat + 1):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            run = runs[name]
            gc.collect()
            start = time.perf_counter()
            out = run()
            elapsed = time.perf_counter() - start
            del out
            if round_:
                times[name].append(elapsed)
    return {name: median(values) for name, values in times.items()}


def raw_save(weights: dict[str, np.ndarray], path: str, *, fsync_first: bool) -> None:
    """The floor of a durable save: the tensors' bytes to a temporary file, renamed over
    ``path``, fsynced before the rename (the crash-safe order weightstore uses) or after it
    (the order of "the library's save, then an fsync": ext4 starts writing a file back when
    it is renamed over another, which makes that order measurably cheaper)."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as handle:
        for value in weights.values():
            handle.write(value)
    if fsync_first:
        fsync_file(temporary)
    os.replace(temporary, path)
    if not fsync_first:
        fsync_file(path)
    fsync_folder(Path(path).parent)


def cases(weights: dict[str, np.ndarray], folder: str, repeat: int) -> list[tuple[str, float, float]]:
    """``(case, median seconds, ratio to the library's matching case)`` rows."""
    ours, theirs = os.path.join(folder, "ours.safetensors"), os.path.join(folder, "theirs.safetensors")
    raw = os.path.join(folder, "raw.bin")

    def library_save() -> None:
        safetensors.numpy.save_file(weights, theirs)
        fsync_path(theirs)

    save = interleaved({
        "theirs": library_save,
        "ours": lambda: weightstore.save(ours, weights),
        "raw, rename, fsync": lambda: raw_save(weights, raw, fsync_first=False),
        "raw, fsync, rename": lambda: raw_save(weights, raw, fsync_first=True),
    }, repeat)
    load = interleaved({
        "theirs": lambda: touch(safetensors.numpy.load_file(theirs)),
        "ours": lambda: touch(weightstore.load(ours)),
        "unverified": lambda: touch(weightstore.load(ours, verify=False)),
    }, repeat)
    rows = [
        ("save: safetensors.numpy.save_file + fsync", save, "theirs"),
        ("save: weightstore.save (durable)", save, "ours"),
        ("save floor: raw bytes, rename, fsync", save, "raw, rename, fsync"),
        ("save floor: raw bytes, fsync, rename", save, "raw, fsync, rename"),
        ("load: safetensors.numpy.load_file + touch", load, "theirs"),
        ("load: weightstore.load, verified + touch", load, "ours"),
        ("load: weightstore.load, verify=False + touch", load, "unverified"),
    ]
    return [(label, medians[name], medians[name] / medians["theirs"]) for label, medians, name in rows]


def bench(size_mb: float = 1024, repeat: int = 6) -> list[tuple[str, str, float, float]]:
    """Run both shapes, print one table, return its rows ``(shape, case, seconds, ratio)``."""
    folder = tempfile.mkdtemp(prefix="ws-safetensors-bench-", dir=os.environ.get("WS_BENCH_DIR"))
    rows: list[tuple[str, str, float, float]] = []
    try:
        shapes = [(f"{size_mb:g} MB in {BIG_TENSORS} tensors", lambda: big_weights(size_mb)),
                  (f"{SMALL_TENSORS:,} x {SMALL_FLOATS} floats", small_weights)]
        for label, make in shapes:
            weights = make()
            rows += [(label, case, seconds, ratio) for case, seconds, ratio in cases(weights, folder, repeat)]
            del weights
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"safetensors benchmark: {machine_line()}, safetensors {safetensors.__version__}, "
          f"median of {repeat}")
    print(table(["weights", "case", "seconds", "vs library"],
                [(label, case, fmt_seconds(seconds), fmt_ratio(ratio)) for label, case, seconds, ratio in rows]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.safetensors_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=1024, help="bytes of the big case (default 1024)")
    parser.add_argument("--repeat", type=int, default=6, help="timed runs per case (default 6: each order as often)")
    args = parser.parse_args(argv)
    bench(args.size_mb, args.repeat)


if __name__ == "__main__":
    main()
