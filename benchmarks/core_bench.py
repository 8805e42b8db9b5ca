"""Core benchmark: weightstore npz and HDF5 against numpy, safetensors and h5py.

Builds about 1 GB of float32 weights shaped like a small transformer (an embedding matrix,
18 blocks of kernels, biases and norm scales: 255 arrays from 256 B to 100 MB) and measures,
in one run, saving and loading them with weightstore and with its peers, plus the floors:
writing the raw bytes, reading them back from the page cache, and copying them in memory.

Every case runs in its own process (so its peak memory is its own), warms up once, then
repeats; the table shows medians. A load counts only once every byte has been touched (each
array is summed; the floors sum too), so a lazy memory map cannot hide its cost. Files live
on the local disk and are in the page cache when read. ``weightstore.save`` makes every
file durable (fsync of file and folder, atomic rename); the peers do not, so each peer also
gets a ``+fsync`` row.

    python -m benchmarks.core_bench                 # 1 GB, 5 repetitions
    python -m benchmarks.core_bench --size-mb 128   # quick
    python -m benchmarks.core_bench --saves --size-mb 256   # durable saves: each format vs its peer, wall and CPU
    python -m benchmarks.core_bench --saves --busy          # the same with a CPU-bound neighbour on the other core
    python -m benchmarks.core_bench --saves --size-mb 4096 --repeat 1 --formats hdf5   # one format (and the floor)
    python -m benchmarks.core_bench --scale         # save and load cost, 64 MB to 4 GB, 100 to 100,000 tensors
    python -m benchmarks.core_bench --cold-loads --size-mb 256   # loads from the disk, each against its peer
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np

from benchmarks.common import (
    MB,
    busy_neighbour,
    emit,
    evict,
    fmt_mb,
    fmt_ratio,
    fmt_seconds,
    fsync_path,
    machine_line,
    measure,
    run_case,
    table,
    touch,
)

MODULE = "benchmarks.core_bench"
BLOCKS = 18
SCOPE = "block_07"  # one block: about 5% of the bytes


# -- the weights ----------------------------------------------------------------------------
def layout(size_mb: float) -> list[tuple[str, tuple[int, ...]]]:
    """Keys and shapes: an embedding (~10% of bytes) and 18 blocks (~5% each)."""
    total = size_mb * MB
    d = max(64, int(round(math.sqrt(total * 0.05 / 32) / 64)) * 64)  # a block holds 8*d*d floats
    vocab = max(64, int(total * 0.10 / (4 * d)))
    keys: list[tuple[str, tuple[int, ...]]] = [("embedding/embeddings", (vocab, d))]
    for b in range(BLOCKS):
        p = f"block_{b:02d}"
        keys += [
            (f"{p}/attn/qkv/kernel", (d, 3 * d)), (f"{p}/attn/qkv/bias", (3 * d,)),
            (f"{p}/attn/q_norm/scale", (64,)), (f"{p}/attn/k_norm/scale", (64,)),
            (f"{p}/attn/out/kernel", (d, d)), (f"{p}/attn/out/bias", (d,)),
            (f"{p}/ln_1/gamma", (d,)), (f"{p}/ln_1/beta", (d,)),
            (f"{p}/mlp/in/kernel", (d, 2 * d)), (f"{p}/mlp/in/bias", (2 * d,)),
            (f"{p}/mlp/out/kernel", (2 * d, d)), (f"{p}/mlp/out/bias", (d,)),
            (f"{p}/ln_2/gamma", (d,)), (f"{p}/ln_2/beta", (d,)),
        ]
    keys += [("final_ln/gamma", (d,)), ("final_ln/beta", (d,)), ("head/bias", (vocab,))]
    return keys


def prepare(folder: str, size_mb: float) -> dict:
    """Write the weights once as raw bytes plus a spec; every case process reads them back."""
    spec = [(k, list(s)) for k, s in layout(size_mb)]
    rng = np.random.default_rng(0)
    with open(os.path.join(folder, "weights.raw"), "wb") as out:
        for _key, shape in spec:
            array = rng.standard_normal(shape, dtype=np.float32)
            array *= 0.02
            out.write(array.data)
    with open(os.path.join(folder, "spec.json"), "w") as handle:
        json.dump(spec, handle)
    nbytes = sum(4 * math.prod(s) for _, s in spec)
    return {"arrays": len(spec), "bytes": nbytes,
            "scope_bytes": sum(4 * math.prod(s) for k, s in spec if k.startswith(SCOPE + "/"))}


def prepare_small(folder: str, count: int, floats: int = 256) -> dict:
    """``count`` float32 tensors of ``floats`` values, written as :func:`prepare` writes its layout."""
    spec = [(f"layer_{i // 4:05d}/w{i % 4}", [floats]) for i in range(count)]
    values = np.random.default_rng(0).standard_normal(count * floats, dtype=np.float32)
    with open(os.path.join(folder, "weights.raw"), "wb") as out:
        out.write(values.data)
    with open(os.path.join(folder, "spec.json"), "w") as handle:
        json.dump(spec, handle)
    return {"arrays": count, "bytes": values.nbytes, "scope_bytes": 0}


def read_weights(folder: str) -> dict[str, np.ndarray]:
    """The weights as separate, writable, already-touched arrays (as a trainer holds them)."""
    with open(os.path.join(folder, "spec.json")) as handle:
        spec = json.load(handle)
    weights = {}
    with open(os.path.join(folder, "weights.raw"), "rb", buffering=0) as raw:
        for key, shape in spec:
            array = np.empty(shape, dtype=np.float32)
            raw.readinto(memoryview(array).cast("B"))
            weights[key] = array
    return weights


# -- the cases ------------------------------------------------------------------------------
FILES = {  # product -> file name
    "ws-npz": "ws.npz", "ws-h5": "ws.h5", "ws-npz-c": "ws-c.npz", "ws-npz-s": "ws-s.npz", "np": "savez.npz",
    "safetensors": "st.safetensors", "h5py": "h5py.h5", "raw": "raw.bin", "ws-st": "ws.safetensors",
}


def _h5py_save(path, weights):
    import h5py

    with h5py.File(path, "w") as f:
        for key, value in weights.items():
            f.create_dataset(key, data=value)


def _raw_save(path, weights):
    with open(path, "wb") as out:
        for value in weights.values():
            out.write(value.data)


def _save_fn(case: str):
    import weightstore as ws

    product, _, durable = case.partition("+")
    if product == "ws-npz":
        return lambda p, w: ws.save(p, w)
    if product in ("ws-h5", "ws-st"):
        return lambda p, w: ws.save(p, w)
    if product == "ws-npz-c":
        return lambda p, w: ws.save(p, w, compress=True)
    if product == "ws-npz-s":
        return lambda p, w: ws.save(p, w, compress="shuffle")
    if product == "np":
        fn = lambda p, w: np.savez(p, **w)  # noqa: E731
    elif product == "safetensors":
        from safetensors.numpy import save_file

        fn = lambda p, w: save_file(w, p)  # noqa: E731
    elif product == "h5py":
        fn = _h5py_save
    elif product == "raw":
        fn = _raw_save
    else:
        raise SystemExit(f"unknown save case {case}")
    if durable:
        return lambda p, w: (fn(p, w), fsync_path(p))
    return fn


def _h5py_load(path):
    import h5py

    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, node: out.__setitem__(name, node[()]) if isinstance(node, h5py.Dataset) else None)
    return out


def _np_load(path):
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _load_fn(case: str, folder: str):
    import weightstore as ws

    path = lambda product: os.path.join(folder, FILES[product])  # noqa: E731
    if case == "ws-npz":
        return lambda: ws.load(path("ws-npz"))
    if case == "ws-npz-noverify":
        return lambda: ws.load(path("ws-npz"), verify=False)
    if case in ("ws-npz-1thread", "ws-npz-s-1thread"):  # what checksums and decoding cost on one core
        from weightstore.core import _parallel as parallel

        parallel.THREADS = 1
        return lambda: ws.load(path(case.removesuffix("-1thread")))
    if case == "ws-npz-scope":
        return lambda: ws.load(path("ws-npz"), scope=SCOPE)
    if case == "ws-h5":
        return lambda: ws.load(path("ws-h5"))
    if case == "ws-h5-scope":
        return lambda: ws.load(path("ws-h5"), scope=SCOPE)
    if case == "ws-npz-c":
        return lambda: ws.load(path("ws-npz-c"))
    if case == "ws-st":
        return lambda: ws.load(path("ws-st"))
    if case == "ws-npz-s":
        return lambda: ws.load(path("ws-npz-s"))
    if case == "np":
        return lambda: _np_load(path("np"))
    if case == "safetensors":
        from safetensors.numpy import load_file

        return lambda: load_file(path("safetensors"))
    if case == "h5py":
        return lambda: _h5py_load(path("h5py"))
    raise SystemExit(f"unknown load case {case}")


def case_main(args) -> None:
    folder, kind, case = args.dir, *args.case.split(":", 1)
    cold = (lambda: evict([folder])) if args.cold else None  # loads and the read floor: from the disk
    if kind == "save":
        weights = read_weights(folder)
        target = os.path.join(folder, FILES[case.partition("+")[0]])
        save = _save_fn(case)
        # Each timed save starts with the page cache holding neither the raw weights nor the last
        # save's file: at 4 GB the save that first made the kernel reclaim that much cache took
        # 10-13 s of system time, whichever library it was (np.savez's second save: 12.7 s, its
        # third 4.1 s), so the order of cases, not the format, decided the figures.
        settle = lambda: evict([p for p in (os.path.join(folder, "weights.raw"), target) if os.path.exists(p)])  # noqa: E731
        result = measure(lambda: save(target, weights), repeat=args.repeat, before=settle)
        result["file_bytes"] = os.path.getsize(target)
    elif kind == "load":
        load = _load_fn(case, folder)
        result = measure(lambda: (lambda d: (touch(d), d))(load()), repeat=args.repeat, before=cold)
    elif kind == "open":
        import weightstore as ws

        path = os.path.join(folder, FILES[case])

        def listing():
            with ws.open(path) as store:
                return [store.info(k) for k in store]

        result = measure(listing, repeat=max(20, args.repeat), warmup=3)
    elif kind == "compress":
        result = compression_case(folder, case, args.repeat)
    elif kind == "floor":
        weights = read_weights(folder)  # warm destination (read floor) or source (copy floor)
        if case == "read":
            path = os.path.join(folder, FILES["raw"])
            views = list(weights.values())

            def read():
                with open(path, "rb", buffering=0) as raw:
                    for view in views:
                        raw.readinto(view.data.cast("B"))
                touch(views)

            result = measure(read, repeat=args.repeat, before=cold)
        elif case == "copy":
            targets = [np.ones_like(v) for v in weights.values()]
            pairs = list(zip(targets, weights.values(), strict=True))

            def copy():
                for dst, src in pairs:
                    np.copyto(dst, src)
                touch(targets)

            result = measure(copy, repeat=args.repeat)
        else:
            raise SystemExit(f"unknown floor {case}")
    else:
        raise SystemExit(f"unknown case kind {kind}")
    emit(result)


# -- compression on trained-like weights -------------------------------------------------------
COMPRESS_MB = 256  # the compression rows build their own weights: at most this many MB of float32
COMPRESS_OPTIONS = {"npz-deflate": (".npz", True), "npz-shuffle": (".npz", "shuffle"),
                    "h5-gzip-shuffle": (".h5", True)}


def trained_like(folder: str) -> dict[str, np.ndarray]:
    """The layout's float32 weights as training leaves them, not as initialised: normal(0, 0.05)
    moved by three SGD-like steps (random compresses far worse than trained, constant far better)."""
    with open(os.path.join(folder, "spec.json")) as handle:
        spec = json.load(handle)
    scale = min(1.0, COMPRESS_MB * MB / sum(4 * math.prod(s) for _, s in spec))
    rng = np.random.default_rng(1)
    weights = {}
    for key, shape in spec:
        shape = [max(1, int(shape[0] * scale))] + list(shape[1:])
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)
        for _ in range(3):
            w -= np.float32(0.01) * rng.standard_normal(shape, dtype=np.float32) * np.abs(w)
        weights[key] = w
    return weights


def compression_case(folder: str, case: str, repeat: int) -> dict:
    """``option:dtype``: size ratio against the raw bytes, and load (every byte touched) speed."""
    import ml_dtypes

    import weightstore as ws

    option, dtype_name = case.split(":")
    suffix, compress = COMPRESS_OPTIONS[option]
    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float32
    weights = {k: v.astype(dtype) for k, v in trained_like(folder).items()}
    nbytes = sum(v.nbytes for v in weights.values())
    path = os.path.join(folder, f"compress{suffix}")
    started = time.perf_counter()
    ws.save(path, weights, compress=compress)
    saved = time.perf_counter() - started
    file_bytes = os.path.getsize(path)
    del weights

    def load() -> dict[str, np.ndarray]:
        loaded = ws.load(path)
        touch([v.view(f"u{v.dtype.itemsize}") for v in loaded.values()])  # bfloat16's own sum is 10x slower
        return loaded

    result = measure(load, repeat=repeat)
    cpu = time.process_time()  # all threads: what decoding costs, whatever else shares the machine
    load()
    cpu = time.process_time() - cpu
    os.unlink(path)
    return result | {"bytes": nbytes, "file_bytes": file_bytes, "save": saved, "cpu": cpu}


# -- durable saves, each format against its own peer ---------------------------------
DURABLE = [("ws-npz", "np+fsync"), ("ws-st", "safetensors+fsync"), ("ws-h5", "h5py+fsync")]
#: ``--formats`` names -> the pair of :data:`DURABLE` each stands for
DURABLE_FORMATS = {"npz": DURABLE[0], "safetensors": DURABLE[1], "hdf5": DURABLE[2]}
DURABLE_LABELS = {"ws-npz": "weightstore npz", "np+fsync": "np.savez + fsync", "ws-st": "weightstore safetensors",
                  "safetensors+fsync": "safetensors save_file + fsync", "ws-h5": "weightstore HDF5",
                  "h5py+fsync": "h5py + fsync", "raw+fsync": "floor: raw write + fsync"}


def _in_turns(cases: list[str], rounds: int, args: list[str],
              after: Callable[[str], object] | None = None, what: str = "times") -> dict[str, float]:
    """Each case in a process of its own, the cases taking turns for ``rounds`` rounds (load from
    other work falls on all alike); ``after(case)`` runs after each. The median of every timed
    run of a case (``what="cpus"``: its CPU seconds), by its name without the kind
    (``save:ws-npz`` -> ``ws-npz``)."""
    return _medians_in_turns(cases, rounds, args, after)[what]


def _medians_in_turns(cases: list[str], rounds: int, args: list[str],
                      after: Callable[[str], object] | None = None) -> dict[str, dict[str, float]]:
    """:func:`_in_turns`' medians of wall seconds (``times``) and CPU seconds (``cpus``) alike."""
    runs: dict[str, dict[str, list[float]]] = {"times": {c: [] for c in cases}, "cpus": {c: [] for c in cases}}
    for _ in range(rounds):
        for case in cases:
            result = run_case(MODULE, case, args)
            for what in runs:
                runs[what][case] += result.get(what, [])
            if after is not None:
                after(case)
    return {what: {c.partition(":")[2]: statistics.median(v) if v else float("nan") for c, v in by_case.items()}
            for what, by_case in runs.items()}


