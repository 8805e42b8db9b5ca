"""Port a Keras CNN to PyTorch and back through one file, with ``layout="keras"``.

The Keras model (channels-last) has a convolution, batch norm, max pooling, a depthwise
convolution with two filters per channel, a second batch norm, global average pooling and a
dense head. The PyTorch module is the same network written the PyTorch way: channels-first
(so it permutes its NHWC input once), ``Linear`` weights ``[out, in]``, ``OIHW`` kernels,
``running_mean``/``running_var``. Its attributes carry the Keras layer names (``conv1``,
``bn1``, ``dw``…), so keys pair up once the layout has renamed the leaves and moved the axes;
a model with other names would add ``mapping=``. Global average pooling before the head keeps
the flatten order out of the question.

The Keras weights go into a store, the store into the PyTorch module, the module's export
(in Keras's layout again) into a second store, and that into a fresh Keras model. Each step
prints the largest difference between the two frameworks' predictions on random inputs.

Run: ``python -m examples.keras_to_torch``
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

import weightstore as ws

CLASSES = 5


def build_keras():
    import keras

    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(8, 3, padding="same", name="conv1")(inputs)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn1")(x))
    x = keras.layers.MaxPooling2D(2)(x)
    x = keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, name="dw")(x)
    x = keras.layers.ReLU()(keras.layers.BatchNormalization(name="bn2")(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x))


def build_torch():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(8, eps=1e-3)  # Keras's default epsilon, not PyTorch's 1e-5
            self.dw = nn.Conv2d(8, 16, 3, padding=1, groups=8)  # groups == in_channels: depthwise
            self.bn2 = nn.BatchNorm2d(16, eps=1e-3)
            self.head = nn.Linear(16, CLASSES)

        def forward(self, images):  # NHWC, as Keras takes them
            x = images.permute(0, 3, 1, 2)
            x = torch.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
            x = torch.relu(self.bn2(self.dw(x)))
            return self.head(x.mean(dim=(2, 3)))

    return Net().eval()


def randomize(model, seed: int) -> None:
    """Random values everywhere, batch-norm statistics included, so every tensor matters."""
    rng = np.random.default_rng(seed)
    for var in model.weights:
        value = rng.normal(size=var.shape).astype("float32")
        var.assign(np.abs(value) + 0.5 if "variance" in var.path else value)


def main(folder: str | None = None) -> dict:
    import torch

    from weightstore.adapters import tf2
    from weightstore.adapters import torch as torch_adapter

    images = np.random.default_rng(0).normal(size=(4, 8, 8, 3)).astype(np.float32)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(folder or scratch)
        keras_model = build_keras()
        randomize(keras_model, seed=1)
        expected = keras_model.predict(images, verbose=0)
        ws.save(root / "keras.npz", tf2.export(keras_model))

        net = build_torch()
        report = torch_adapter.assign(net, root / "keras.npz", layout="keras")
        with torch.no_grad():
            ported = net(torch.from_numpy(images)).numpy()
        to_torch = float(np.max(np.abs(ported - expected)))
        print(f"Keras -> PyTorch: {len(report.assigned)} tensors assigned, max abs difference {to_torch:.2e}")

        ws.save(root / "torch.npz", torch_adapter.export(net, layout="keras"))
        fresh = build_keras()
        tf2.assign(fresh, root / "torch.npz")
        back = float(np.max(np.abs(fresh.predict(images, verbose=0) - expected)))
        print(f"PyTorch -> Keras: max abs difference {back:.2e}")
    return {"to_torch": to_torch, "back_to_keras": back, "assigned": sorted(report.assigned)}


if __name__ == "__main__":
    main()
