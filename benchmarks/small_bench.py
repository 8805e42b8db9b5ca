"""Many small tensors: 50,000 float32 tensors of 256 values, against safetensors.

Here per-tensor work dominates, not bytes: parsing and checking 50,000 manifest entries at
open, and, per read, finding the member, checking its npy header and CRC. One process, the
same weights for every case, files in the page cache; medians of ``repeat`` runs. Each row is
compared with the safetensors call a user would make instead; ``ws.save`` is durable (fsync
before the rename), so the save row is also compared with ``save_file`` followed by an fsync, and
with the floor of any durable replace: ``save_file`` to a temporary, fsync, rename over the
file, fsync of the folder (two fsyncs, as ``ws.save`` does). ``save_file`` itself writes a new
file and renames it over the target (strace), so every case makes a new file per save; the
second fsync, of the folder, is what only the floor and ``ws.save`` pay.

    python -m benchmarks.small_bench                       # 50,000 x 256 float32, 5 runs
    python -m benchmarks.small_bench --tensors 5000 --repeat 3
    python -m benchmarks.small_bench --cpu                 # CPU time, for a machine others load
    python -m benchmarks.small_bench --tensors 100 --repeat 31   # the small-work targets
    python -m benchmarks.small_bench --tensors 100 --per-call [--without-fsync]   # CPU per call, in a loop
    python -m benchmarks.small_bench --tensors 100 --repeat 101 --cold-open   # each open after the same work
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import interleaved_medians


def _ws_open_keys(path: str) -> None:
    import weightstore as ws

    with ws.open(path) as store:
        store.keys()


def _st_open_keys(path: str) -> None:
    from safetensors import safe_open

    with safe_open(path, "np") as handle:
        handle.keys()


def _h5py_keys(path: str) -> list[str]:
    """The listing a user of h5py writes: every dataset's name, walking the file."""
    import h5py

    names: list[str] = []
    with h5py.File(path, "r") as handle:
        handle.visititems(lambda name, node: names.append(name) if isinstance(node, h5py.Dataset) else None)
    return names


def _st_save_durable(flat: dict[str, np.ndarray], path: str) -> None:
    """What ``ws.save`` does beyond ``save_file``: the bytes on disk before it returns."""
    import safetensors.numpy

    safetensors.numpy.save_file(flat, path)
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def bench(tensors: int = 50_000, size: int = 256, repeat: int = 5, clock=time.perf_counter) -> dict[str, float]:
    """Print and return median seconds per case, and weightstore's ratio to safetensors."""
    import safetensors.numpy

    import weightstore as ws

    rng = np.random.default_rng(0)
    weights = {f"layer_{i // 100:04d}/w_{i % 100:02d}": rng.standard_normal(size).astype(np.float32)
               for i in range(tensors)}
    with tempfile.TemporaryDirectory(prefix="ws-small-") as folder:
        npz, st = os.path.join(folder, "w.npz"), os.path.join(folder, "w.safetensors")
        flat = {k.replace("/", "."): v for k, v in weights.items()}

        open_keys, st_open_keys = functools.partial(_ws_open_keys, npz), functools.partial(_st_open_keys, st)

        def st_open_keys_ws() -> None:  # the same file through weightstore (its names read as torch's)
            with ws.open(st) as store:
                store.keys()

        st_save_durable = functools.partial(_st_save_durable, flat, st)

        def fsync_at(path: str) -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        def st_save_floor() -> None:  # the least a durable replace does: a crash leaves the old file or the new one
            safetensors.numpy.save_file(flat, st + ".tmp")
            fsync_at(st + ".tmp")
            os.replace(st + ".tmp", st)
            fsync_at(folder)

        def read_each() -> None:
            with ws.open(npz) as store:
                for key in store:
                    store[key]

        cases = {
            "save (weightstore npz)": lambda: ws.save(npz, weights),
            "save (safetensors save_file)": lambda: safetensors.numpy.save_file(flat, st),
            "save (safetensors save_file + fsync)": st_save_durable,
            "save (safetensors durable replace)": st_save_floor,
            "open + keys (weightstore npz)": open_keys,
            "open + keys (safetensors safe_open)": st_open_keys,
            "load (weightstore npz)": lambda: ws.load(npz),
            "load verify=False (weightstore npz)": lambda: ws.load(npz, verify=False),
            "load mmap=False (weightstore npz)": lambda: ws.load(npz, mmap=False),
            "read each via open (weightstore npz)": read_each,
            "load (safetensors load_file)": lambda: safetensors.numpy.load_file(st),
            "open + keys (weightstore .safetensors)": st_open_keys_ws,  # last: the cases above run as they did before it
        }
        cpu: dict[str, float] = {}
        results = interleaved_medians(cases, repeat, clock, cpu)
    peers = {"save": ["save (safetensors save_file)", "save (safetensors save_file + fsync)",
                      "save (safetensors durable replace)"],
             "open": ["open + keys (safetensors safe_open)"], "load": ["load (safetensors load_file)"],
             "read": ["load (safetensors load_file)"]}
    what = "CPU time of this process" if clock is time.process_time else "wall time"
    print(f"{tensors} tensors of {size} float32, median {what} of {repeat} interleaved runs")
    for name, seconds in results.items():
        ratios = "" if "(safetensors" in name else "  " + ", ".join(
            f"{seconds / results[peer]:5.2f}x {peer.split('(')[1].rstrip(')')}" for peer in peers[name.split()[0]])
        print(f"  {name:40s} {seconds * 1000:9.1f} ms{ratios}")
    targets = [("durable save", "save (weightstore npz)", "save (safetensors save_file + fsync)", 1.5),
               ("durable save", "save (weightstore npz)", "save (safetensors durable replace)", 1.5),
               ("open + keys", "open + keys (weightstore npz)", "open + keys (safetensors safe_open)", 2.0),
               ("verified load", "load (weightstore npz)", "load verify=False (weightstore npz)", 1.3)]
    print("  targets: x peer, wall and CPU")
    for what, own, peer, most in targets:
        wall, spent = results[own] / results[peer], cpu[own] / cpu[peer]
        print(f"  {what:14s} <= {most}x {peer:40s} wall {wall:5.2f}x {'yes' if wall <= most else 'NO ':3s}  CPU {spent:5.2f}x")
    results.update(bench_hdf5(weights, repeat, clock))
    return results