def save_bench(size_mb: float, repeat: int, rounds: int = 3, out=sys.stdout, busy: bool = False,
               formats: tuple[str, ...] = tuple(DURABLE_FORMATS)) -> dict:
    """Every format's durable save (of ``formats``) against its own peer's and the raw
    write+fsync floor: one process per case, the cases taking turns for ``rounds`` rounds (load
    from others falls on all alike), medians over every timed run of a case, wall and CPU
    seconds. ``busy``: with a CPU-bound neighbour on the other core
    (:func:`~benchmarks.common.busy_neighbour`). At 4 GB a round of all three takes minutes;
    one format's pair and the floor take a third of that."""
    pairs = [DURABLE_FORMATS[name] for name in formats]
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    folder = tempfile.mkdtemp(prefix="ws-saves-", dir=os.environ.get("WS_BENCH_DIR"))
    try:
        facts = prepare(folder, size_mb)
        say(f"Durable saves of {facts['bytes'] / MB:,.0f} MB ({facts['arrays']} float32 arrays){', busy' if busy else ''}: "
            f"{rounds} rounds of one process per case, {repeat} saves each, medians; {machine_line()}")
        cases = [f"save:{c}" for pair in pairs for c in pair] + ["save:raw+fsync"]
        with busy_neighbour(busy):
            both = _medians_in_turns(cases, rounds, ["--dir", folder, "--repeat", str(repeat)],  # one large file
                                     after=lambda case: os.unlink(os.path.join(folder, FILES[case[5:].partition("+")[0]])))
        m, cpu = both["times"], both["cpus"]
        floor, gb = m["raw+fsync"], facts["bytes"] / (1 << 30)
        rows, checks = [], []
        for own, peer in pairs:
            for name in (own, peer):
                rows.append([DURABLE_LABELS[name], fmt_seconds(m[name]), fmt_ratio(m[name] / m[peer]),
                             fmt_ratio(m[name] / floor), f"{facts['bytes'] / MB / m[name]:,.0f}",
                             f"{cpu[name] / gb:.2f}", fmt_ratio(cpu[name] / cpu[peer])])
            checks += [(f"{DURABLE_LABELS[own]} wall <= {1.3 if busy else 1.1}x {DURABLE_LABELS[peer]}",
                        m[own] <= (1.3 if busy else 1.1) * m[peer], f"{m[own] / m[peer]:.2f}x"),
                       (f"{DURABLE_LABELS[own]} CPU <= 1.3x {DURABLE_LABELS[peer]}", cpu[own] <= 1.3 * cpu[peer],
                        f"{cpu[own] / cpu[peer]:.2f}x"),
                       (f"{DURABLE_LABELS[own]} <= 1.2x raw write + fsync", m[own] <= 1.2 * floor,
                        f"{m[own] / floor:.2f}x")]
        rows.append([DURABLE_LABELS["raw+fsync"], fmt_seconds(floor), "-", "1.00x",
                     f"{facts['bytes'] / MB / floor:,.0f}", f"{cpu['raw+fsync'] / gb:.2f}", "-"])
        say(table(["durable save", "median s", "x its peer", "x floor", "MB/s", "CPU s/GB", "CPU x peer"], rows))
        say("")
        say("Targets")
        say(table(["target", "holds", "measured"], [[c, "yes" if ok else "NO", v] for c, ok, v in checks]))
        return {"facts": facts, "medians": m, "cpu": cpu}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- scale: cost against bytes and against tensor count ------------------------------
