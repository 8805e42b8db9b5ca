"""Shared helpers for the benchmarks: timing, medians, peak memory, subprocess cases, tables.

Every case runs in a fresh Python process so that its peak memory is its own. Inside that
process, :func:`measure` warms up, resets the kernel's peak-RSS mark before each repetition
(``/proc/self/clear_refs``, falling back to ``ru_maxrss``) and reports the median time, the
median CPU seconds the process spent (every thread's: what survives a machine whose other core
is busy) and the largest peak above the RSS the process held just before the repetition began.
:func:`busy_neighbour` runs a CPU-bound process beside the cases, for a bench's ``--busy`` rows.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MB = 1 << 20
RESULT_MARK = "@@RESULT@@ "


# -- memory -------------------------------------------------------------------------------
def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident memory now (anonymous and file-backed pages this process maps)."""
    kb = _status_kb("VmRSS")
    if kb is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return kb * 1024


_CAN_RESET = None


def reset_peak() -> bool:
    """Reset the peak-RSS mark (Linux ``clear_refs`` 5); False where the kernel forbids it."""
    global _CAN_RESET
    if _CAN_RESET is False:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        _CAN_RESET = True
    except OSError:
        _CAN_RESET = False
    return _CAN_RESET


def peak_bytes() -> int:
    kb = _status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def anon_bytes() -> int:
    """Anonymous memory resident now (``RssAnon``): what a process holds of its own, not the
    page cache's pages a map of a file shows in its RSS."""
    kb = _status_kb("RssAnon")
    return 0 if kb is None else kb * 1024


class AnonPeak:
    """The most anonymous memory (:func:`anon_bytes`) resident during a ``with`` block, in
    :attr:`peak`: sampled by a thread every ``every`` seconds, and on entering and leaving."""

    def __init__(self, every: float = 0.001):
        import threading

        self.peak = 0
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, anon_bytes())

    def __enter__(self) -> AnonPeak:
        self.peak = anon_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())


def anon_during(run: Callable[[], Any]) -> dict[str, float]:
    """Call ``run`` once: its seconds, the most anonymous memory it held above what the process
    held before (sampled every millisecond by a thread), and what it still held after it
    returned and its result was dropped (memory an allocator pool kept, for good)."""
    gc.collect()
    start = anon_bytes()
    with AnonPeak() as memory:
        began = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - began
    del out
    gc.collect()
    return {"seconds": seconds, "anon": memory.peak - start, "kept": anon_bytes() - start}


def evict(paths: Sequence[str]) -> None:
    """Drop the page-cache pages of ``paths`` (files, or folders of them) and nothing else: each
    file is fsynced (dirty pages cannot be dropped) then ``posix_fadvise(DONTNEED)``, so the next
    read comes from the disk, as on a fresh host, without touching other processes' cache."""
    for path in paths:
        files = [path] if os.path.isfile(path) else [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
        for name in files:
            fd = os.open(name, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- timing -------------------------------------------------------------------------------
def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_seconds(run: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``repeat`` calls of ``run`` in this process, after one warm-up call
    (page cache, imports, caches a user's second call would have too)."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return median(times)


def interleaved_medians(cases: Mapping[str, Callable[[], object]], repeat: int,
                        clock: Callable[[], float] = time.perf_counter,
                        cpu: dict[str, float] | None = None) -> dict[str, float]:
    """Median seconds per case, the cases taking turns (one warm-up round, then ``repeat``
    rounds): on a machine whose load drifts, every case sees the same drift. ``cpu``, when
    given, receives each case's median CPU seconds of this process as well."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpus: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(repeat + 1):
        for name, run in cases.items():
            start, start_cpu = clock(), time.process_time()
            run()
            if round_:
                times[name].append(clock() - start)
                cpus[name].append(time.process_time() - start_cpu)
    if cpu is not None:
        cpu.update({name: median(values) for name, values in cpus.items()})
    return {name: median(values) for name, values in times.items()}


def touch(arrays: Mapping[str, Any] | Sequence[Any]) -> float:
    """Read every byte of every array (sum them), so a lazy map cannot hide its cost."""
    values = arrays.values() if isinstance(arrays, Mapping) else arrays
    total = 0.0
    for value in values:
        array = np.asarray(value)
        if array.size:
            total += float(array.sum())  # native-dtype SIMD sum: ~0.05 s per GB here
    return total


def measure(
    run: Callable[[], Any],
    *,
    repeat: int = 5,
    warmup: int = 1,
    cleanup: Callable[[Any], None] | None = None,
    before: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Time ``run`` ``repeat`` times after ``warmup`` untimed runs.

    ``run`` returns whatever it produced (kept alive until after the peak is read, then
    dropped); ``cleanup`` gets it when something besides dropping must happen. ``before`` runs
    untimed ahead of each timed run (:func:`evict` for a cold read).
    """
    for _ in range(warmup):
        out = run()
        if cleanup:
            cleanup(out)
        del out
        gc.collect()
    times, cpus, peaks = [], [], []
    for _ in range(repeat):
        if before:
            before()
        gc.collect()
        baseline = rss_bytes()
        exact = reset_peak()
        start, cpu = time.perf_counter(), time.process_time()
        out = run()
        elapsed, spent = time.perf_counter() - start, time.process_time() - cpu
        peaks.append(peak_bytes() - baseline if exact else float("nan"))
        times.append(elapsed)
        cpus.append(spent)
        if cleanup:
            cleanup(out)
        del out
    gc.collect()
    return {"median": median(times), "times": times, "cpu": median(cpus), "cpus": cpus,
            "peak": max(peaks) if peaks else float("nan")}


@contextlib.contextmanager
def busy_neighbour(busy: bool = True) -> Iterator[None]:
    """While the block runs, a CPU-bound process spins beside it (one core's worth: the other
    core of a 2-core machine), as another job on a shared machine would; nothing when not
    ``busy``. Figures taken under it are the ``--busy`` rows of a bench."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


# -- subprocess cases -----------------------------------------------------------------------
def emit(result: Mapping[str, Any]) -> None:
    """How a case process hands its numbers to the parent: one marked JSON line."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def run_case(module: str, case: str, args: Sequence[str], *, timeout: float = 1800,
             env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m module --case case *args`` in a fresh process; return its result."""
    command = [sys.executable, "-m", module, "--case", case, *args]
    full_env = dict(os.environ, **(env or {}))
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = (done.stdout[-2000:] + "\n" + done.stderr[-4000:]).strip()
    raise RuntimeError(f"case {case!r} failed (exit {done.returncode}):\n{tail}")


# -- output -------------------------------------------------------------------------------
def fmt_seconds(value: float) -> str:
    if value != value:  # nan
        return "-"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}x"


def fmt_mb(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value / MB:,.0f}"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (it reads well in a terminal and pastes into the README)."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=False)) + " |",
             "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=False))) + " |")
    return "\n".join(lines)


def fsync_path(path: str) -> None:
    """Make a peer's write durable the way weightstore's save is: file, then its folder."""
    from weightstore.io.files import fsync_folder
    from weightstore.io.files import fsync_path as fsync_file

    fsync_file(path)
    fsync_folder(Path(os.path.abspath(path)).parent)


def machine_line() -> str:
    import platform

    return (f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
            f"{platform.machine()} Linux {platform.release()}")


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (a file or a folder of checkpoint files), then folders."""
    if os.path.isfile(path):
        fsync_path(path)
        return
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
