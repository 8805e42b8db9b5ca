"""Whole models across frameworks: PyTorch -> Keras -> PyTorch and PyTorch -> Flax, same predictions.

A CNN (convolutions, batch norm, a dense head), a recurrent model (LSTM then GRU) and a
small transformer block (attention, layer norms, feed-forward) are built the same way in
each framework, with the same layer names; only weightstore's layouts move the weights.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")
nnx = pytest.importorskip("flax.nnx")

from weightstore.adapters import flax as flax_adapter  # noqa: E402
from weightstore.adapters import tf2  # noqa: E402
from weightstore.adapters import torch as torch_adapter  # noqa: E402

nn = torch.nn
layers = keras.layers
TOLERANCE = 1e-5
EPS = 1e-5  # PyTorch's batch/layer norm epsilon; Keras's default is 1e-3: each model states it


class TorchCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)
        self.conv2, self.fc = nn.Conv2d(8, 6, 3, stride=2), nn.Linear(6, 4)

    def forward(self, x):  # channels last in, as Keras and Flax take it
        x = torch.relu(self.bn1(self.conv1(x.movedim(-1, 1))))
        return self.fc(torch.relu(self.conv2(x)).mean((2, 3)))


def keras_cnn():
    inputs = keras.Input((10, 10, 3))
    x = layers.ReLU()(layers.BatchNormalization(epsilon=EPS, name="bn1")(layers.Conv2D(8, 3, name="conv1")(inputs)))
    x = layers.GlobalAveragePooling2D()(layers.Conv2D(6, 3, strides=2, activation="relu", name="conv2")(x))
    return keras.Model(inputs, layers.Dense(4, name="fc")(x))


class FlaxCNN(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.conv1 = nnx.Conv(3, 8, (3, 3), padding="VALID", rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, epsilon=EPS, use_running_average=True, rngs=rngs)
        self.conv2 = nnx.Conv(8, 6, (3, 3), strides=2, padding="VALID", rngs=rngs)
        self.fc = nnx.Linear(6, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.conv1(x)))
        return self.fc(nnx.relu(self.conv2(x)).mean((1, 2)))


class TorchRecurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.gru = nn.LSTM(3, 5, batch_first=True), nn.GRU(5, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.gru(self.lstm(x)[0])[0][:, -1])


def keras_recurrent():
    inputs = keras.Input((6, 3))
    x = layers.LSTM(5, return_sequences=True, name="lstm")(inputs)
    x = layers.GRU(4, name="gru")(x)
    return keras.Model(inputs, layers.Dense(2, name="fc")(x))


class TorchBlock(nn.Module):
    def __init__(self, model=8, heads=2, hidden=16):
        super().__init__()
        self.attention = nn.MultiheadAttention(model, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(model, eps=EPS), nn.LayerNorm(model, eps=EPS)
        self.ff1, self.ff2 = nn.Linear(model, hidden), nn.Linear(hidden, model)

    def forward(self, x):
        x = self.norm1(x + self.attention(x, x, x, need_weights=False)[0])
        return self.norm2(x + self.ff2(torch.relu(self.ff1(x))))


def keras_block(model=8, heads=2, hidden=16):
    inputs = keras.Input((5, model))
    attended = layers.MultiHeadAttention(heads, model // heads, name="attention")(inputs, inputs)
    x = layers.LayerNormalization(epsilon=EPS, name="norm1")(inputs + attended)
    y = layers.Dense(model, name="ff2")(layers.Dense(hidden, activation="relu", name="ff1")(x))
    return keras.Model(inputs, layers.LayerNormalization(epsilon=EPS, name="norm2")(x + y))


class FlaxBlock(nnx.Module):
    def __init__(self, model=8, heads=2, hidden=16):
        rngs = nnx.Rngs(0)
        self.attention = nnx.MultiHeadAttention(heads, model, decode=False, rngs=rngs)
        self.norm1 = nnx.LayerNorm(model, epsilon=EPS, rngs=rngs)
        self.norm2 = nnx.LayerNorm(model, epsilon=EPS, rngs=rngs)
        self.ff1, self.ff2 = nnx.Linear(model, hidden, rngs=rngs), nnx.Linear(hidden, model, rngs=rngs)

    def __call__(self, x):
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.ff2(nnx.relu(self.ff1(x))))


# name: (PyTorch model, Keras model, Flax model or None, input shape)
MODELS = {
    "cnn": (TorchCNN, keras_cnn, FlaxCNN, (2, 10, 10, 3)),
    "recurrent": (TorchRecurrent, keras_recurrent, None, (2, 6, 3)),
    "transformer_block": (TorchBlock, keras_block, FlaxBlock, (2, 5, 8)),
}


def trained_like(module: nn.Module) -> nn.Module:
    """Random values everywhere, batch-norm statistics included, so no tensor can hide."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            if tensor.is_floating_point():
                values = torch.randn(tensor.shape, generator=generator) * 0.5
                tensor.copy_(values.abs() + 0.5 if name.endswith("running_var") else values)
    return module.eval()


