"""``keras.applications`` ResNet50 and MobileNetV2 weights into torchvision's ``resnet50`` and ``mobilenet_v2``.

The weights convert with ``layout="keras"`` (kernels transposed, batch norm renamed, depthwise
kernels folded); what remains is where the two implementations differ *as networks*, which no
file records. Each difference is one of the lines below (docs/porting-keras-applications.md
explains them):

- **names**: Keras names layers ``conv2_block1_1_conv``, torchvision ``layer1.0.conv1``: a
  ``mapping=`` (:func:`resnet50_mapping`, :func:`mobilenet_v2_mapping`).
- **conv biases folded into batch norm** (ResNet50): Keras's convolutions have biases,
  torchvision's are built with ``bias=False``; each bias moves into the following batch norm's
  mean (:func:`keras_resnet50_weights`, with ``layout.fold_bias_into_norm``).
- **v1 vs v1.5 stride** (ResNet50): Keras's ResNet50 is v1 (the stride-2 of a stage's first block
  in its 1x1 ``_1_conv``), torchvision's v1.5 (in the 3x3 ``conv2``): move it back
  (:func:`match_resnet50_v1`).
- **epsilon**: Keras's batch norms use 1.001e-5 (ResNet50) and 1e-3 (MobileNetV2), torchvision's
  1e-5 (:func:`match_resnet50_v1`, :func:`match_mobilenet_v2`).
- **TF "same" padding for stride-2 convolutions** (MobileNetV2): TensorFlow pads an even-sized
  input by 0 before and 1 after, PyTorch's ``padding=1`` by 1 on both sides, shifting every
  later activation: :func:`pad_like_tensorflow` on those convolutions.

Keras ends in a softmax, torchvision in logits: compare ``softmax(torch_output)`` with Keras's.
Run: ``python -m examples.keras_applications_to_torchvision`` (torchvision needed; the tests
use modules written with torchvision's parameter names instead).
"""

from __future__ import annotations

from typing import Any

#: (torchvision stage, Keras stage, blocks) of ResNet50
RESNET50_STAGES = ((1, 2, 3), (2, 3, 4), (3, 4, 6), (4, 5, 3))
#: torchvision's features index of each Keras MobileNetV2 block (block_1 .. block_16) is the block + 1
MOBILENET_V2_BLOCKS = 16
#: the torchvision MobileNetV2 features whose convolution has stride 2 (Keras's Conv1, block_1/3/6/13)
MOBILENET_V2_STRIDED = ("features/0/0", "features/2/conv/1/0", "features/4/conv/1/0", "features/7/conv/1/0",
                        "features/14/conv/1/0")


def resnet50_mapping() -> list[str]:
    """``FROM=TO`` rules from Keras's ResNet50 layer names to torchvision's module paths."""
    rules = ["conv1_conv=conv1", "conv1_bn=bn1", "predictions=fc"]
    for layer, stage, blocks in RESNET50_STAGES:
        for block in range(1, blocks + 1):
            keras, torch = f"conv{stage}_block{block}", f"layer{layer}/{block - 1}"
            rules += [f"{keras}_{i}_conv={torch}/conv{i}" for i in (1, 2, 3)]
            rules += [f"{keras}_{i}_bn={torch}/bn{i}" for i in (1, 2, 3)]
            if block == 1:
                rules += [f"{keras}_0_conv={torch}/downsample/0", f"{keras}_0_bn={torch}/downsample/1"]
    return rules


def keras_resnet50_weights(model: Any) -> dict:
    """``tf2.export(model)`` with every convolution's bias folded into the batch norm after it."""
    from weightstore.adapters import layout, tf2

    weights = tf2.export(model)
    for key in [k for k in weights if k.endswith("_conv/bias")]:
        conv = key[: -len("/bias")]
        weights = layout.fold_bias_into_norm(weights, conv, conv[: -len("_conv")] + "_bn")
    return weights


def match_resnet50_v1(net: Any) -> Any:
    """torchvision's ResNet50 made to compute Keras's: v1 strides, Keras's epsilon."""
    from torch import nn

    for stage in (net.layer2, net.layer3, net.layer4):
        stage[0].conv1.stride, stage[0].conv2.stride = (2, 2), (1, 1)
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eps = 1.001e-5
    return net


def mobilenet_v2_mapping() -> list[str]:
    """``FROM=TO`` rules from Keras's MobileNetV2 layer names to torchvision's module paths."""
    rules = ["Conv1=features/0/0", "bn_Conv1=features/0/1",
             "expanded_conv_depthwise=features/1/conv/0/0", "expanded_conv_depthwise_BN=features/1/conv/0/1",
             "expanded_conv_project=features/1/conv/1", "expanded_conv_project_BN=features/1/conv/2",
             "Conv_1=features/18/0", "Conv_1_bn=features/18/1", "predictions=classifier/1"]
    for block in range(1, MOBILENET_V2_BLOCKS + 1):
        torch = f"features/{block + 1}/conv"
        rules += [f"block_{block}_expand={torch}/0/0", f"block_{block}_expand_BN={torch}/0/1",
                  f"block_{block}_depthwise={torch}/1/0", f"block_{block}_depthwise_BN={torch}/1/1",
                  f"block_{block}_project={torch}/2", f"block_{block}_project_BN={torch}/3"]
    return rules


def pad_like_tensorflow(conv: Any) -> None:
    """Make a stride-2 3x3 ``conv`` pad as TensorFlow's ``"same"`` does an even-sized input: 0
    before, 1 after (PyTorch's ``padding=1`` pads 1 on both sides). Parameter names are kept."""
    import torch.nn.functional as F

    conv.padding = (0, 0)
    conv.register_forward_pre_hook(lambda module, args: (F.pad(args[0], (0, 1, 0, 1)), *args[1:]))


def match_mobilenet_v2(net: Any) -> Any:
    """torchvision's MobileNetV2 made to compute Keras's: TF padding on stride-2 convs, Keras's epsilon."""
    from torch import nn

    modules = dict(net.named_modules())
    for path in MOBILENET_V2_STRIDED:
        pad_like_tensorflow(modules[path.replace("/", ".")])
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eps = 1e-3
    return net


def main() -> None:  # pragma: no cover - needs torchvision
    import keras
    import numpy as np
    import torch
    import torchvision

    from weightstore.adapters import tf2
    from weightstore.adapters import torch as torch_adapter

    images = np.random.default_rng(0).uniform(-1, 1, (1, 224, 224, 3)).astype("float32")
    resnet = keras.applications.ResNet50()
    mobilenet = keras.applications.MobileNetV2()
    ports = (("ResNet50", resnet, keras_resnet50_weights(resnet), match_resnet50_v1(torchvision.models.resnet50()),
              resnet50_mapping()),
             ("MobileNetV2", mobilenet, tf2.export(mobilenet), match_mobilenet_v2(torchvision.models.mobilenet_v2()),
              mobilenet_v2_mapping()))
    for name, model, weights, net, mapping in ports:
        torch_adapter.assign(net, weights, layout="keras", mapping=mapping)
        with torch.no_grad():
            ours = torch.softmax(net.eval()(torch.from_numpy(images).permute(0, 3, 1, 2)), -1).numpy()
        print(f"{name}: max |difference| of the probabilities {np.abs(ours - np.asarray(model(images))).max():.2e}")


if __name__ == "__main__":  # pragma: no cover
    main()
