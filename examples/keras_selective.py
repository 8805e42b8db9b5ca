"""Selective save and restore, Keras edition: what inference needs, not the optimizer's state.

A small conv net whose blocks are layers named ``conv_1`` and ``conv_2``, each holding a
convolution ``conv`` and a batch norm ``bn`` (keys ``conv_1/bn/moving_mean``…), trains a few
steps with Adagrad. We export the trainable variables plus the batch-norm statistics
(non-trainable, yet inference needs them) and compare the file with one holding everything,
optimizer accumulators included. A fresh model restores the smaller file: its predictions
equal the trained model's, and its optimizer keeps its initial state.

Run: ``python -m examples.keras_selective``
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws

BATCH_NORM = "*/bn/moving_*"


def build():
    import keras

    class ConvBlock(keras.layers.Layer):
        def __init__(self, channels, **kwargs):
            super().__init__(**kwargs)
            self.conv = keras.layers.Conv2D(channels, 3, padding="same", name="conv")
            self.bn = keras.layers.BatchNormalization(name="bn")

        def call(self, x, training=False):
            return keras.ops.relu(self.bn(self.conv(x), training=training))

    model = keras.Sequential([
        keras.Input((8, 8, 1)), ConvBlock(8, name="conv_1"), ConvBlock(16, name="conv_2"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3, name="logits"),
    ])
    model.compile(keras.optimizers.Adagrad(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main(folder: str | None = None) -> dict:
    import keras

    from weightstore.adapters import tf2

    rng = np.random.default_rng(0)
    data = rng.standard_normal((32, 8, 8, 1)).astype(np.float32)
    labels = rng.integers(0, 3, 32)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        keras.utils.set_random_seed(1)
        model = build()
        model.fit(data, labels, batch_size=8, epochs=2, verbose=0)
        trained = model.predict(data, verbose=0)
        everything = {**tf2.export(model), **ws.remap(tf2.export(model.optimizer.variables), scope="optimizer")}
        selected = {**tf2.export(model, trainable_only=True), **tf2.export(model, include=BATCH_NORM)}
        ws.save(root / "everything.npz", everything)
        ws.save(root / "selected.npz", selected)
        sizes = {name: os.path.getsize(root / f"{name}.npz") for name in ("everything", "selected")}
        ratio = sizes["selected"] / sizes["everything"]
        print(f"everything: {len(everything)} tensors, {sizes['everything']} bytes (model weights and Adagrad state)")
        print(f"selected:   {len(selected)} tensors, {sizes['selected']} bytes ({ratio:.0%}), "
              f"e.g. {[k for k in selected if k.startswith('conv_1/bn')]}")

        keras.utils.set_random_seed(2)  # a different initialisation, overwritten where the file says
        fresh = build()
        fresh.optimizer.build(fresh.trainable_variables)
        initial = tf2.export(fresh.optimizer.variables)
        report = tf2.assign(fresh, root / "selected.npz")
        restored = fresh.predict(data, verbose=0)
        kept = all(np.array_equal(v, initial[k]) for k, v in tf2.export(fresh.optimizer.variables).items())
        same = bool(np.array_equal(restored, trained))
        without_stats = build()
        tf2.assign(without_stats, root / "selected.npz", exclude=BATCH_NORM)
        stats_matter = not np.allclose(without_stats.predict(data, verbose=0), trained)
        print(f"restored {len(report.assigned)} tensors; the fresh optimizer's {len(initial)} variables "
              f"kept their initial values: {kept}")
        print(f"predictions identical to the trained model's: {same}; "
              f"without the batch-norm statistics they differ: {stats_matter}")
    return {"ratio": ratio, "identical": same, "kept_initial": kept, "stats_matter": stats_matter,
            "assigned": sorted(report.assigned)}


if __name__ == "__main__":
    main()