SCALE_SIZES_MB = (64, 256, 1024, 4096)
SCALE_COUNTS = (100, 1_000, 10_000, 100_000)
SCALE_CASES = {"save:ws-npz": "durable npz save", "load:ws-npz": "verified npz load + sum",
               "save:raw+fsync": "raw write + fsync"}


def scale_bench(sizes_mb: tuple[float, ...], counts: tuple[int, ...], repeat: int, out=sys.stdout) -> dict:
    """Each case at every size of the transformer layout, then at every count of 1 KB tensors,
    one fresh process per case and point, medians of ``repeat``. A row's growth is how much the
    cost grew from the row above divided by how much the work grew: 1.00x is linear."""
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    say(f"Scale: {', '.join(SCALE_CASES.values())}; one process per case and point, {repeat} runs each, "
        f"medians; {machine_line()}")
    results: dict[str, dict] = {}
    for axis, points, build, unit in (("bytes", sizes_mb, prepare, " MB"), ("tensors", counts, prepare_small, "")):
        rows, above = [], None
        for point in points:
            folder = tempfile.mkdtemp(prefix="ws-scale-", dir=os.environ.get("WS_BENCH_DIR"))
            try:
                facts = build(folder, point)
                m = {case: run_case(MODULE, case, ["--dir", folder, "--repeat", str(repeat)])["median"]
                     for case in SCALE_CASES}
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            work = facts["bytes"] if axis == "bytes" else facts["arrays"]
            grown = ["-" if above is None else fmt_ratio((m[case] / above[1][case]) / (work / above[0]))
                     for case in SCALE_CASES]
            rows.append([f"{point:,g}{unit}", f"{facts['arrays']:,}", f"{facts['bytes'] / MB:,.1f}",
                         *(x for case, g in zip(SCALE_CASES, grown, strict=True) for x in (fmt_seconds(m[case]), g))])
            say(f"  {axis} {point:,g}: " + ", ".join(f"{c} {fmt_seconds(v)} s" for c, v in m.items()))
            above = (work, m)
            results[f"{axis}:{point}"] = {"facts": facts, "medians": m}
        say("")
        say(table(["model" if axis == "bytes" else "tensors of 1 KB", "tensors", "MB", *(x for label in SCALE_CASES.values() for x in (f"{label} s", "growth"))],
                  rows))
        say("")
    return results


