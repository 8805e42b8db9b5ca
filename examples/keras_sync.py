"""Keep a copy in sync, Keras edition: a trainer publishes versions, a model in another process follows.

The trainer's ``PublishCallback(folder, every_n_batches=...)`` publishes the model's weights
as a new version of a folder every few batches (``step-….npz`` plus a ``LATEST`` pointer,
only the newest ``keep=3`` kept); the step is the optimizer's iteration count.

The inference process builds the same architecture once and serves it in a loop, each call
inside ``with follower.reading(): model(x)``, while a background ``Follower`` keeps the model
at the newest version: it swaps a version in between two calls, never during one. Keras
names the layers differently there (``dense`` in one process may be ``dense_2`` in
another), yet the keys match, so each version is assigned in place. Per version it prints
the step, the output on a fixed input and how many calls the previous version served.

Run: ``python -m examples.keras_sync``
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

ROOT = Path(__file__).resolve().parent.parent
PROBE = np.ones((1, 4), np.float32)


def build_model():
    import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])


def serve(folder: str, last_step: int) -> None:
    """The inference process: serve calls in a loop while a Follower swaps versions in, until ``last_step``."""
    from weightstore.adapters import tf2
    from weightstore.adapters.serving.follower import Follower

    build_model()  # an earlier model in this process, so this one's automatic names differ
    model = build_model()
    output = float(model(PROBE, training=False)[0, 0])
    print(json.dumps({"step": None, "output": output, "calls": 0,
                      "paths": [model.weights[0].path, next(iter(tf2.variables(model)))]}), flush=True)
    current, calls, deadline = None, 0, time.monotonic() + 60
    with Follower(model, folder, poll=0.02) as follower:
        while time.monotonic() < deadline:
            with follower.reading():  # no swap while this call runs
                version = follower.version
                output = float(model(PROBE, training=False)[0, 0])
            if version is not None and version.step != current:  # the first call on a new version
                report = follower.report
                print(json.dumps({"step": version.step, "output": output, "calls": calls,
                                  "assigned": len(report.assigned), "skipped": len(report.skipped)}), flush=True)
                current, calls = version.step, 0
                if current >= last_step:
                    break
            calls += 1
            time.sleep(0.002)
        if follower.error is not None:
            print(f"follower: {follower.error}", file=sys.stderr)


def main(folder: str | None = None, *, steps: int = 12, every: int = 4) -> list[dict]:
    """Train ``steps`` batches publishing every ``every``; return what the inference process saw."""
    import keras

    from weightstore.adapters import tf2
    from weightstore.adapters.serving.hooks import PublishCallback

    with tempfile.TemporaryDirectory() as scratch:
        folder = str(Path(folder or scratch) / "versions")
        reader = subprocess.Popen(
            [sys.executable, "-m", "examples.keras_sync", "serve", folder, str(steps)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        try:
            seen = [_read(reader)]
            print(f"reader: before any version  output {seen[0]['output']:8.4f}  "
                  f"(Keras path {seen[0]['paths'][0]}, key {seen[0]['paths'][1]})")
            model = build_model()
            print(f"trainer: Keras path {model.weights[0].path}, key {next(iter(tf2.variables(model)))}")
            publish = PublishCallback(folder, every_n_batches=every, keep=3)

            class Lockstep(keras.callbacks.Callback):
                """Demo only: after each publish, wait for it and the reader's report, so the printout reads in order.

                A real trainer never waits for its readers; a Follower that falls behind just
                jumps to the newest version.
                """

                reported = None

                def on_train_batch_end(self, batch, logs=None):  # after PublishCallback's: callbacks run in order
                    last = publish.wait()  # the background publish of this batch, if any, is complete
                    if last is not None and last.step != self.reported:
                        self.reported = last.step
                        seen.append(_read(reader))
                        entry = seen[-1]
                        print(f"trainer: published step {self.reported:3d} -> reader: output {entry['output']:8.4f}"
                              f"   assigned {entry['assigned']}, skipped {entry['skipped']}"
                              f"   ({entry['calls']} calls served since the last swap)")

            rng = np.random.default_rng(0)
            data = rng.standard_normal((steps * 8, 4)).astype(np.float32)
            target = data.sum(axis=1, keepdims=True) * 2 + 1
            model.compile(keras.optimizers.SGD(0.05), "mse")
            model.fit(data, target, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[publish, Lockstep()])
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