def bench_hdf5(weights: dict[str, np.ndarray], repeat: int = 5, clock=time.perf_counter) -> dict[str, float]:
    """weightstore's HDF5 files against the h5py code a user would write for the same weights.

    The peers: ``create_dataset`` of each key (h5py makes the nested groups), a listing that
    walks the file with ``visititems``, and a load that reads each dataset so with ``ds[()]``. Print and return
    median seconds per case, with weightstore's ratio to its h5py peer.
    """
    import h5py

    import weightstore as ws

    with tempfile.TemporaryDirectory(prefix="ws-small-h5-") as folder:
        ours, plain = os.path.join(folder, "w.h5"), os.path.join(folder, "plain.h5")

        def h5py_save() -> None:
            with h5py.File(plain, "w") as handle:
                for key, value in weights.items():
                    handle.create_dataset(key, data=value)

        def h5py_load() -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            with h5py.File(plain, "r") as handle:
                handle.visititems(lambda name, node: out.__setitem__(name, node[()])
                                  if isinstance(node, h5py.Dataset) else None)
            return out

        def open_keys() -> None:
            with ws.open(ours) as store:
                store.keys()

        cases = {
            "save (weightstore hdf5)": lambda: ws.save(ours, weights),
            "save (h5py)": h5py_save,
            "open + keys (weightstore hdf5)": open_keys,
            "open + keys (h5py)": functools.partial(_h5py_keys, plain),
            "load (weightstore hdf5)": lambda: ws.load(ours),
            "load verify=False (weightstore hdf5)": lambda: ws.load(ours, verify=False),
            "load (h5py)": h5py_load,
        }
        results = interleaved_medians(cases, repeat, clock)
    print(f"HDF5, {len(weights)} tensors, median of {repeat} interleaved runs")
    for name, seconds in results.items():
        peer = {"save": "save (h5py)", "open": "open + keys (h5py)"}.get(name.split()[0], "load (h5py)")
        ratio = "" if "h5py" in name else f"  {seconds / results[peer]:5.2f}x h5py {peer.split()[0]}"
        print(f"  {name:40s} {seconds * 1000:9.1f} ms{ratio}")
    return results