# -- cold loads: every format from the disk, against its peer and a plain read ---------
COLD_LOADS = [("ws-npz", "np"), ("ws-st", "safetensors"), ("ws-h5", "h5py")]
COLD_LABELS = {"ws-npz": "weightstore npz", "np": "np.load", "ws-st": "weightstore safetensors",
               "safetensors": "safetensors load_file", "ws-h5": "weightstore HDF5", "h5py": "h5py",
               "read": "floor: plain sequential read"}


def cold_load_bench(size_mb: float, repeat: int, rounds: int = 3, out=sys.stdout) -> dict:
    """Each format's verified load (every byte touched) with its files evicted from the page
    cache before every timed run, against its own library's load and a plain sequential read of
    the same bytes: one process per case, the cases in turn for ``rounds``, medians."""
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    folder = tempfile.mkdtemp(prefix="ws-cold-", dir=os.environ.get("WS_BENCH_DIR"))
    try:
        facts = prepare(folder, size_mb)
        say(f"Cold loads of {facts['bytes'] / MB:,.0f} MB ({facts['arrays']} float32 arrays): {rounds} rounds of one "
            f"process per case, {repeat} loads each, medians; {machine_line()}")
        for product in ("raw", *(p for pair in COLD_LOADS for p in pair)):
            run_case(MODULE, f"save:{product}", ["--dir", folder, "--repeat", "1"])
        cases = ["floor:read", *(f"load:{p}" for pair in COLD_LOADS for p in pair)]
        m = _in_turns(cases, rounds, ["--dir", folder, "--repeat", str(repeat), "--cold"])
        floor = m["read"]
        rows = [[COLD_LABELS[name], fmt_seconds(m[name]), fmt_ratio(m[name] / m[peer]), fmt_ratio(m[name] / floor)]
                for own, peer in COLD_LOADS for name in (own, peer)]
        rows.append([COLD_LABELS["read"], fmt_seconds(floor), "-", "1.00x"])
        say(table(["cold load", "median s", "x its peer", "x plain read"], rows))
        say("")
        say("Targets")
        say(table(["target", "holds", "measured"],
                  [[f"{COLD_LABELS[own]} <= 1.0x {COLD_LABELS[peer]}", "yes" if m[own] <= m[peer] else "NO",
                    f"{m[own] / m[peer]:.2f}x"] for own, peer in COLD_LOADS]
                  + [[f"{COLD_LABELS[own]} <= 1.2x plain read", "yes" if m[own] <= 1.2 * floor else "NO",
                      f"{m[own] / floor:.2f}x"] for own, _ in COLD_LOADS]))
        return {"facts": facts, "medians": m}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the run --------------------------------------------------------------------------------
