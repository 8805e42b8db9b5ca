"""Keep a copy in sync, Keras edition: a trainer publishes, a model in another process reloads.

The trainer's callback saves the model's weights every few batches (``weightstore.save`` is
atomic, so the reader never sees half a file). The inference process builds the same
architecture once; Keras names its layers differently there (``dense`` in one process may be
``dense_3`` in another), yet the keys match, so ``tf2.assign`` reloads in place on each new
file and the outputs change with the trainer's.

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

import weightstore as ws

ROOT = Path(__file__).resolve().parent.parent
PROBE = np.ones((1, 4), np.float32)


def build_model():
    import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])


def serve(path: str, rounds: int) -> None:
    """The inference process: reload ``path`` whenever its step changes, report each output."""
    from weightstore.adapters import tf2

    build_model()  # an earlier model in this process, so this one's automatic names differ
    model = build_model()
    _report(None, model, [model.weights[0].path, next(iter(tf2.variables(model)))])
    seen, deadline = None, time.monotonic() + 120
    while rounds and time.monotonic() < deadline:
        if os.path.exists(path):
            with ws.open(path) as store:
                step = store.metadata["step"]
                if step != seen:
                    tf2.assign(model, store)
                    seen, rounds = step, rounds - 1
                    _report(step, model, [])
        time.sleep(0.02)


def _report(step, model, paths) -> None:
    output = float(model(PROBE, training=False)[0, 0])
    print(json.dumps({"step": step, "output": output, "paths": paths}), flush=True)


def main(folder: str | None = None, *, rounds: int = 3, every: int = 4) -> list[dict]:
    """Train, publish every ``every`` batches, and return what the inference process saw."""
    import keras

    from weightstore.adapters import tf2

    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(folder or scratch) / "weights.npz")
        reader = subprocess.Popen(
            [sys.executable, "-m", "examples.keras_sync", "serve", path, str(rounds)],
            cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        try:
            seen = [_read(reader)]
            print(f"reader: before any reload  output {seen[0]['output']:8.4f}  "
                  f"(Keras path {seen[0]['paths'][0]}, key {seen[0]['paths'][1]})")
            model = build_model()
            print(f"trainer: Keras path {model.weights[0].path}, key {next(iter(tf2.variables(model)))}")

            class Publish(keras.callbacks.Callback):
                def on_train_batch_end(self, batch, logs=None):
                    step = self.model.optimizer.iterations.numpy().item()
                    if step % every == 0 and len(seen) <= rounds:
                        ws.save(path, tf2.export(self.model), metadata={"step": step})
                        seen.append(_read(reader))
                        print(f"trainer: published step {step:3d}; reader reloaded it: output {seen[-1]['output']:8.4f}")

            rng = np.random.default_rng(0)
            data = rng.standard_normal((rounds * every * 8, 4)).astype(np.float32)
            target = data.sum(axis=1, keepdims=True) * 2 + 1
            model.compile(keras.optimizers.SGD(0.05), "mse")
            model.fit(data, target, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=[Publish()])
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