def predict(module: nn.Module, inputs: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(inputs)).numpy()


@pytest.mark.parametrize("name", MODELS)
def test_pytorch_to_keras_and_back_predicts_the_same(name):
    make_torch, make_keras, _, shape = MODELS[name]
    source = trained_like(make_torch())
    inputs = np.random.default_rng(1).normal(size=shape).astype("float32")
    expected = predict(source, inputs)
    model = make_keras()
    assert tf2.assign(model, torch_adapter.export(source, layout="keras")).ok
    np.testing.assert_allclose(np.asarray(model(inputs, training=False)), expected, atol=TOLERANCE)
    back = make_torch().eval()
    report = torch_adapter.assign(back, tf2.export(model), layout="keras")
    assert report.ok
    np.testing.assert_allclose(predict(back, inputs), expected, atol=TOLERANCE)


@pytest.mark.parametrize("name", [name for name, (*_, flax_model, _) in MODELS.items() if flax_model])
@pytest.mark.slow  # Flax's compile of each model
def test_pytorch_to_flax_predicts_the_same(name):
    make_torch, _, make_flax, shape = MODELS[name]
    source = trained_like(make_torch())
    inputs = np.random.default_rng(1).normal(size=shape).astype("float32")
    module = make_flax()
    assert flax_adapter.assign(module, torch_adapter.export(source, layout="keras"), layout="keras").ok
    np.testing.assert_allclose(np.asarray(module(inputs)), predict(source, inputs), atol=TOLERANCE)


@pytest.mark.parametrize("name", MODELS)
def test_a_keras_archive_ports_to_pytorch_and_flax_as_its_model_does(name, tmp_path):
    """A ``.keras`` file read on its own is keyed as ``tf2.export`` keys its model, so
    ``layout="keras"`` takes it straight into a PyTorch or Flax module of the same layers."""
    make_torch, make_keras, make_flax, shape = MODELS[name]
    model = make_keras()
    assert tf2.assign(model, torch_adapter.export(trained_like(make_torch()), layout="keras")).ok  # nothing left at init
    model.save(tmp_path / "m.keras")
    inputs = np.random.default_rng(1).normal(size=shape).astype("float32")
    expected = np.asarray(model(inputs, training=False))
    module = make_torch().eval()
    assert torch_adapter.assign(module, str(tmp_path / "m.keras"), layout="keras").ok
    np.testing.assert_allclose(predict(module, inputs), expected, atol=TOLERANCE)
    if make_flax is not None:
        flax_module = make_flax()
        assert flax_adapter.assign(flax_module, tmp_path / "m.keras", layout="keras").ok
        np.testing.assert_allclose(np.asarray(flax_module(inputs)), expected, atol=TOLERANCE)