SAVE_PEERS = ["np", "safetensors", "h5py"]
LOAD_PEERS = ["np", "safetensors", "h5py"]


def bench(size_mb: float, repeat: int, folder: str | None = None, keep: bool = False,
          out=sys.stdout) -> dict:
    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="ws-bench-", dir=os.environ.get("WS_BENCH_DIR"))
    os.makedirs(folder, exist_ok=True)
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    args = ["--dir", folder, "--repeat", str(repeat)]
    started = time.perf_counter()
    try:
        facts = prepare(folder, size_mb)
        say(f"core benchmark: {facts['arrays']} float32 arrays, {facts['bytes'] / MB:,.0f} MB; "
            f"{repeat} runs per case, medians; {machine_line()}")
        r: dict[str, dict] = {}

        def case(name):
            r[name] = run_case(MODULE, name, args)
            say(f"  {name:28s} {fmt_seconds(r[name]['median'])} s")

        # write each product, read it back, delete it: at most two large files exist at once
        case("save:raw")
        case("floor:read")
        case("floor:copy")
        case("save:raw+fsync")
        for product, loads in [
            ("ws-npz", ["ws-npz", "ws-npz-noverify", "ws-npz-1thread", "ws-npz-scope", "open:ws-npz"]),
            ("ws-h5", ["ws-h5", "ws-h5-scope", "open:ws-h5"]),
            ("ws-npz-c", ["ws-npz-c"]),
            ("ws-npz-s", ["ws-npz-s", "ws-npz-s-1thread"]),
            ("np", ["np"]),
            ("safetensors", ["safetensors"]),
            ("h5py", ["h5py"]),
        ]:
            if not product.startswith("ws-"):
                case(f"save:{product}+fsync")
            case(f"save:{product}")
            for name in loads:
                case(name if ":" in name else f"load:{name}")
            os.unlink(os.path.join(folder, FILES[product]))
        os.unlink(os.path.join(folder, FILES["raw"]))
        for option in COMPRESS_OPTIONS:
            for dtype in ("float32", "bfloat16"):
                case(f"compress:{option}:{dtype}")
        report(r, facts, size_mb, repeat, say)
        say(f"(whole run {time.perf_counter() - started:.0f} s)")
        return {"results": r, "facts": facts}
    finally:
        if own and not keep:
            shutil.rmtree(folder, ignore_errors=True)


