"""Keep a copy in sync: a TF1 trainer publishes, an inference graph in another process reloads.

The trainer saves its trainable weights every few steps (``weightstore.save`` is atomic, so
the reader never sees half a file). The inference process builds its graph once, finalizes
it, and on each new file calls ``tf1.assign``: its outputs change while its graph keeps the
same number of ops, reload after reload.

Run: ``python -m examples.tf1_sync``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import weightstore as ws

ROOT = Path(__file__).resolve().parent.parent
PROBE = np.ones((1, 4), np.float32)


def build_model():
    """``y = x @ w + b``: the same names in the trainer and in the inference graph."""
    import tensorflow as tf

    v1 = tf.compat.v1
    x = v1.placeholder(tf.float32, [None, 4], name="x")
    with v1.variable_scope("linear"):
        w = v1.get_variable("w", [4, 1], initializer=v1.zeros_initializer())
        b = v1.get_variable("b", [1], initializer=v1.zeros_initializer())
    return x, tf.matmul(x, w) + b


def serve(path: str, rounds: int) -> None:
    """The inference process: reload ``path`` whenever its step changes, report each output."""
    import tensorflow as tf

    from weightstore.adapters import tf1

    with tf.Graph().as_default() as graph, tf.compat.v1.Session() as sess:
        x, y = build_model()
        sess.run(tf.compat.v1.global_variables_initializer())
        graph.finalize()  # as MonitoredTrainingSession does: no op may be added from here on
        _report(step=None, output=sess.run(y, {x: PROBE}), ops=len(graph.get_operations()))
        seen, deadline = None, time.monotonic() + 120
        while rounds and time.monotonic() < deadline:
            if os.path.exists(path):
                with ws.open(path) as store:
                    step = store.metadata["step"]
                    if step != seen:
                        tf1.assign(sess, store)
                        seen, rounds = step, rounds - 1
                        _report(step=step, output=sess.run(y, {x: PROBE}), ops=len(graph.get_operations()))
            time.sleep(0.02)


def _report(step, output, ops) -> None:
    print(json.dumps({"step": step, "output": float(output[0, 0]), "ops": ops}), flush=True)


def main(folder: str | None = None, *, rounds: int = 3, every: int = 20) -> list[dict]:
    """Train, publish every ``every`` steps, and return what the inference process saw."""
    import tensorflow as tf

    from weightstore.adapters import tf1

    v1 = tf.compat.v1
    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(folder or scratch) / "weights.npz")
        reader = subprocess.Popen(
            [sys.executable, "-m", "examples.tf1_sync", "serve", path, str(rounds)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        try:
            seen = [_read(reader)]
            print(f"reader: before any reload     output {seen[0]['output']:8.4f}   graph ops {seen[0]['ops']}")
            rng = np.random.default_rng(0)
            data = rng.standard_normal((64, 4)).astype(np.float32)
            target = data.sum(axis=1, keepdims=True) * 2 + 1
            with tf.Graph().as_default(), v1.Session() as sess:
                x, y = build_model()
                train = v1.train.GradientDescentOptimizer(0.05).minimize(tf.reduce_mean((y - target) ** 2))
                sess.run(v1.global_variables_initializer())
                for step in range(1, rounds * every + 1):
                    sess.run(train, {x: data})
                    if step % every == 0:
                        ws.save(path, tf1.export(sess, trainable_only=True), metadata={"step": step})
                        seen.append(_read(reader))
                        print(f"trainer: published step {step:3d}; reader reloaded it: "
                              f"output {seen[-1]['output']:8.4f}   graph ops {seen[-1]['ops']}")
            reader.wait(timeout=60)
        finally:
            if reader.poll() is None:
                reader.kill()
    return seen


def _read(reader: subprocess.Popen) -> dict:
    line = reader.stdout.readline()
    if not line:
        raise RuntimeError(f"the inference process exited with status {reader.wait()}")
    return json.loads(line)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]))
    else:
        main()
