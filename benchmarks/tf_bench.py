"""TensorFlow benchmark: weightstore's adapters against TensorFlow's own checkpoints.

About 1 GB of float32 variables (the same 255 arrays, 256 B to 100 MB, as the core
benchmark) is saved and restored, in one run, through

- weightstore: ``tf2.export`` + ``ws.save`` and ``tf2.assign(variables, path)`` on eager
  ``tf.Variable``s (and on a Keras model), ``tf1.export`` + ``ws.save`` and
  ``tf1.assign(sess, path)`` on a ``tf.compat.v1`` graph;
- ``tf.train.Checkpoint`` write/read, ``tf.compat.v1.train.Saver`` save/restore, Keras 3
  ``save_weights``/``load_weights``, and ``safetensors.numpy`` with ``var.assign``;
- floors: assigning the same arrays from memory (eager ``var.assign``; TF1 feeding every
  initializer input in one ``session.run``), and reading every variable into numpy plus a raw
  write of the bytes.

Every case runs in its own process that first builds the variables (its memory baseline),
then warms up once and repeats. ``ws.save`` fsyncs; each peer also gets a ``+fsync`` row.

Then "hold the model once", each against its peer in the same run (two alternated
processes each, the better median kept), with the extra anonymous memory (``RssAnon``, sampled
every millisecond during one more run; file-backed pages of a mapped file are the page
cache's, not a copy of the model): ``tf2.assign`` against ``Checkpoint.read`` at 4 GB (halved
until three copies fit in the free memory), ``tf1.assign`` against ``Saver.restore`` at 1 GB,
50,000 tensors of 256 floats through ``tf2.assign`` against ``safetensors.numpy.load_file`` + ``var.assign``,
and (row ``small-tf1``, not run by default: TF1 builds a 50,000-op executor for minutes) through
``tf1.assign`` against ``Saver.restore``. Each case times its first call apart (TF builds kernels and
executors then) and then the repeated ones, which a follower re-assigning a model sees.

    python -m benchmarks.tf_bench                 # 1 GB, 5 repetitions, then the hold rows
    python -m benchmarks.tf_bench --size-mb 128 --hold-mb 256 --tf1-mb 128 --small 5000  # quick
    python -m benchmarks.tf_bench --only-hold --hold-rows tf2   # one hold row
    python -m benchmarks.tf_bench --only-hold     # only the hold rows
    python -m benchmarks.tf_bench --restore --cold --size-mb 256   # npz/safetensors vs TF, page cache evicted
    python -m benchmarks.tf_bench --restore --cold --pairs tf1 --tf1-init initializers --size-mb 256
    python -m benchmarks.tf_bench --only-hold --hold-rows small --small 50000 --repeat 3   # small tensors
    python -m benchmarks.tf_bench --export-memory --size-mb 256   # tf2.export / snapshot memory
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import (
    MB,
    anon_during,
    emit,
    evict,
    fmt_mb,
    fmt_ratio,
    fmt_seconds,
    fsync_tree,
    machine_line,
    measure,
    median,
    run_case,
    table,
)
from benchmarks.core_bench import SCOPE, prepare, prepare_small, read_weights

MODULE = "benchmarks.tf_bench"
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3"}

# product -> (file or folder name, what it is)
PRODUCTS = {
    "ws-tf2": ("ws-tf2.npz", "weightstore tf2 (tf.Variable dict)"),
    "ws-keras": ("ws-keras.npz", "weightstore tf2 (Keras model)"),
    "ws-tf1": ("ws-tf1.npz", "weightstore tf1 (graph, session)"),
    "ws-tf2-st": ("ws-tf2.safetensors", "weightstore tf2, safetensors file"),
    "ws-tf1-st": ("ws-tf1.safetensors", "weightstore tf1, safetensors file"),
    "tf2-ckpt": ("tf2-ckpt/ckpt", "tf.train.Checkpoint write/read"),
    "tf1-saver": ("tf1-saver/model", "tf.compat.v1.train.Saver"),
    "keras": ("keras.weights.h5", "Keras save_weights/load_weights"),
    "safetensors": ("st.safetensors", "safetensors.numpy + var.assign"),
}


# -- models ---------------------------------------------------------------------------------
def _spec(folder):
    import json

    with open(os.path.join(folder, "spec.json")) as handle:
        return [(k, tuple(s)) for k, s in json.load(handle)]


def _arrays(folder):
    """The weights one new array at a time, so building variables never holds the model twice."""
    with open(os.path.join(folder, "weights.raw"), "rb", buffering=0) as raw:
        for key, shape in _spec(folder):
            array = np.empty(shape, np.float32)
            raw.readinto(memoryview(array).cast("B"))
            yield key, array


def build_tf2(folder):
    """A ``tf.Module`` holding a dict of eager variables filled with the benchmark's weights."""
    import tensorflow as tf

    module = tf.Module(name="model")
    module.vars = {key: tf.Variable(value, name=key) for key, value in _arrays(folder)}
    return module


