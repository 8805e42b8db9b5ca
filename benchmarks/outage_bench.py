"""A storage outage during ``fit``: training goes on, and the folder ends on the trained weights.

A Keras model trains with ``PublishCallback(s3://..., every_n_batches=N)`` against the loopback
S3 server (``benchmarks.s3_server.CountingS3``, in this process), which answers every request
503 for ``--outage`` seconds from step ``--at`` on. Reported per outage: whether ``fit``
completed, its wall time against the same fit with no outage, the longest single batch (what
a publish could have blocked the training thread for), the publish failures counted, and how
long after the outage ended the folder's ``LATEST`` named the final step, with the weights
checked equal to the trained model's.

    python -m benchmarks.outage_bench --outages 3,30,300
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from benchmarks.common import machine_line, table

DOWN = (503, b"<Error><Code>SlowDown</Code><Message>down</Message></Error>")


def run(server, bucket: str, outage: float, at: int, steps: int, every: int) -> dict:
    import keras

    import weightstore as ws
    from weightstore.adapters import tf2
    from weightstore.adapters.serving.hooks import PublishCallback

    folder = f"s3://{bucket}/outage-{outage:g}-{time.monotonic_ns()}"
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    batch_times: list[float] = []
    ended = threading.Event()

    class Outage(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.began = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            batch_times.append(time.perf_counter() - self.began)
            if outage and int(self.model.optimizer.iterations.numpy()) == at:
                server.intercept = lambda environ: DOWN
                threading.Timer(outage, lambda: (setattr(server, "intercept", None), ended.set())).start()

    callback = PublishCallback(folder, every_n_batches=every, end_timeout=1.0, keep=3)
    x = np.random.default_rng(0).normal(size=(steps, 16)).astype(np.float32)
    began = time.perf_counter()
    completed = True
    try:
        model.fit(x, x[:, :1], batch_size=1, epochs=1, verbose=0, callbacks=[Outage(), callback])
    except Exception:  # what the issue measured before: the outage ended training
        completed = False
    fit_seconds = time.perf_counter() - began
    if outage:
        ended.wait(outage + 60)
    back = time.perf_counter()
    final = callback.wait(outage + 600)
    arrived = time.perf_counter() - back
    loaded = ws.load(ws.latest(folder))
    exact = all(np.array_equal(loaded[k], v) for k, v in tf2.export(model).items())
    return {"completed": completed, "fit": fit_seconds, "longest_batch": max(batch_times),
            "failures": callback.failures, "final": final.step if final else None, "steps": steps,
            "arrived": arrived, "exact": exact}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.outage_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--outages", default="3,30,300", help="outage lengths in seconds, comma-separated")
    parser.add_argument("--steps", type=int, default=2200, help="training steps (batches of one)")
    parser.add_argument("--at", type=int, default=260, help="the step the outage starts at")
    parser.add_argument("--every", type=int, default=25, help="every_n_batches")
    args = parser.parse_args(argv)
    import s3fs

    from benchmarks.s3_server import CountingS3, use_environment

    server = CountingS3().start()
    use_environment(server)
    s3fs.S3FileSystem.clear_instance_cache()
    bucket = "weightstore-outage-bench"
    s3fs.S3FileSystem().mkdir(bucket)
    print(f"fit of {args.steps} steps, PublishCallback every {args.every} batches to loopback S3, outage from step "
          f"{args.at}; {machine_line()}", flush=True)
    baseline = run(server, bucket, 0, args.at, args.steps, args.every)
    rows = []
    for outage in [float(x) for x in args.outages.split(",")]:
        m = run(server, bucket, outage, args.at, args.steps, args.every)
        rows.append([f"{outage:g} s", "yes" if m["completed"] else "NO", f"{m['fit']:.1f} s",
                     f"{m['fit'] / baseline['fit']:.2f}x", f"{m['longest_batch']:.3f} s", str(m["failures"]),
                     f"{m['final']} of {m['steps']}", f"{m['arrived']:.1f} s", "yes" if m["exact"] else "NO"])
        print(f"  outage {outage:g} s: {m}", flush=True)
    print(table(["outage", "fit completed", "fit wall", "x no outage", "longest batch", "failures counted",
                 "final version", "final after outage", "equal to trained"], rows))
    print(f"no outage: fit {baseline['fit']:.1f} s, longest batch {baseline['longest_batch']:.3f} s")
    server.stop()


if __name__ == "__main__":
    main()
