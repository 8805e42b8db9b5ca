"""Sync benchmark: publish-to-assigned latency, and hot reload with 5% vs all tensors changed.

``python -m benchmarks.sync_bench [--size-mb 1024] [--small-mb 4] [--repeat 5] [--poll 0.01]``

- *Latency*: a :class:`~weightstore.adapters.serving.follower.Follower` keeps TF2 variables (and a TF1
  session) current in this process; we time from ``publish`` returning to the follower having
  assigned that version. Every tensor changes each time, so this is a full reload; it includes
  up to one ``--poll`` interval of waiting.
- *Hot reload*: ``assign(target, ws.latest(folder))`` into a target that already holds the
  previous version, when 5% of the tensors changed against when all did. The target is at
  most 15% of a full reload.

The weights are ``--tensors`` float32 tensors (300 by default, as in DESIGN.md's figures).
Not a test; the figures are medians of ``--repeat`` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import weightstore as ws

MB = 1 << 20


def make_weights(size_mb: float, tensors: int) -> dict[str, np.ndarray]:
    per = max(1, int(size_mb * MB / 4 / tensors))
    rng = np.random.default_rng(0)
    return {f"model/layer_{i:03d}/kernel": rng.standard_normal(per, dtype=np.float32) for i in range(tensors)}


def bump(weights: dict[str, np.ndarray], fraction: float, step: int) -> None:
    """Change ``fraction`` of the tensors (at least one) in place, so their checksums change."""
    keys = list(weights)
    for key in keys[: max(1, round(len(keys) * fraction))]:
        weights[key][0] = float(step)


class Target:
    """TF2 variables or a TF1 session holding one variable per key, and the matching assign."""

    def __init__(self, kind: str, weights: dict[str, np.ndarray]):
        import tensorflow as tf

        from weightstore.adapters import tf1, tf2

        self.kind = kind
        if kind == "tf2":
            self.obj = {key: tf.Variable(np.zeros_like(value), name=key.replace("/", "_")) for key, value in weights.items()}
            self.assign = tf2.assign
            self.close = lambda: None
        else:
            graph = tf.Graph()
            with graph.as_default():
                variables = [tf.compat.v1.get_variable(key, initializer=tf.zeros(value.shape), use_resource=True)
                             for key, value in weights.items()]
                self.obj = tf.compat.v1.Session(graph=graph)
                self.obj.run(tf.compat.v1.variables_initializer(variables))
            self.assign = tf1.assign
            self.close = self.obj.close


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000


def latency(kind: str, size_mb: float, tensors: int, repeat: int, poll: float, scratch: str) -> dict[str, float]:
    from weightstore.adapters.serving.follower import Follower

    folder = tempfile.mkdtemp(prefix=f"latency-{kind}-", dir=scratch)
    weights = make_weights(size_mb, tensors)
    target = Target(kind, weights)
    publish_times, latencies = [], []
    ws.publish(folder, weights, step=0, keep=2)
    with Follower(target.obj, folder, poll=poll) as follower:
        follower.wait(0, timeout=600)
        for step in range(1, repeat + 2):
            bump(weights, 1.0, step)
            start = time.perf_counter()
            ws.publish(folder, weights, step=step, keep=2)
            published = time.perf_counter()
            if follower.wait(step, timeout=600) is None:
                raise RuntimeError(f"follower never assigned step {step}: {follower.error}")
            if step > 1:  # the first is a warm-up
                latencies.append(time.perf_counter() - published)
                publish_times.append(published - start)
    target.close()
    return {"publish_ms": median_ms(publish_times), "latency_ms": median_ms(latencies)}


def hot_reload(kind: str, size_mb: float, tensors: int, repeat: int, scratch: str) -> dict[str, float]:
    folder = tempfile.mkdtemp(prefix=f"reload-{kind}-", dir=scratch)
    weights = make_weights(size_mb, tensors)
    target = Target(kind, weights)
    step = 0
    ws.publish(folder, weights, step=step, keep=2)
    target.assign(target.obj, ws.latest(folder))
    results: dict[str, float] = {}
    for label, fraction in (("all", 1.0), ("5%", 0.05)):
        times = []
        for run in range(repeat + 1):
            step += 1
            bump(weights, fraction, step)
            ws.publish(folder, weights, step=step, keep=2)
            version = ws.latest(folder)
            start = time.perf_counter()
            report = target.assign(target.obj, version)
            elapsed = time.perf_counter() - start
            expected = max(1, round(tensors * fraction))
            if len(report.assigned) != expected:
                raise RuntimeError(f"{label}: assigned {len(report.assigned)} tensors, expected {expected}")
            if run:  # the first is a warm-up
                times.append(elapsed)
        results[label] = median_ms(times)
    target.close()
    return results


def bench(size_mb: float, small_mb: float, repeat: int, poll: float, tensors: int, kinds: list[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="weightstore-sync-bench-") as scratch:
        print(f"sync: {tensors} float32 tensors, poll {poll * 1000:.0f} ms, medians of {repeat}")
        print(f"{'case':<28}{'publish ms':>12}{'to assigned ms':>16}")
        for kind in kinds:
            for size in dict.fromkeys((small_mb, size_mb)):
                row = latency(kind, size, tensors, repeat, poll, scratch)
                print(f"{f'latency {kind} {size:g} MB':<28}{row['publish_ms']:>12.1f}{row['latency_ms']:>16.1f}")
        print()
        print(f"{'hot reload':<28}{'all ms':>12}{'5% ms':>10}{'ratio':>8}  (target <= 0.15)")
        for kind in kinds:
            row = hot_reload(kind, size_mb, tensors, repeat, scratch)
            print(f"{f'{kind} {size_mb:g} MB':<28}{row['all']:>12.1f}{row['5%']:>10.1f}{row['5%'] / row['all']:>8.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sync_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="the large model (default 1024)")
    parser.add_argument("--small-mb", type=float, default=4, help="the small model (default 4)")
    parser.add_argument("--tensors", type=int, default=300, help="tensors per model (default 300)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per case (default 5)")
    parser.add_argument("--poll", type=float, default=0.01, help="follower poll interval in seconds (default 0.01)")
    parser.add_argument("--kinds", default="tf2,tf1", help="targets to measure (default tf2,tf1)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    bench(args.size_mb, args.small_mb, args.repeat, args.poll, args.tensors, args.kinds.split(","))


if __name__ == "__main__":
    main()