def bench_cold_open(tensors: int = 100, size: int = 256, repeat: int = 101) -> dict[str, float]:
    """CPU of one open + keys, each open right after the same work, a durable replace of another
    file (``save_file``, two fsyncs, a rename: the process sleeps, its caches go cold), the opens
    taking turns in an order rotated each round. In :func:`bench`, ``safe_open`` runs right after
    weightstore's open of the same weights and so finds warm what that one found cold; here no
    case follows another. Then weightstore's HDF5 open against h5py's listing, in turns of their
    own. Print and return median microseconds, with each ratio to ``safe_open`` (HDF5: to h5py)."""
    import safetensors.numpy

    import weightstore as ws

    rng = np.random.default_rng(0)
    weights = {f"layer_{i // 100:04d}/w_{i % 100:02d}": rng.standard_normal(size).astype(np.float32)
               for i in range(tensors)}
    flat = {k.replace("/", "."): v for k, v in weights.items()}
    with tempfile.TemporaryDirectory(prefix="ws-small-cold-") as folder:
        npz, st, h5, scratch = (os.path.join(folder, name)
                                for name in ("w.npz", "w.safetensors", "w.h5", "scratch.safetensors"))
        ws.save(npz, weights)
        safetensors.numpy.save_file(flat, st)

        def chill() -> None:  # what bench's open follows: a durable replace (of a file no case opens)
            _st_save_durable(flat, scratch + ".tmp")
            os.replace(scratch + ".tmp", scratch)
            fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        def medians_of(cases: dict[str, Callable[[], object]]) -> dict[str, float]:
            names = list(cases)
            spent: dict[str, list[float]] = {name: [] for name in names}
            for round_ in range(repeat + 1):
                for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                    chill()
                    start = time.process_time()
                    cases[name]()
                    if round_:
                        spent[name].append(time.process_time() - start)
            return {name: sorted(values)[len(values) // 2] * 1e6 for name, values in spent.items()}

        medians = medians_of({"open + keys (weightstore npz)": functools.partial(_ws_open_keys, npz),
                              "open + keys (safetensors safe_open)": functools.partial(_st_open_keys, st),
                              "open + keys (weightstore .safetensors)": functools.partial(_ws_open_keys, st)})
        # HDF5 in turns of its own, h5py loaded only now, so the three above are measured as before
        ws.save(h5, weights)
        hdf5 = medians_of({"open + keys (weightstore hdf5)": functools.partial(_ws_open_keys, h5),
                           "open + keys (h5py visititems)": functools.partial(_h5py_keys, h5)})
    peer = medians["open + keys (safetensors safe_open)"]
    print(f"{tensors} tensors of {size} float32, CPU of one open, each after a durable replace, median of {repeat}")
    for name, value in medians.items():
        print(f"  {name:40s} {value:8.1f} us  {value / peer:5.2f}x safe_open")
    for name, value in hdf5.items():
        print(f"  {name:40s} {value:8.1f} us  {value / hdf5['open + keys (h5py visititems)']:5.2f}x h5py")
    medians.update(hdf5)
    return medians


def bench_per_call(tensors: int = 100, size: int = 256, calls: int = 200, *, without_fsync: bool = False) -> dict[str, float]:
    """Main-thread CPU per call of a durable save and of open + keys, against safetensors', each
    called ``calls`` times in a loop, the least of five such loops (the cases' loops taking
    turns): what one call costs this
    thread, warm, steadier than one cold call's CPU on a shared machine. ``without_fsync``: every
    ``os.fsync`` (weightstore's two, the peer's one) returns at once, which leaves the CPU beside
    them, where the kernel's fsync work (most of a small save's, and the noisiest on a loaded disk)
    cannot hide a change of a few percent. Print and return microseconds per call."""

    import weightstore as ws

    rng = np.random.default_rng(0)
    weights = {f"layer_{i // 100:04d}/w_{i % 100:02d}": rng.standard_normal(size).astype(np.float32)
               for i in range(tensors)}
    flat = {k.replace("/", "."): v for k, v in weights.items()}
    real_fsync = os.fsync
    if without_fsync:
        os.fsync = lambda fd: None
    try:
        with tempfile.TemporaryDirectory(prefix="ws-small-calls-") as folder:
            npz, st = os.path.join(folder, "w.npz"), os.path.join(folder, "w.safetensors")

            cases = {"save (weightstore npz)": lambda: ws.save(npz, weights),
                     "save (safetensors save_file + fsync)": functools.partial(_st_save_durable, flat, st),
                     "open + keys (weightstore npz)": functools.partial(_ws_open_keys, npz),
                     "open + keys (safetensors safe_open)": functools.partial(_st_open_keys, st)}
            for run in cases.values():
                for _ in range(calls // 4 + 1):
                    run()
            loops: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(5):  # the cases' loops take turns, so a drift of the load meets each alike
                for name, run in cases.items():
                    start = time.thread_time()
                    for _ in range(calls):
                        run()
                    loops[name].append((time.thread_time() - start) / calls)
            spent = {name: min(taken) * 1e6 for name, taken in loops.items()}
    finally:
        os.fsync = real_fsync
    print(f"{tensors} tensors of {size} float32, main-thread CPU per call, least of 5 loops of {calls}"
          + (", every fsync a no-op" if without_fsync else ""))
    names = list(spent)
    for own, peer in ((names[0], names[1]), (names[2], names[3])):
        print(f"  {own:40s} {spent[own]:8.1f} us  {spent[own] / spent[peer]:5.2f}x {peer} ({spent[peer]:.1f} us)")
    return spent


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.small_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=50_000)
    parser.add_argument("--size", type=int, default=256, help="float32 values per tensor")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--cpu", action="store_true",
                        help="time CPU seconds of this process (steadier on a shared machine; fsync waits do not count)")
    parser.add_argument("--per-call", action="store_true",
                        help="main-thread CPU per call in a loop, save and open + keys only (see bench_per_call)")
    parser.add_argument("--without-fsync", action="store_true", help="with --per-call: every os.fsync a no-op")
    parser.add_argument("--cold-open", action="store_true",
                        help="CPU of one open + keys, each after the same work (see bench_cold_open)")
    args = parser.parse_args()
    if args.cold_open:
        bench_cold_open(args.tensors, args.size, args.repeat)
    elif args.per_call:
        bench_per_call(args.tensors, args.size, without_fsync=args.without_fsync)
    else:
        bench(args.tensors, args.size, args.repeat, time.process_time if args.cpu else time.perf_counter)