def build_keras(folder):
    import keras

    spec = _spec(folder)

    class Bag(keras.Model):
        def __init__(self):
            super().__init__(name="bag")
            self.held = [self.add_weight(shape=shape, name=key.replace("/", "__"), initializer="zeros")
                         for key, shape in spec]
            self.built = True

        def call(self, x):
            return x

    model = Bag()
    weights = read_weights(folder)
    for var, value in zip(model.held, weights.values(), strict=True):
        var.assign(value)
    del weights
    return model


def build_tf1(folder, init="fed"):
    """A graph with one resource variable per key. ``init`` "fed": each filled by feeding the
    file's values (TF keeps a fed array that happens to be aligned as the variable's buffer:
    numpy's memory, which the C heap keeps once the first assign frees it; the worst case);
    "initializers": set by random initializers the session runs (TF's memory, as a training or
    serving graph starts)."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        variables = {}
        initializer = tf.compat.v1.zeros_initializer() if init == "fed" else tf.compat.v1.random_normal_initializer()
        for key, shape in _spec(folder):
            variables[key] = tf.compat.v1.get_variable(key, shape, tf.float32, initializer)
        saver = tf.compat.v1.train.Saver(variables, write_version=tf.compat.v1.train.SaverDef.V2)
        scoped = {k: v for k, v in variables.items() if k.startswith(SCOPE + "/")}
        scoped_saver = tf.compat.v1.train.Saver(scoped) if scoped else None  # the small layout has no scope
        run_initializers = tf.compat.v1.global_variables_initializer()
    sess = tf.compat.v1.Session(graph=graph)
    if init == "fed":
        for key, value in _arrays(folder):
            variable = variables[key]
            sess.run(variable.initializer, feed_dict={variable.initializer.inputs[1]: value})
    else:
        sess.run(run_initializers)
    graph.finalize()
    return sess, variables, saver, scoped_saver


# -- cases ----------------------------------------------------------------------------------
def case_main(args) -> None:
    import tensorflow as tf

    import weightstore as ws
    from weightstore.adapters import tf1, tf2

    folder = args.dir
    kind, product = args.case.split(":", 1)
    if kind == "exportmem":
        emit(_export_memory(folder, product))
        return
    product, _, durable = product.partition("+")
    scoped = product.endswith("-scope")
    product = product.removesuffix("-scope")
    target = os.path.join(folder, PRODUCTS[product][0]) if product in PRODUCTS else None
    product = product.removesuffix("-st")  # the same code, another file format
    if target and kind == "save":
        os.makedirs(os.path.dirname(target), exist_ok=True)

    def durably(fn):
        if not durable:
            return fn
        return lambda: (fn(), fsync_tree(os.path.dirname(target) if "/" in PRODUCTS[product][0] else target))

    run = None
    if product in ("ws-tf2", "tf2-ckpt", "safetensors", "tf2-floor"):
        module = build_tf2(folder)
        variables = module.vars
        if product == "ws-tf2":
            if kind == "save":
                run = lambda: ws.save(target, tf2.export(variables))  # noqa: E731
            else:
                run = lambda: tf2.assign(variables, target, include=SCOPE if scoped else None)  # noqa: E731
        elif product == "tf2-ckpt":
            checkpoint = tf.train.Checkpoint(model=module)
            if kind == "save":
                run = durably(lambda: checkpoint.write(target))
            else:
                run = lambda: checkpoint.read(target).assert_consumed()  # noqa: E731
        elif product == "safetensors":
            from safetensors.numpy import load_file, save_file
            if kind == "save":
                run = durably(lambda: save_file({k: v.numpy() for k, v in variables.items()}, target))
            elif scoped:
                from safetensors import safe_open

                def run():
                    with safe_open(target, "np") as f:
                        for key in f.keys():  # noqa: SIM118 - a safe_open handle is no mapping
                            if key.startswith(SCOPE + "/"):
                                variables[key].assign(f.get_tensor(key), read_value=False)
            else:
                def run():
                    for key, value in load_file(target).items():
                        variables[key].assign(value, read_value=False)
        elif product == "tf2-floor":
            if kind == "assign":
                arrays = read_weights(folder)

                def run():
                    for key, value in arrays.items():
                        variables[key].assign(value, read_value=False)
            else:  # export: every variable into numpy, then a raw write (+fsync) of the bytes
                raw = os.path.join(folder, "floor.raw")

                def run():
                    with open(raw, "wb") as out:
                        for var in variables.values():
                            out.write(var.numpy().data)
                    if durable:
                        fsync_tree(raw)
    elif product in ("ws-keras", "keras"):
        model = build_keras(folder)
        if product == "ws-keras":
            run = (lambda: ws.save(target, tf2.export(model))) if kind == "save" else lambda: tf2.assign(model, target)
        elif kind == "save":
            run = durably(lambda: model.save_weights(target))
        else:
            run = lambda: model.load_weights(target)  # noqa: E731
    elif product in ("ws-tf1", "tf1-saver", "tf1-floor"):
        sess, variables, saver, scoped_saver = build_tf1(folder, args.tf1_init)
        if product == "ws-tf1":
            if kind == "save":
                run = lambda: ws.save(target, tf1.export(sess))  # noqa: E731
            else:
                run = lambda: tf1.assign(sess, target, include=SCOPE if scoped else None)  # noqa: E731
        elif product == "tf1-saver":
            def in_graph(fn):
                def wrapped():
                    with sess.graph.as_default():
                        return fn()
                return wrapped

            if kind == "save":
                run = durably(in_graph(lambda: saver.save(sess, target, write_meta_graph=False, write_state=False)))
            else:
                chosen = scoped_saver if scoped else saver
                run = in_graph(lambda: chosen.restore(sess, target))
        else:  # tf1-floor: feed every initializer input from memory in one run
            arrays = read_weights(folder)
            ops = [v.initializer for v in variables.values()]
            feeds = {v.initializer.inputs[1]: arrays[k] for k, v in variables.items()}
            run = lambda: sess.run(ops, feed_dict=feeds)  # noqa: E731
    if run is None:
        raise SystemExit(f"unknown case {args.case}")
    read_from = [os.path.dirname(target) if "/" in PRODUCTS[product][0] else target] if target else []
    before = (lambda: evict(read_from)) if args.cold and kind == "restore" else None
    if before:
        before()
    # The first call, timed on its own (it builds TF's kernels and executors) and, with --anon,
    # its memory: the worst a user sees, since an allocator pool may keep what it grew to.
    cpu = time.process_time()
    if args.anon:
        first = anon_during(run)
    else:
        start = time.perf_counter()
        run()
        first = {"seconds": time.perf_counter() - start}
    first_cpu = time.process_time() - cpu
    result = measure(run, repeat=args.repeat, warmup=0, before=before)
    result.update(first=first["seconds"], first_cpu=first_cpu)
    if args.anon:
        if before:
            before()
        result.update(first_anon=first["anon"], first_kept=first["kept"], anon=anon_during(run)["anon"])
    if kind == "save" and target:
        result["file_bytes"] = _size(os.path.dirname(target) if "/" in PRODUCTS[product][0] else target)
    emit(result)


def _export_memory(folder: str, product: str) -> dict:
    """Extra anonymous memory of ``tf2.export`` (``product`` "export") or ``snapshot`` of the
    variables, first call in the process then a repeated one, and how much of it is the arrays
    the call returned (numpy arrays of their own; a snapshot's tensors share TF's buffers)."""
    from weightstore.adapters import tf2
    from weightstore.adapters.serving import snapshot

    variables = build_tf2(folder).vars
    call = tf2.export if product == "export" else snapshot.snapshot
    result: dict = {"largest": max(v.numpy().nbytes for v in variables.values())}
    returned: list[int] = []

    def run() -> dict:
        out = call(variables)
        returned.append(sum(v.nbytes for v in out.values() if isinstance(v, np.ndarray)))
        return out

    for when in ("first", "repeated"):
        memory = anon_during(run)
        result[when] = {"anon": memory["anon"], "returned": returned[-1], "beyond": memory["anon"] - returned[-1]}
    return result


def export_memory_bench(size_mb: float, out=sys.stdout) -> dict:
    """``tf2.export`` against the background ``snapshot``: each in a fresh process."""
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    folder = tempfile.mkdtemp(prefix="ws-export-", dir=os.environ.get("WS_BENCH_DIR"))
    try:
        facts = prepare(folder, size_mb)
        model = facts["bytes"]
        say(f"Export {model / MB:,.0f} MB of TF2 variables ({facts['arrays']}): extra anonymous memory, one fresh "
            f"process per call kind; {machine_line()}")
        rows, r = [], {}
        for product, label in (("export", "tf2.export"), ("snapshot", "snapshot")):
            r[product] = res = run_case(MODULE, f"exportmem:{product}", ["--dir", folder], env=QUIET)
            for when in ("first", "repeated"):
                m = res[when]
                rows.append([label, when, f"{fmt_mb(m['anon'])} ({m['anon'] / model:.2f}x)", fmt_mb(m["returned"]),
                             f"{fmt_mb(m['beyond'])} ({m['beyond'] / res['largest']:.1f} largest tensors)"])
        say(table(["call", "call in process", "extra anon MB", "returned arrays MB", "beyond them MB"], rows))
        return r
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _remove(folder: str, product: str) -> None:
    name = PRODUCTS[product][0]
    path = os.path.join(folder, name.split("/")[0])
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)


# -- the run --------------------------------------------------------------------------------
SAVE_PEERS = ["tf2-ckpt", "tf1-saver", "keras", "safetensors"]
RESTORE_PEERS = SAVE_PEERS


def bench(size_mb: float, repeat: int, folder: str | None = None, keep: bool = False, out=sys.stdout) -> dict:
    own = folder is None
    folder = folder or tempfile.mkdtemp(prefix="ws-tf-bench-", dir=os.environ.get("WS_BENCH_DIR"))
    os.makedirs(folder, exist_ok=True)
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    args = ["--dir", folder, "--repeat", str(repeat)]
    started = time.perf_counter()
    try:
        facts = prepare(folder, size_mb)
        say(f"TF benchmark: {facts['arrays']} float32 variables, {facts['bytes'] / MB:,.0f} MB; "
            f"{repeat} runs per case, medians; {machine_line()}")
        r: dict[str, dict] = {}

        def case(name):
            r[name] = run_case(MODULE, name, args, env=QUIET)
            say(f"  {name:28s} {fmt_seconds(r[name]['median'])} s")

        for name in ["assign:tf2-floor", "export:tf2-floor", "export:tf2-floor+fsync", "assign:tf1-floor"]:
            case(name)
        for product, extra in [("ws-tf2", ["restore:ws-tf2-scope"]), ("ws-tf1", ["restore:ws-tf1-scope"]),
                               ("ws-keras", []), ("tf2-ckpt", []), ("tf1-saver", ["restore:tf1-saver-scope"]),
                               ("keras", []), ("safetensors", ["restore:safetensors-scope"])]:
            if not product.startswith("ws"):
                case(f"save:{product}+fsync")
            case(f"save:{product}")
            case(f"restore:{product}")
            for name in extra:
                case(name)
            _remove(folder, product)
        report(r, facts, say)
        say(f"(whole run {time.perf_counter() - started:.0f} s)")
        return {"results": r, "facts": facts}
    finally:
        if own and not keep:
            shutil.rmtree(folder, ignore_errors=True)


def report(r: dict, facts: dict, say) -> None:
    model = facts["bytes"]
    m = lambda name: r[name]["median"]  # noqa: E731
    save_peer = min(m(f"save:{p}") for p in SAVE_PEERS)
    save_peer_sync = min(m(f"save:{p}+fsync") for p in SAVE_PEERS)
    restore_peer = min(m(f"restore:{p}") for p in RESTORE_PEERS)
    export_floor, export_floor_sync = m("export:tf2-floor"), m("export:tf2-floor+fsync")
    tf2_floor, tf1_floor = m("assign:tf2-floor"), m("assign:tf1-floor")

    rows = []
    for product in ["ws-tf2", "ws-tf1", "ws-keras"] + [p + s for p in SAVE_PEERS for s in ("", "+fsync")]:
        res = r[f"save:{product}"]
        durable = product.startswith("ws") or product.endswith("+fsync")
        label = PRODUCTS[product.partition("+")[0]][1] + (" (fsync)" if product.startswith("ws") else
                                                          " + fsync" if durable else "")
        floor = export_floor_sync if durable else export_floor
        rows.append([label, fmt_seconds(res["median"]), fmt_ratio(res["median"] / save_peer),
                     fmt_ratio(res["median"] / save_peer_sync), fmt_ratio(res["median"] / floor),
                     fmt_mb(res["peak"]), fmt_mb(res.get("file_bytes"))])
    for name, label in [("export:tf2-floor", "floor: numpy() + raw write"),
                        ("export:tf2-floor+fsync", "floor: numpy() + raw write + fsync")]:
        res = r[name]
        rows.append([label, fmt_seconds(res["median"]), fmt_ratio(res["median"] / save_peer),
                     fmt_ratio(res["median"] / save_peer_sync), "1.00x", fmt_mb(res["peak"]), "-"])
    say("")
    say(f"Save {model / MB:,.0f} MB of TF variables ({facts['arrays']}) to a file (export + write)")
    say(table(["save", "median s", "x fastest peer", "x fastest peer+fsync", "x floor", "peak MB over model",
               "file MB"], rows))

    rows = []
    for product in ["ws-tf2", "ws-tf1", "ws-keras"] + RESTORE_PEERS:
        res = r[f"restore:{product}"]
        floor = tf1_floor if product in ("ws-tf1", "tf1-saver") else tf2_floor
        rows.append([PRODUCTS[product][1], fmt_seconds(res["median"]), fmt_ratio(res["median"] / restore_peer),
                     fmt_ratio(res["median"] / floor), fmt_mb(res["peak"]), fmt_ratio(res["peak"] / model)])
    for name, label, floor in [("assign:tf2-floor", "floor: var.assign(ndarray) from memory", tf2_floor),
                               ("assign:tf1-floor", "floor: TF1 feed initializers from memory", tf1_floor)]:
        res = r[name]
        rows.append([label, fmt_seconds(res["median"]), fmt_ratio(res["median"] / restore_peer),
                     fmt_ratio(res["median"] / floor), fmt_mb(res["peak"]), fmt_ratio(res["peak"] / model)])
    say("")
    say(f"Restore {model / MB:,.0f} MB into existing variables (file in page cache; x floor: TF1 rows "
        "against the TF1 floor, others against eager assign)")
    say(table(["restore", "median s", "x fastest peer", "x floor", "peak MB over model", "peak / model"], rows))

    rows = []
    for product in ["ws-tf2", "ws-tf1", "tf1-saver", "safetensors"]:
        part, full = m(f"restore:{product}-scope"), m(f"restore:{product}")
        rows.append([PRODUCTS[product][1], fmt_seconds(part), f"{100 * part / full:.1f}%",
                     fmt_mb(r[f"restore:{product}-scope"]["peak"])])
    say("")
    say(f"Selective restore of scope {SCOPE!r} ({100 * facts['scope_bytes'] / model:.1f}% of bytes)")
    say(table(["restore", "median s", "of full restore", "peak MB"], rows))

    checks = []
    for product in ("ws-tf2", "ws-tf1"):
        save, restore = m(f"save:{product}"), m(f"restore:{product}")
        rfloor = tf1_floor if product == "ws-tf1" else tf2_floor
        checks += [
            (f"{product} export+save (fsync) <= fastest peer save (no fsync)", save <= save_peer,
             f"{save:.3f} vs {save_peer:.3f} s"),
            (f"{product} export+save (fsync) <= fastest peer save + fsync", save <= save_peer_sync,
             f"{save:.3f} vs {save_peer_sync:.3f} s"),
            (f"{product} export+save <= 1.5x floor (numpy() + raw write + fsync)", save <= 1.5 * export_floor_sync,
             f"{save / export_floor_sync:.2f}x"),
            (f"{product} load+assign <= fastest peer restore", restore <= restore_peer,
             f"{restore:.3f} vs {restore_peer:.3f} s"),
            (f"{product} load+assign <= 1.5x assign-from-memory floor", restore <= 1.5 * rfloor,
             f"{restore / rfloor:.2f}x"),
            (f"{product} selective 5% <= 10% of full restore", m(f"restore:{product}-scope") <= 0.1 * restore,
             f"{100 * m(f'restore:{product}-scope') / restore:.1f}%"),
            (f"{product} restore peak < 1.3x model bytes over baseline", r[f"restore:{product}"]["peak"] < 1.3 * model,
             f"{r[f'restore:{product}']['peak'] / model:.2f}x"),
        ]
    say("")
    say("Targets")
    say(table(["target", "holds", "measured"], [[c, "yes" if ok else "NO", v] for c, ok, v in checks]))

# -- restores, warm or cold, with their memory ----------------------------------------
RESTORES = [("ws-tf2", "tf2-ckpt"), ("ws-tf2-st", "tf2-ckpt"), ("ws-tf1", "tf1-saver"), ("ws-tf1-st", "tf1-saver")]


def restore_bench(size_mb: float, repeat: int, *, cold: bool = False, rounds: int = 3, tf1_init: str = "fed",
                  pairs: str = "tf2,tf1", out=sys.stdout) -> dict:
    """npz and safetensors files into TF2 variables and a TF1 graph, against ``Checkpoint.read``
    and ``Saver.restore``: every case in its own process, the cases taking turns for ``rounds``
    rounds (load from other processes falls on all alike), medians over the rounds. With
    ``cold``, each case evicts its own files from the page cache before every read (first and
    repeated). Memory: the extra anonymous memory of the first call in the process (what a user
    sees: an allocator pool keeps what it grew to) and of a repeated one. ``tf1_init``: how the
    TF1 graph's variables were set before (:func:`build_tf1`). ``pairs``: "tf2", "tf1" or both.
    CPU seconds (of all the process's threads) stand beside wall seconds: a busy machine
    stretches the wall, CPU is what a neighbour cannot take."""
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    folder = tempfile.mkdtemp(prefix="ws-restore-", dir=os.environ.get("WS_BENCH_DIR"))
    try:
        facts = prepare(folder, size_mb)
        model = facts["bytes"]
        state = "cold (each side's files evicted before every read)" if cold else "warm (files in the page cache)"
        say(f"Restore {model / MB:,.0f} MB ({facts['arrays']} float32 tensors), {state}, TF1 variables set by "
            f"{'feeds' if tf1_init == 'fed' else 'initializers'}: {rounds} rounds of one process per case, {repeat} "
            f"reads each; {machine_line()}")
        chosen = [pair for pair in RESTORES if pair[1].split("-")[0] in pairs.split(",")]
        products = list(dict.fromkeys(p for pair in chosen for p in pair))
        for product in products:
            run_case(MODULE, f"save:{product}", ["--dir", folder, "--repeat", "1"], env=QUIET)
        args = ["--dir", folder, "--repeat", str(repeat), "--anon", "--tf1-init", tf1_init, *(["--cold"] if cold else [])]
        runs: dict[str, list[dict]] = {p: [] for p in products}
        for _ in range(rounds):
            for product in products:
                res = run_case(MODULE, f"restore:{product}", args, env=QUIET)
                runs[product].append(res)
                say(f"  restore:{product:10s} first {fmt_seconds(res['first'])} s ({fmt_seconds(res['first_cpu'])} "
                    f"CPU-s), repeated {fmt_seconds(res['median'])} s ({fmt_seconds(res['cpu'])} CPU-s), extra anon "
                    f"first {fmt_mb(res['first_anon'])} MB")
        r = {p: {"first": median([x["first"] for x in v]), "median": median([x["median"] for x in v]),
                 "first_cpu": median([x["first_cpu"] for x in v]), "cpu": median([x["cpu"] for x in v]),
                 "first_anon": max(x["first_anon"] for x in v), "first_kept": max(x["first_kept"] for x in v),
                 "anon": max(x["anon"] for x in v)} for p, v in runs.items()}
        rows, checks = [], []
        for product in products:
            res = r[product]
            peer = next((b for a, b in chosen if a == product), product)
            rows.append([PRODUCTS[product][1], fmt_seconds(res["first"]), fmt_ratio(res["first"] / r[peer]["first"]),
                         f"{fmt_seconds(res['first_cpu'])} ({res['first_cpu'] / r[peer]['first_cpu']:.2f}x)",
                         fmt_seconds(res["median"]), fmt_ratio(res["median"] / r[peer]["median"]),
                         f"{fmt_seconds(res['cpu'])} ({res['cpu'] / r[peer]['cpu']:.2f}x)",
                         f"{fmt_mb(res['first_anon'])} ({res['first_anon'] / model:.2f}x)",
                         f"{fmt_mb(res['first_kept'])}", f"{fmt_mb(res['anon'])} ({res['anon'] / model:.2f}x)"])
        for own, peer in chosen:
            for when in ("first", "median"):
                ratio = r[own][when] / r[peer][when]
                # a TF1 graph's repeated cold assign within 0.7x Saver.restore
                limit = 0.7 if when == "median" and cold and own.startswith("ws-tf1") else 1.0
                checks.append((f"{own} {'first' if when == 'first' else 'repeated'} <= {limit}x {peer}",
                               ratio <= limit, f"{ratio:.2f}x"))
            limit = 0.1 if own.startswith("ws-tf1") else 0.25
            share = max(r[own]["first_anon"], r[own]["anon"]) / model
            checks.append((f"{own} extra anonymous memory <= {limit}x model (first and repeated)", share <= limit,
                           f"{share:.2f}x"))
        say("")
        say(table(["restore", "first s", "x peer", "first CPU-s", "repeated s", "x peer", "repeated CPU-s",
                   "extra anon MB, first call",
                   "kept after first MB", "extra anon MB, repeated"], rows))
        say("")
        say("Targets (issues 22, 42)")
        say(table(["target", "holds", "measured"], [[c, "yes" if ok else "NO", v] for c, ok, v in checks]))
        return {"facts": facts, **r}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- hold the model once -------------------------------------------------------------
def _fitting_mb(size_mb: float, say) -> float:
    """``size_mb`` halved until three copies (variables, file, the peer's file) fit in free memory."""
    with open("/proc/meminfo") as handle:
        free = next(int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:"))
    fitted = size_mb
    while fitted > 64 and 3 * fitted * MB > free:
        fitted /= 2
    if fitted != size_mb:
        say(f"  ({size_mb:,.0f} MB needs {3 * size_mb / 1024:,.0f} GB free, {free / (1 << 30):,.0f} GB is: "
            f"running {fitted:,.0f} MB instead)")
    return fitted


def hold_bench(tf2_mb: float, tf1_mb: float, small: int, repeat: int, out=sys.stdout,
               rows: tuple[str, ...] = ("tf2", "tf1", "small")) -> dict:
    """The three "hold the model once" comparisons (those in ``rows``), each pair in its own folder."""
    say = lambda *a: print(*a, file=out, flush=True)  # noqa: E731
    say(f"Hold the model once: {repeat} runs per case, medians; extra anonymous memory "
        f"sampled in one more run; {machine_line()}")
    tf2_mb = _fitting_mb(tf2_mb, say)
    table_rows, checks, results = [], [], {}
    pairs = [
        ("tf2", tf2_mb, None, "ws-tf2", "tf2-ckpt", "tf2.assign(variables, npz)", "Checkpoint.read"),
        ("tf1", tf1_mb, None, "ws-tf1", "tf1-saver", "tf1.assign(sess, npz)", "Saver.restore"),
        ("small", None, small, "ws-tf2", "safetensors", f"tf2.assign, {small:,} x 256 floats",
         "safetensors load_file + var.assign"),
        ("small-tf1", None, small, "ws-tf1", "tf1-saver", f"tf1.assign, {small:,} x 256 floats", "Saver.restore"),
    ]
    for name, size_mb, count, own, peer, own_label, peer_label in pairs:
        if name not in rows:
            continue
        folder = tempfile.mkdtemp(prefix=f"ws-hold-{name}-", dir=os.environ.get("WS_BENCH_DIR"))
        try:
            facts = prepare(folder, size_mb) if count is None else prepare_small(folder, count)
            args = ["--dir", folder, "--repeat", str(repeat), "--anon"]
            for product in (own, peer):
                run_case(MODULE, f"save:{product}", args, env=QUIET)
            r: dict[str, dict] = {}
            for _ in range(2):  # alternated, each keeping its better median: load from others evens out
                for product in (own, peer):
                    res = run_case(MODULE, f"restore:{product}", args, env=QUIET)
                    say(f"  {name:5s} restore:{product:12s} {fmt_seconds(res['median'])} s "
                        f"(first {fmt_seconds(res['first'])} s), extra anon {fmt_mb(res['anon'])} MB")
                    best = r.setdefault(product, res)
                    best["anon"] = max(best["anon"], res["anon"], res["first_anon"])  # the worst call a user gets
                    best["first"] = min(best["first"], res["first"])
                    if res["median"] < best["median"]:
                        best.update(median=res["median"], times=res["times"], peak=res["peak"])
            results[name] = {"facts": facts, **r}
            model = facts["bytes"]
            ratio = r[own]["median"] / r[peer]["median"]
            what = f"{facts['arrays']:,} tensors, {model / MB:,.0f} MB"
            for product, label in ((own, own_label), (peer, peer_label)):
                res = r[product]
                table_rows.append([what, label, fmt_seconds(res["first"]), fmt_ratio(res["first"] / r[peer]["first"]),
                                   fmt_seconds(res["median"]), fmt_ratio(res["median"] / r[peer]["median"]),
                                   fmt_mb(res["anon"]), fmt_ratio(res["anon"] / model), fmt_mb(res["peak"])])
            checks.append((f"{own_label} <= 1.0x {peer_label} (repeated)", ratio <= 1.0, f"{ratio:.2f}x"))
            if count is not None:
                first = r[own]["first"] / r[peer]["first"]
                checks.append((f"{own_label} <= 1.0x {peer_label} (first in a process)", first <= 1.0, f"{first:.2f}x"))
            if name == "tf1":
                share = r[own]["anon"] / model
                checks.append(("tf1.assign extra anonymous memory <= 0.1x model (worst call)", share <= 0.1, f"{share:.2f}x"))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    say("")
    say("(first: the first call in a fresh process, which builds TF's kernels; repeated: the median of the next "
        "runs, as a follower re-assigning the same model every few seconds sees it)")
    say(table(["weights", "restore", "first s", "x peer first", "repeated s", "x peer", "extra anon MB",
               "anon / model", "peak RSS MB"], table_rows))
    say("")
    say("Targets")
    say(table(["target", "holds", "measured"], [[c, "yes" if ok else "NO", v] for c, ok, v in checks]))
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tf_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="bytes of variables to build (default 1024)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--dir", help="folder for the files (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the folder")
    parser.add_argument("--hold-mb", type=float, default=4096, help="tf2.assign vs Checkpoint.read size (default 4096)")
    parser.add_argument("--tf1-mb", type=float, default=1024, help="tf1.assign vs Saver.restore size (default 1024)")
    parser.add_argument("--small", type=int, default=50_000, help="small tensors of 256 floats (default 50000)")
    parser.add_argument("--only-hold", action="store_true", help="only the hold-the-model-once rows")
    parser.add_argument("--hold-rows", default="tf2,tf1,small", help="which hold rows: tf2, tf1, small, small-tf1 (default tf2,tf1,small)")
    parser.add_argument("--rounds", type=int, default=3, help="--restore: rounds of one process per case (default 3)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--anon", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cold", action="store_true",
                        help="evict each restore's own files from the page cache before every timed read")
    parser.add_argument("--tf1-init", choices=["fed", "initializers"], default="fed",
                        help="--restore: TF1 variables set before by feeds (numpy's memory: the worst case, "
                             "the default) or by random initializers (TF's memory)")
    parser.add_argument("--pairs", default="tf2,tf1", help="--restore: which pairs, tf2 and/or tf1 (default both)")
    parser.add_argument("--restore", action="store_true",
                        help="only the restore comparison (npz and safetensors into TF2 and TF1, memory columns)")
    parser.add_argument("--export-memory", action="store_true",
                        help="only the memory of tf2.export and of a snapshot, each in a fresh process")
    args = parser.parse_args(argv)
    if args.case:
        os.environ.update(QUIET)
        case_main(args)
        return
    if args.export_memory:
        export_memory_bench(args.size_mb)
        return
    if args.restore:
        restore_bench(args.size_mb, args.repeat, cold=args.cold, rounds=args.rounds, tf1_init=args.tf1_init,
                      pairs=args.pairs)
        return
    if not args.only_hold:
        bench(args.size_mb, args.repeat, args.dir, args.keep)
        print()
    hold_bench(args.hold_mb, args.tf1_mb, args.small, args.repeat, rows=tuple(args.hold_rows.split(",")))


if __name__ == "__main__":
    main()
