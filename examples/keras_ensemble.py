"""Ensembles in Keras: three checkpoints saved with unscoped names, loaded side by side.

Each member was trained alone, so its file says ``w``. The ensemble model holds one copy per
member in layers named ``model_001``…``model_003`` (keys ``model_001/w``…);
``tf2.assign(…, scope=…)`` puts each file's keys under its member's scope. A ``tf.Module``
holding the members as attributes takes the same files the same way.

Run: ``python -m examples.keras_ensemble``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws

MEMBERS = [f"model_{i:03d}" for i in (1, 2, 3)]


def main(folder: str | None = None) -> dict[str, list[float]]:
    """Save three members, load them into a Keras ensemble and a tf.Module; return their outputs for x = 10."""
    import keras
    import tensorflow as tf

    from weightstore.adapters import tf2

    class AddW(keras.layers.Layer):
        """``y = x + w``."""

        def build(self, input_shape):
            self.w = self.add_weight(name="w", shape=(), initializer="zeros")

        def call(self, x):
            return x + self.w

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        for value, name in enumerate(MEMBERS, start=1):
            member = AddW()
            member.build(())
            member.w.assign(float(value))  # stands in for training
            ws.save(root / f"{name}.npz", tf2.export(member))
            print(f"{name}.npz holds {ws.load(root / f'{name}.npz')}")

        x = keras.Input((1,))
        ensemble = keras.Model(x, keras.layers.Concatenate()([AddW(name=name)(x) for name in MEMBERS]))
        module = tf.Module()
        for name in MEMBERS:  # attributes model_001, … each holding w: keys model_001/w, …
            setattr(module, name, tf.Module())
            getattr(module, name).w = tf.Variable(0.0)
        for name in MEMBERS:
            tf2.assign(ensemble, root / f"{name}.npz", scope=name)
            tf2.assign(module, root / f"{name}.npz", scope=name)
        print(f"ensemble keys: {sorted(tf2.variables(ensemble))}")
        outputs = {
            "keras": [float(y) for y in ensemble.predict(np.array([[10.0]]), verbose=0)[0]],
            "module": [float(10.0 + getattr(module, name).w) for name in MEMBERS],
        }
    for kind, values in outputs.items():
        print(f"{kind:6s} with x = 10: " + ", ".join(f"{y:g}" for y in values))
    return outputs


if __name__ == "__main__":
    main()
