"""What pairing a Keras file or TF2 checkpoint with a model costs, against Keras's and TF's own restore.

``python -m benchmarks.artifacts_bench [--repeat N]``: ResNet50 (``weights=None``, about
100 MB of float32), saved with ``save_weights`` and ``tf.train.Checkpoint``; each restore
into the same built model, median of ``--repeat`` runs after one warm-up. Run it on a quiet
machine and compare within one run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import median_seconds


def bench(repeat: int) -> dict[str, float]:
    import keras
    import numpy as np
    import tensorflow as tf

    from weightstore.adapters import _artifacts, tf2

    model = keras.applications.ResNet50(input_shape=(64, 64, 3), weights=None, classes=10)
    model(np.zeros((1, 64, 64, 3), np.float32))
    with tempfile.TemporaryDirectory() as folder:
        weights = str(Path(folder) / "m.weights.h5")
        model.save_weights(weights)
        prefix = tf.train.Checkpoint(model=model).write(str(Path(folder) / "ckpt-1"))
        return {
            "keras load_weights": median_seconds(lambda: model.load_weights(weights), repeat),
            "tf2.assign(.weights.h5)": median_seconds(lambda: tf2.assign(model, weights), repeat),
            "  of which Keras's save walk": median_seconds(lambda: _artifacts._keras_paths(model), repeat),
            "Checkpoint.read": median_seconds(lambda: tf.train.Checkpoint(model=model).read(prefix).assert_consumed(), repeat),
            "tf2.assign(TF2 checkpoint)": median_seconds(lambda: tf2.assign(model, prefix), repeat),
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.artifacts_bench", description=__doc__)
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per case (default 3)")
    args = parser.parse_args(argv)
    for case, seconds in bench(args.repeat).items():
        print(f"{case:32s} {seconds:7.3f} s")


if __name__ == "__main__":
    main()
