"""keras.applications ResNet50 and MobileNetV2 into torchvision's architectures, as the recipe says.

torchvision's CPU wheel for this torch build is not installable (PyPI's fails to load its
operators on a CPU-only torch), so the PyTorch side is torchvision's ``resnet50`` and
``mobilenet_v2`` written out with torchvision's parameter names and defaults (v1.5 strides,
``bias=False`` convolutions, epsilon 1e-5, symmetric padding); the recipe's lines
(examples.keras_applications_to_torchvision) then make them compute what Keras computes.
Keras's models are built with random weights (``weights=None``) at 64x64 to stay fast.
"""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")

import weightstore as ws  # noqa: E402
from examples import keras_applications_to_torchvision as recipe  # noqa: E402
from weightstore.adapters import tf2  # noqa: E402
from weightstore.adapters import torch as torch_adapter  # noqa: E402

nn = torch.nn
SIZE = 64


class Bottleneck(nn.Module):
    """torchvision.models.resnet.Bottleneck (v1.5: the stride in conv2)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, planes * 4, 1, bias=False), nn.BatchNorm2d(planes * 4)
        self.relu, self.downsample = nn.ReLU(), downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn3(self.conv3(self.relu(self.bn2(self.conv2(out)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision.models.resnet50(), parameter for parameter."""

    def __init__(self, classes: int = 1000):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64)
        self.relu, self.maxpool = nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1)
        self.inplanes = 64
        self.layer1, self.layer2 = self._layer(64, 3, 1), self._layer(128, 4, 2)
        self.layer3, self.layer4 = self._layer(256, 6, 2), self._layer(512, 3, 2)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(2048, classes)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * 4, 1, stride=stride, bias=False),
                                   nn.BatchNorm2d(planes * 4))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * 4
        return nn.Sequential(*layers, *(Bottleneck(self.inplanes, planes) for _ in range(blocks - 1)))

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def conv_norm_act(inputs: int, outputs: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> nn.Sequential:
    """torchvision.ops.Conv2dNormActivation with ReLU6, as mobilenet_v2 builds it."""
    return nn.Sequential(nn.Conv2d(inputs, outputs, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(outputs), nn.ReLU6())


class InvertedResidual(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int, expand: int):
        super().__init__()
        hidden = inputs * expand
        self.use_res_connect = stride == 1 and inputs == outputs
        layers = [conv_norm_act(inputs, hidden, 1)] if expand != 1 else []
        layers += [conv_norm_act(hidden, hidden, 3, stride, hidden), nn.Conv2d(hidden, outputs, 1, bias=False),
                   nn.BatchNorm2d(outputs)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """torchvision.models.mobilenet_v2(), parameter for parameter."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2),
                (6, 320, 1, 1))

    def __init__(self, classes: int = 1000):
        super().__init__()
        features, channels = [conv_norm_act(3, 32, stride=2)], 32
        for expand, outputs, repeats, stride in self.SETTINGS:
            for i in range(repeats):
                features.append(InvertedResidual(channels, outputs, stride if i == 0 else 1, expand))
                channels = outputs
        self.features = nn.Sequential(*features, conv_norm_act(channels, 1280, 1))
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))


def calibrated(model):
    """Random scales, offsets and biases, and batch-norm statistics measured on a batch of images
    (momentum 0 for one training step), so activations stay in range through the whole network
    and its outputs depend on its input: a wrong epsilon, stride or padding shows."""
    rng = np.random.default_rng(0)
    for var in model.weights:
        if var.path.endswith("gamma"):
            var.assign(rng.uniform(0.5, 1.5, var.shape).astype("float32"))
        elif var.path.endswith(("beta", "bias")):
            var.assign(rng.normal(0, 0.1, var.shape).astype("float32"))
    norms = [layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)]
    for layer in norms:
        layer.momentum = 0.0
    model(rng.uniform(-1, 1, (8, SIZE, SIZE, 3)).astype("float32"), training=True)
    return model


def torch_logits(net, inputs):
    """``net``'s logits on the images Keras's model saw (channels first)."""
    with torch.no_grad():
        return net.eval()(torch.from_numpy(inputs).permute(0, 3, 1, 2)).numpy()


def assert_same_predictions(expected, got):
    """Softmax probabilities within 1e-4 and the same classes; the logits as close as float32
    arithmetic through some fifty layers leaves them (1e-4 of their scale). The probabilities'
    gap moves with the thread count's summation order (0.7e-5 to 1.4e-5 measured at 64x64), so
    it is held to the order float32 leaves, not to one machine's figure."""
    probabilities = [np.exp(x - x.max(-1, keepdims=True)) for x in (expected, got)]
    probabilities = [p / p.sum(-1, keepdims=True) for p in probabilities]
    assert np.abs(probabilities[0] - probabilities[1]).max() <= 1e-4
    assert (got.argmax(-1) == expected.argmax(-1)).all()
    scale = float(np.abs(expected).max())
    assert np.abs(got - expected).max() <= 1e-4 * scale, (np.abs(got - expected).max(), scale)


def differs(expected, got) -> bool:
    return np.abs(got - expected).max() > 1e-2 * float(np.abs(expected).max())


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(1).uniform(-1, 1, (2, SIZE, SIZE, 3)).astype("float32")


@pytest.fixture(scope="module")
def keras_resnet50():
    keras.utils.set_random_seed(0)  # Keras's own initial kernels: the same model every run
    return calibrated(keras.applications.ResNet50(weights=None, input_shape=(SIZE, SIZE, 3),
                                                              classifier_activation=None))


@pytest.fixture(scope="module")
def keras_mobilenet_v2():
    keras.utils.set_random_seed(0)
    return calibrated(keras.applications.MobileNetV2(weights=None, input_shape=(SIZE, SIZE, 3),
                                                                 classifier_activation=None))


@pytest.fixture(scope="module")
def resnet50_weights(keras_resnet50):
    return recipe.keras_resnet50_weights(keras_resnet50)


@pytest.fixture(scope="module")
def resnet50_logits(keras_resnet50, images):
    """Keras's logits (built without its softmax), computed once for every net compared with them."""
    return np.asarray(keras_resnet50(images, training=False))


@pytest.fixture(scope="module")
def mobilenet_v2_weights(keras_mobilenet_v2):
    return tf2.export(keras_mobilenet_v2)


@pytest.fixture(scope="module")
def mobilenet_v2_logits(keras_mobilenet_v2, images):
    return np.asarray(keras_mobilenet_v2(images, training=False))


def test_resnet50_into_torchvisions_resnet50_as_the_recipe_says(resnet50_weights, resnet50_logits, images):
    net = recipe.match_resnet50_v1(ResNet50())
    report = torch_adapter.assign(net, resnet50_weights, layout="keras", mapping=recipe.resnet50_mapping())
    assert report.ok and len(report.assigned) == len(net.state_dict()) - 53  # num_batches_tracked left as is
    assert_same_predictions(resnet50_logits, torch_logits(net, images))


def test_resnet50_pitfalls_each_change_the_predictions(keras_resnet50, resnet50_weights, resnet50_logits, images):
    """Leave out a line of the recipe and the outputs differ, or the assign refuses: each is needed."""
    v15 = ResNet50()  # torchvision's strides and epsilon as they are
    torch_adapter.assign(v15, resnet50_weights, layout="keras", mapping=recipe.resnet50_mapping())
    assert differs(resnet50_logits, torch_logits(v15, images))
    with pytest.raises(Exception, match="fold_bias_into_norm"):  # the biases, not folded, have nowhere to go
        torch_adapter.assign(recipe.match_resnet50_v1(ResNet50()), tf2.export(keras_resnet50), layout="keras",
                             mapping=recipe.resnet50_mapping())


@pytest.mark.slow  # a whole MobileNetV2 each way
def test_mobilenet_v2_into_torchvisions_mobilenet_v2_as_the_recipe_says(mobilenet_v2_weights, mobilenet_v2_logits,
                                                                       images):
    net = recipe.match_mobilenet_v2(MobileNetV2())
    report = torch_adapter.assign(net, mobilenet_v2_weights, layout="keras", mapping=recipe.mobilenet_v2_mapping())
    assert report.ok
    assert_same_predictions(mobilenet_v2_logits, torch_logits(net, images))
    unpadded = MobileNetV2()  # symmetric padding and torchvision's epsilon: not what Keras computes
    torch_adapter.assign(unpadded, mobilenet_v2_weights, layout="keras", mapping=recipe.mobilenet_v2_mapping())
    assert differs(mobilenet_v2_logits, torch_logits(unpadded, images))


@pytest.mark.parametrize("fixture", ["keras_mobilenet_v2", "keras_resnet50"])
def test_a_saved_application_opens_keyed_as_tf2_exports_it(request, tmp_path, fixture):
    """The .keras archive's config alone keys its tensors: no Keras builds anything to read it."""
    model = request.getfixturevalue(fixture)
    model.save(tmp_path / "m.keras")
    exported = tf2.export(model)
    with ws.open(tmp_path / "m.keras") as store:
        assert store.keys() == list(exported)
        for key, value in exported.items():
            np.testing.assert_array_equal(store[key], value)
