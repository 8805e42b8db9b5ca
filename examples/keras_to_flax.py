"""Port a Keras CNN to a Flax NNX module and back through one file, with ``layout="keras"``.

The network of ``examples.keras_to_torch`` (convolution, batch norm, max pooling, depthwise
convolution, batch norm, global average pooling, dense head), written with ``flax.nnx``.
Flax is channels-last and keeps kernels as Keras does, so the layout only renames
(``gamma`` → ``scale``, ``moving_mean`` → ``mean``…) and reshapes the depthwise kernel into
the grouped ``Conv`` kernel Flax uses (``[h, w, 1, in * multiplier]``).

Run: ``python -m examples.keras_to_flax``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws
from examples.keras_to_torch import CLASSES, build_keras, randomize


def build_flax():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            norm = {"epsilon": 1e-3, "use_running_average": True, "rngs": rngs}  # Keras's epsilon; inference
            zeros = nnx.initializers.zeros_init()  # the weights come from Keras: skip compiling random inits
            self.conv1 = nnx.Conv(3, 8, (3, 3), padding="SAME", kernel_init=zeros, rngs=rngs)
            self.bn1 = nnx.BatchNorm(8, **norm)
            self.dw = nnx.Conv(8, 16, (3, 3), padding="SAME", feature_group_count=8, kernel_init=zeros, rngs=rngs)
            self.bn2 = nnx.BatchNorm(16, **norm)
            self.head = nnx.Linear(16, CLASSES, kernel_init=zeros, rngs=rngs)

        def __call__(self, images):
            x = nnx.max_pool(nnx.relu(self.bn1(self.conv1(images))), (2, 2), strides=(2, 2))
            x = nnx.relu(self.bn2(self.dw(x)))
            return self.head(x.mean(axis=(1, 2)))

    return Net(nnx.Rngs(0))


def main(folder: str | None = None) -> dict:
    from weightstore.adapters import flax as flax_adapter
    from weightstore.adapters import tf2

    images = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype(np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        keras_model = build_keras()
        randomize(keras_model, seed=1)
        expected = keras_model.predict(images, verbose=0)
        ws.save(root / "keras.npz", tf2.export(keras_model))

        net = build_flax()
        report = flax_adapter.assign(net, root / "keras.npz", layout="keras")
        to_flax = float(np.max(np.abs(np.asarray(net(images)) - expected)))
        print(f"Keras -> Flax: {len(report.assigned)} tensors assigned, max abs difference {to_flax:.2e}")

        ws.save(root / "flax.npz", flax_adapter.export(net, layout="keras"))
        fresh = build_keras()
        tf2.assign(fresh, root / "flax.npz")
        back = float(np.max(np.abs(fresh.predict(images, verbose=0) - expected)))
        print(f"Flax -> Keras: max abs difference {back:.2e}")
    return {"to_flax": to_flax, "back_to_keras": back, "assigned": sorted(report.assigned)}


if __name__ == "__main__":
    main()
