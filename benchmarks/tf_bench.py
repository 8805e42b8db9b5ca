"""TensorFlow benchmark (issue 3): weightstore's adapters against TensorFlow's own checkpoints.

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

    python -m benchmarks.tf_bench                 # 1 GB, 5 repetitions
    python -m benchmarks.tf_bench --size-mb 128   # quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from benchmarks.common import (
    MB,
    emit,
    fmt_mb,
    fmt_ratio,
    fmt_seconds,
    fsync_tree,
    machine_line,
    measure,
    run_case,
    table,
)
from benchmarks.core_bench import SCOPE, prepare, read_weights

MODULE = "benchmarks.tf_bench"
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "3"}

# product -> (file or folder name, what it is)
PRODUCTS = {
    "ws-tf2": ("ws-tf2.npz", "weightstore tf2 (tf.Variable dict)"),
    "ws-keras": ("ws-keras.npz", "weightstore tf2 (Keras model)"),
    "ws-tf1": ("ws-tf1.npz", "weightstore tf1 (graph, session)"),
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


def build_tf2(folder):
    """A ``tf.Module`` holding a dict of eager variables filled with the benchmark's weights."""
    import tensorflow as tf

    weights = read_weights(folder)
    module = tf.Module(name="model")
    module.vars = {key: tf.Variable(value, name=key) for key, value in weights.items()}
    del weights
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
    for var, value in zip(model.held, weights.values()):
        var.assign(value)
    del weights
    return model


def build_tf1(folder):
    """A graph with one resource variable per key (zeros initializers), filled by feeding."""
    import tensorflow as tf

    graph = tf.Graph()
    with graph.as_default():
        variables = {}
        for key, shape in _spec(folder):
            variables[key] = tf.compat.v1.get_variable(key, shape, tf.float32, tf.compat.v1.zeros_initializer())
        saver = tf.compat.v1.train.Saver(variables, write_version=tf.compat.v1.train.SaverDef.V2)
        scoped = {k: v for k, v in variables.items() if k.startswith(SCOPE + "/")}
        scoped_saver = tf.compat.v1.train.Saver(scoped)
    sess = tf.compat.v1.Session(graph=graph)
    weights = read_weights(folder)
    sess.run([v.initializer for v in variables.values()],
             feed_dict={v.initializer.inputs[1]: weights[k] for k, v in variables.items()})
    del weights
    graph.finalize()
    return sess, variables, saver, scoped_saver


# -- cases ----------------------------------------------------------------------------------
def case_main(args) -> None:
    import tensorflow as tf

    import weightstore as ws
    from weightstore.adapters import tf1, tf2

    folder = args.dir
    kind, product = args.case.split(":", 1)
    product, _, durable = product.partition("+")
    scoped = product.endswith("-scope")
    product = product.removesuffix("-scope")
    target = os.path.join(folder, PRODUCTS[product][0]) if product in PRODUCTS else None
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
                        for key in f.keys():
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
            if kind == "save":
                run = lambda: ws.save(target, tf2.export(model))  # noqa: E731
            else:
                run = lambda: tf2.assign(model, target)  # noqa: E731
        elif kind == "save":
            run = durably(lambda: model.save_weights(target))
        else:
            run = lambda: model.load_weights(target)  # noqa: E731
    elif product in ("ws-tf1", "tf1-saver", "tf1-floor"):
        sess, variables, saver, scoped_saver = build_tf1(folder)
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
    result = measure(run, repeat=args.repeat)
    if kind == "save" and target:
        result["file_bytes"] = _size(os.path.dirname(target) if "/" in PRODUCTS[product][0] else target)
    emit(result)


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
    for product, floor in [("ws-tf2", None), ("ws-tf1", None)]:
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
    say("Targets (issue 3)")
    say(table(["target", "holds", "measured"], [[c, "yes" if ok else "NO", v] for c, ok, v in checks]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tf_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="bytes of variables to build (default 1024)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--dir", help="folder for the files (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the folder")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        os.environ.update(QUIET)
        case_main(args)
    else:
        bench(args.size_mb, args.repeat, args.dir, args.keep)


if __name__ == "__main__":
    main()