def report(r: dict, facts: dict, size_mb: float, repeat: int, say) -> None:
    loaded = facts["bytes"]
    m = lambda name: r[name]["median"]  # noqa: E731
    save_peer = min(m(f"save:{p}") for p in SAVE_PEERS)
    save_peer_sync = min(m(f"save:{p}+fsync") for p in SAVE_PEERS)
    load_peer = min(m(f"load:{p}") for p in LOAD_PEERS)
    write_floor, write_floor_sync = m("save:raw"), m("save:raw+fsync")
    read_floor = m("floor:read")

    names = {
        "ws-npz": "weightstore npz", "ws-h5": "weightstore HDF5", "ws-npz-c": "weightstore npz compress=True",
        "ws-npz-s": "weightstore npz compress=\"shuffle\"",
        "np": "np.savez / np.load", "safetensors": "safetensors.numpy", "h5py": "h5py",
        "raw": "floor: raw write", "ws-npz-noverify": "weightstore npz verify=False",
        "ws-npz-1thread": "weightstore npz, checksums on one thread",
        "ws-npz-s-1thread": "weightstore npz compress=\"shuffle\", decoded on one thread",
    }
    rows = []
    for product, durable in [("ws-npz", True), ("ws-h5", True), ("ws-npz-c", True), ("ws-npz-s", True),
                             ("np", False), ("np", True), ("safetensors", False), ("safetensors", True),
                             ("h5py", False), ("h5py", True), ("raw", False), ("raw", True)]:
        key = f"save:{product}" + ("+fsync" if durable and not product.startswith("ws") else "")
        res = r[key]
        label = names[product] + (" (fsync)" if product.startswith("ws") else " + fsync" if durable else "")
        floor = write_floor_sync if durable else write_floor
        rows.append([label, fmt_seconds(res["median"]), fmt_ratio(res["median"] / save_peer),
                     fmt_ratio(res["median"] / save_peer_sync), fmt_ratio(res["median"] / floor),
                     fmt_mb(res["peak"]), fmt_mb(res["file_bytes"])])
    say("")
    say(f"Save {loaded / MB:,.0f} MB in {facts['arrays']} arrays (page cache; fsync = durable on disk)")
    say(table(["save", "median s", "x fastest peer", "x fastest peer+fsync", "x raw write floor",
               "peak MB over weights", "file MB"], rows))

    rows = []
    for name in ["ws-npz", "ws-npz-noverify", "ws-npz-1thread", "ws-h5", "ws-npz-c", "ws-npz-s", "ws-npz-s-1thread",
                 "np", "safetensors", "h5py"]:
        res = r[f"load:{name}"]
        rows.append([names[name], fmt_seconds(res["median"]), fmt_ratio(res["median"] / load_peer),
                     fmt_ratio(res["median"] / read_floor), fmt_mb(res["peak"]),
                     fmt_ratio(res["peak"] / loaded)])
    for name, label in [("floor:read", "floor: page-cache read"), ("floor:copy", "floor: in-memory copy")]:
        res = r[name]
        rows.append([label, fmt_seconds(res["median"]), fmt_ratio(res["median"] / load_peer),
                     fmt_ratio(res["median"] / read_floor), "-", "-"])
    say("")
    say(f"Load {loaded / MB:,.0f} MB (page cache warm; every array summed; checksums verified unless noted)")
    say(table(["load", "median s", "x fastest peer", "x read floor", "peak MB", "peak / loaded"], rows))

    scope_frac = facts["scope_bytes"] / loaded
    rows = []
    for fmt, label in [("ws-npz", "npz"), ("ws-h5", "HDF5")]:
        full, part, opened = m(f"load:{fmt}"), m(f"load:{fmt}-scope"), m(f"open:{fmt}")
        rows.append([f"weightstore {label}", f"{opened * 1000:.1f}", fmt_seconds(part),
                     f"{100 * part / full:.1f}%", fmt_mb(r[f"load:{fmt}-scope"]["peak"])])
    say("")
    say(f"Open + list all {facts['arrays']} tensors; load scope {SCOPE!r} "
        f"({100 * scope_frac:.1f}% of bytes, {facts['scope_bytes'] / MB:,.0f} MB)")
    say(table(["file", "open+list ms", "scope load s", "of full load", "peak MB"], rows))

    rows = []
    compressed = {}
    for option in COMPRESS_OPTIONS:
        for dtype in ("float32", "bfloat16"):
            res = r[f"compress:{option}:{dtype}"]
            ratio, speed = res["bytes"] / res["file_bytes"], res["bytes"] / res["median"] / 1e9
            compressed[option, dtype] = ratio, speed
            rows.append([option, dtype, fmt_mb(res["bytes"]), f"{ratio:.3f}", fmt_seconds(res["save"]),
                         fmt_seconds(res["median"]), f"{speed:.2f}", f"{res['cpu'] / res['bytes'] * 1e9:.2f}"])
    say("")
    say("Compression of trained-like weights (normal(0, 0.05) after three SGD-like steps; load = every byte summed)")
    say(table(["option", "dtype", "MB", "ratio", "save s", "load s", "load GB/s", "load CPU s/GB"], rows))

    ws_save, ws_load = m("save:ws-npz"), m("load:ws-npz")
    unverified = m("load:ws-npz-noverify")
    st_load = m("load:safetensors")
    checks = [
        ("save npz (fsync) <= fastest peer save (no fsync)", ws_save <= save_peer, f"{ws_save:.3f} vs {save_peer:.3f} s"),
        ("save npz (fsync) <= fastest peer save + fsync", ws_save <= save_peer_sync, f"{ws_save:.3f} vs {save_peer_sync:.3f} s"),
        ("save HDF5 (fsync) <= fastest peer save + fsync", m("save:ws-h5") <= save_peer_sync,
         f"{m('save:ws-h5'):.3f} vs {save_peer_sync:.3f} s"),
        ("load npz verified <= safetensors load_file", ws_load <= st_load, f"{ws_load:.3f} vs {st_load:.3f} s"),
        ("load npz verified <= 2x page-cache read floor", ws_load <= 2 * read_floor,
         f"{ws_load / read_floor:.2f}x"),
        ("load HDF5 verified <= safetensors load_file", m("load:ws-h5") <= st_load,
         f"{m('load:ws-h5'):.3f} vs {st_load:.3f} s"),
        ("load npz verified <= 1.3x verify=False", ws_load <= 1.3 * unverified, f"{ws_load / unverified:.2f}x"),
        ("npz shuffle ratio >= 1.17 float32, 1.40 bfloat16",
         compressed["npz-shuffle", "float32"][0] >= 1.17 and compressed["npz-shuffle", "bfloat16"][0] >= 1.40,
         f"{compressed['npz-shuffle', 'float32'][0]:.3f} / {compressed['npz-shuffle', 'bfloat16'][0]:.3f}"),
        ("npz shuffle loads >= 1.5 GB/s (float32)", compressed["npz-shuffle", "float32"][1] >= 1.5,
         f"{compressed['npz-shuffle', 'float32'][1]:.2f} GB/s"),
        ("open + list 1 GB npz < 50 ms", m("open:ws-npz") < 0.05, f"{m('open:ws-npz') * 1000:.1f} ms"),
        ("open + list 1 GB HDF5 < 50 ms", m("open:ws-h5") < 0.05, f"{m('open:ws-h5') * 1000:.1f} ms"),
        ("load 5% by scope <= 10% of full load (npz)", m("load:ws-npz-scope") <= 0.1 * ws_load,
         f"{100 * m('load:ws-npz-scope') / ws_load:.1f}%"),
        ("load 5% by scope <= 10% of full load (HDF5)", m("load:ws-h5-scope") <= 0.1 * m("load:ws-h5"),
         f"{100 * m('load:ws-h5-scope') / m('load:ws-h5'):.1f}%"),
    ]
    for name in ["ws-npz", "ws-h5", "ws-npz-c", "ws-npz-s"]:
        peak = r[f"load:{name}"]["peak"]
        checks.append((f"peak memory of {names[name]} load <= loaded bytes + 10%", peak <= 1.1 * loaded,
                       f"{peak / loaded:.2f}x"))
    say("")
    say("Targets (issues 2 and 11)")
    say(table(["target", "holds", "measured"], [[c, "yes" if ok else "NO", v] for c, ok, v in checks]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.core_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="bytes of weights to build (default 1024)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--dir", help="folder for the files (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the folder")
    parser.add_argument("--saves", action="store_true", help="only the durable saves, each format against its peer")
    parser.add_argument("--busy", action="store_true", help="--saves: with a CPU-bound neighbour on the other core")
    parser.add_argument("--formats", default=",".join(DURABLE_FORMATS),
                        help="--saves: the formats, comma-separated (default npz,safetensors,hdf5)")
    parser.add_argument("--rounds", type=int, default=3, help="--saves, --cold-loads: rounds of one process per case (default 3)")
    parser.add_argument("--scale", action="store_true",
                        help="only the scale rows: npz save and load from 64 MB to 4 GB and 100 to 100,000 tensors")
    parser.add_argument("--sizes-mb", default=",".join(map(str, SCALE_SIZES_MB)),
                        help="--scale: the sizes, comma-separated (default 64,256,1024,4096)")
    parser.add_argument("--counts", default=",".join(map(str, SCALE_COUNTS)),
                        help="--scale: the tensor counts, comma-separated (default 100,1000,10000,100000)")
    parser.add_argument("--cold-loads", action="store_true",
                        help="only cold loads: each format from the disk against its peer and a plain read")
    parser.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        case_main(args)
    elif args.cold_loads:
        cold_load_bench(args.size_mb, args.repeat, args.rounds)
    elif args.scale:
        scale_bench(tuple(float(x) for x in args.sizes_mb.split(",")), tuple(int(x) for x in args.counts.split(",")),
                    args.repeat)
    elif args.saves:
        unknown = set(args.formats.split(",")) - DURABLE_FORMATS.keys()
        if unknown:
            parser.error(f"--formats: no format {', '.join(sorted(unknown))}; choose from {', '.join(DURABLE_FORMATS)}")
        save_bench(args.size_mb, args.repeat, args.rounds, busy=args.busy, formats=tuple(args.formats.split(",")))
    else:
        bench(args.size_mb, args.repeat, args.dir, args.keep)


if __name__ == "__main__":
    main()
