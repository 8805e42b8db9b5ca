"""Keep a copy in sync: a TF1 trainer publishes versions, an inference graph in another process follows.

The trainer runs under ``MonitoredTrainingSession`` (which finalizes its graph) with a
``PublishHook``: at the first step, every ``every`` steps and at the end it publishes the
trainable weights as a new version of a folder (``step-….npz`` plus a ``LATEST`` pointer,
only the newest ``keep=2`` kept). The model has a frozen ``body`` (think: pretrained) and a
``head`` being fine-tuned.

The inference process builds its graph once, finalizes it, and runs
``for version in ws.follow(folder): tf1.assign(sess, version)``. Each version is pinned while
it is assigned, so pruning cannot pull it away. This is a hot reload: the first version
writes all four tensors, later ones only the head, since the body's checksums have not
changed (``report.skipped``). Per version it prints the step, its output on a fixed input
and its graph's op count, which stays the same reload after reload.

Run: ``python -m examples.tf1_sync``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws

ROOT = Path(__file__).resolve().parent.parent
PROBE = np.ones((1, 4), np.float32)


def build_model():
    """``y = (x @ body/w + body/b) @ head/w + head/b``: the same names in both processes."""
    import tensorflow as tf

    v1 = tf.compat.v1
    x = v1.placeholder(tf.float32, [None, 4], name="x")
    with v1.variable_scope("body"):
        w = v1.get_variable("w", [4, 4], initializer=v1.glorot_uniform_initializer(seed=1))
        b = v1.get_variable("b", [4], initializer=v1.zeros_initializer())
        hidden = tf.matmul(x, w) + b
    with v1.variable_scope("head"):
        w = v1.get_variable("w", [4, 1], initializer=v1.zeros_initializer())
        b = v1.get_variable("b", [1], initializer=v1.zeros_initializer())
    return x, tf.matmul(hidden, w) + b


def serve(folder: str, last_step: int) -> None:
    """The inference process: follow ``folder`` until ``last_step``, reporting each version."""
    import tensorflow as tf

    from weightstore.adapters import tf1

    with tf.Graph().as_default() as graph, tf.compat.v1.Session() as sess:
        x, y = build_model()
        sess.run(tf.compat.v1.global_variables_initializer())
        graph.finalize()  # no op may be added from here on: every reload must do without
        _report(sess, graph, x, y, step=None)
        for version in ws.follow(folder, poll=0.02, timeout=60):  # stops after 60 s with nothing new
            report = tf1.assign(sess, version)  # only the tensors whose checksum changed
            _report(sess, graph, x, y, step=version.step, assigned=report.assigned, skipped=report.skipped)
            if version.step >= last_step:
                break


def _report(sess, graph, x, y, *, step, assigned=(), skipped=()) -> None:
    output = float(sess.run(y, {x: PROBE})[0, 0])
    print(json.dumps({"step": step, "output": output, "ops": len(graph.get_operations()),
                      "assigned": sorted(assigned), "skipped": sorted(skipped)}), flush=True)


def main(folder: str | None = None, *, steps: int = 60, every: int = 20) -> list[dict]:
    """Train ``steps`` steps publishing every ``every``; return what the inference process saw."""
    import tensorflow as tf

    from weightstore.adapters.serving.hooks import PublishHook

    v1 = tf.compat.v1
    with tempfile.TemporaryDirectory() as scratch:
        folder = str(Path(folder or scratch) / "versions")
        reader = subprocess.Popen(
            [sys.executable, "-m", "examples.tf1_sync", "serve", folder, str(steps)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        try:
            seen = [_read(reader)]
            print(f"reader: before any version  output {seen[0]['output']:8.4f}   graph ops {seen[0]['ops']}")

            def reloaded(version: ws.Version) -> None:
                seen.append(_read(reader))
                entry = seen[-1]
                print(f"trainer: published step {version.step:3d} -> reader: output {entry['output']:8.4f}   "
                      f"graph ops {entry['ops']}   assigned {len(entry['assigned'])}, "
                      f"skipped {len(entry['skipped'])} {entry['skipped']}")

            class Lockstep(v1.train.SessionRunHook):
                """Demo only: after each publish, wait for it and the reader's report, so the printout reads in order.

                A real trainer never waits for its readers; a follower that falls behind just
                jumps to the newest version.
                """

                def __init__(self, publish: PublishHook):
                    self.publish, self.reported = publish, None

                def check(self) -> None:
                    last = self.publish.wait()  # the background publish of this step, if any, is complete
                    if last is not None and last.step != self.reported:
                        self.reported = last.step
                        reloaded(last)

                def after_run(self, run_context, run_values) -> None:  # after PublishHook's: hooks run in order
                    self.check()

                def end(self, session) -> None:  # PublishHook publishes the final step in its end()
                    self.check()

            rng = np.random.default_rng(0)
            data = rng.standard_normal((64, 4)).astype(np.float32)
            target = data.sum(axis=1, keepdims=True) * 2 + 1
            with tf.Graph().as_default():
                global_step = v1.train.get_or_create_global_step()  # the hook's step
                x, y = build_model()
                head = v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, scope="head")  # the body stays frozen
                loss = tf.reduce_mean((y - target) ** 2)
                train = v1.train.GradientDescentOptimizer(0.05).minimize(loss, global_step, var_list=head)
                publish = PublishHook(folder, every_n_steps=every, keep=2, trainable_only=True)
                hooks = [v1.train.StopAtStepHook(last_step=steps), publish, Lockstep(publish)]
                with v1.train.MonitoredTrainingSession(hooks=hooks, log_step_count_steps=None) as sess:
                    while not sess.should_stop():
                        sess.run(train, {x: data})
            reader.wait(timeout=60)
            print(f"folder now holds {sorted(os.listdir(folder))}")
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
