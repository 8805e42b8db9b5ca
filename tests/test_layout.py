"""Layout rules: each one, both directions, checked against what Keras, PyTorch and Flax compute.

Every Keras layer the tables cover gets random weights (batch-norm statistics included),
goes into the equivalent PyTorch and Flax layer with ``layout="keras"``, and the outputs must
agree; the framework's export with the layout must then give back Keras's exact tensors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

keras = pytest.importorskip("keras")
torch = pytest.importorskip("torch")
nnx = pytest.importorskip("flax.nnx")

from typer.testing import CliRunner  # noqa: E402

import weightstore as ws  # noqa: E402
from weightstore.adapters import flax as flax_adapter  # noqa: E402
from weightstore.adapters import layout, tf2  # noqa: E402
from weightstore.adapters import torch as torch_adapter  # noqa: E402
from weightstore.cli.main import app  # noqa: E402
from weightstore.errors import AssignmentError, LayoutError  # noqa: E402

nn = torch.nn
RNGS = nnx.Rngs(0)
ZEROS = nnx.initializers.zeros_init()  # random initializers compile once per shape: seconds each

# name: (Keras layer, input shape (channels last), PyTorch module, Flax module)
LAYERS = {
    "dense": (lambda: keras.layers.Dense(4), (2, 3), lambda: nn.Linear(3, 4),
              lambda: nnx.Linear(3, 4, kernel_init=ZEROS, rngs=RNGS)),
    "conv1d": (lambda: keras.layers.Conv1D(4, 3), (2, 7, 3), lambda: nn.Conv1d(3, 4, 3),
               lambda: nnx.Conv(3, 4, (3,), padding="VALID", kernel_init=ZEROS, rngs=RNGS)),
    "conv2d": (lambda: keras.layers.Conv2D(4, (3, 2)), (2, 6, 5, 3), lambda: nn.Conv2d(3, 4, (3, 2)),
               lambda: nnx.Conv(3, 4, (3, 2), padding="VALID", kernel_init=ZEROS, rngs=RNGS)),
    "conv3d": (lambda: keras.layers.Conv3D(4, (3, 2, 2)), (2, 5, 4, 4, 3), lambda: nn.Conv3d(3, 4, (3, 2, 2)),
               lambda: nnx.Conv(3, 4, (3, 2, 2), padding="VALID", kernel_init=ZEROS, rngs=RNGS)),
    "depthwise1d": (lambda: keras.layers.DepthwiseConv1D(3, depth_multiplier=2), (2, 7, 3),
                    lambda: nn.Conv1d(3, 6, 3, groups=3),
                    lambda: nnx.Conv(3, 6, (3,), padding="VALID", feature_group_count=3, kernel_init=ZEROS, rngs=RNGS)),
    "depthwise2d": (lambda: keras.layers.DepthwiseConv2D((3, 2), depth_multiplier=2), (2, 6, 5, 3),
                    lambda: nn.Conv2d(3, 6, (3, 2), groups=3),
                    lambda: nnx.Conv(3, 6, (3, 2), padding="VALID", feature_group_count=3, kernel_init=ZEROS,
                                     rngs=RNGS)),
    "batch_norm": (lambda: keras.layers.BatchNormalization(), (2, 3), lambda: nn.BatchNorm1d(3, eps=1e-3),
                   lambda: nnx.BatchNorm(3, epsilon=1e-3, use_running_average=True, rngs=RNGS)),
    "layer_norm": (lambda: keras.layers.LayerNormalization(), (2, 3), lambda: nn.LayerNorm(3, eps=1e-3),
                   lambda: nnx.LayerNorm(3, epsilon=1e-3, rngs=RNGS)),
}


def random_keras(name: str, seed: int = 0):
    make, shape, _, _ = LAYERS[name]
    layer = make()
    layer.build(shape)
    rng = np.random.default_rng(seed)
    for var in layer.weights:
        value = rng.normal(size=var.shape).astype("float32")
        var.assign(np.abs(value) + 0.5 if "variance" in var.path else value)
    images = rng.normal(size=shape).astype("float32")
    return layer, images, np.asarray(layer(images, training=False))


def torch_call(module, images: np.ndarray) -> np.ndarray:
    """The module on channels-last input, as channels-first in and channels-last out."""
    x = torch.from_numpy(images)
    if x.ndim > 2:
        x = x.movedim(-1, 1)
    with torch.no_grad():
        y = module.eval()(x)
    return (y.movedim(1, -1) if y.ndim > 2 else y).numpy()


@pytest.mark.parametrize("name", LAYERS)
def test_keras_layer_into_torch_and_back(name):
    layer, images, expected = random_keras(name)
    weights = tf2.export(layer)
    module = LAYERS[name][2]()
    report = torch_adapter.assign(module, weights, layout="keras")
    assert report.ok and report.assigned
    np.testing.assert_allclose(torch_call(module, images), expected, atol=1e-5)
    back = torch_adapter.export(module, layout="keras")
    assert back.keys() == weights.keys()
    for key in weights:
        np.testing.assert_array_equal(back[key], weights[key], err_msg=key)


@pytest.mark.parametrize("name", LAYERS)
def test_keras_layer_into_flax_and_back(name):
    layer, images, expected = random_keras(name)
    weights = tf2.export(layer)
    module = LAYERS[name][3]()
    report = flax_adapter.assign(module, weights, layout="keras")
    assert report.ok and report.assigned
    np.testing.assert_allclose(np.asarray(module(images)), expected, atol=1e-5)
    back = flax_adapter.export(module, layout="keras")
    assert back.keys() == weights.keys()
    for key in weights:
        np.testing.assert_array_equal(back[key], weights[key], err_msg=key)


def test_keras2_and_tf1_depthwise_kernel_name_is_read_too():
    layer, images, expected = random_keras("depthwise2d")
    weights = {"depthwise_kernel" if k == "kernel" else k: v for k, v in tf2.export(layer).items()}
    module = LAYERS["depthwise2d"][2]()
    torch_adapter.assign(module, weights, layout="keras")
    np.testing.assert_allclose(torch_call(module, images), expected, atol=1e-5)


def test_every_rule_round_trips_on_arrays():
    rng = np.random.default_rng(0)
    for table in (layout.KERAS_TO_TORCH, layout.KERAS_TO_FLAX):
        for rule in table.rules:
            shape = (3, 2, 4, 2, 5)[: rule.rank or 1]
            value = rng.normal(size=shape)
            other = rule.to_other(value)
            assert other.shape == rule.to_other_shape(shape)
            groups = shape[-2] if rule.fold else 1
            assert rule.to_keras_shape(other.shape, groups) == shape
            np.testing.assert_array_equal(rule.to_keras(other, groups), value)


def test_a_tensor_no_rule_covers_is_refused_and_nothing_changes():
    module = nn.Linear(3, 4)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    weights = {"kernel": np.ones((3, 4), np.float32), "bias": np.ones(4, np.float32), "alpha": np.ones(2, np.float32)}
    with pytest.raises(AssignmentError) as info:
        torch_adapter.assign(module, weights, layout="keras")
    assert "alpha" in str(info.value) and "no torch layout rule for a rank-1 'alpha'" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
    report = torch_adapter.assign(module, weights, layout="keras", strict=False)
    assert sorted(report.assigned) == ["bias", "weight"] and [m.key for m in report.mismatched] == ["alpha"]
    report = torch_adapter.assign(module, weights, layout="keras", exclude="alpha")  # excluded: not reported
    assert report.ok


def test_two_tensors_that_would_share_a_name_are_both_refused():
    module = nn.BatchNorm1d(2)
    weights = {"beta": np.ones(2, np.float32), "bias": np.ones(2, np.float32), "gamma": np.ones(2, np.float32)}
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(AssignmentError, match="'beta' and 'bias' would both become 'bias'"):
        torch_adapter.assign(module, weights, layout="keras")
    report = torch_adapter.assign(module, weights, layout="keras", strict=False)
    assert report.assigned == ["weight"] and sorted(m.key for m in report.mismatched) == ["beta", "bias"]
    assert torch.equal(module.bias, before["bias"])


def test_an_unknown_layout_name_is_a_layout_error():
    with pytest.raises(LayoutError, match="'pytorch'"):
        torch_adapter.assign(nn.Linear(2, 2), {"kernel": np.ones((2, 2), np.float32)}, layout="pytorch")
    with pytest.raises(LayoutError, match="'pytorch'"):
        flax_adapter.export(nnx.Linear(2, 2, kernel_init=ZEROS, rngs=RNGS), layout="pytorch")


def test_custom_rule_extends_the_table_for_a_custom_module():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.zeros(3))

    module = nn.Sequential()
    module.add_module("scale", Scale())
    with pytest.raises(LayoutError) as info:
        torch_adapter.export(module, layout="keras")
    assert "scale/alpha" in str(info.value) and "'Scale'" in str(info.value)
    rules = layout.KERAS_TO_TORCH.extended(layout.Rule(("Scale",), "gamma", "alpha"))
    exported = torch_adapter.export(module, layout=rules)
    assert list(exported) == ["scale/gamma"]
    torch_adapter.assign(module, {"scale/gamma": np.arange(3, dtype=np.float32)}, layout=rules)
    assert module.scale.alpha.tolist() == [0.0, 1.0, 2.0]


def test_grouped_convolutions_convert_both_ways():
    """Both frameworks split the channels into groups in order, and keep a grouped kernel as a
    plain one of in/groups input channels: the convolution's rule converts it (it was refused)."""
    converts_both_ways(keras.layers.Conv2D(6, 3, groups=2), nn.Conv2d(4, 6, 3, groups=2), (2, 5, 5, 4))


def converts_both_ways(layer, module, shape) -> None:
    """``layer`` given random weights, assigned into ``module`` with the Keras layout: both
    compute the same, and ``module`` exports back what ``layer`` holds."""
    images = np.random.default_rng(0).normal(size=shape).astype("float32")
    layer.build(shape)
    for var in layer.weights:
        var.assign(np.random.default_rng(1).normal(size=var.shape).astype("float32"))
    assert torch_adapter.assign(module, tf2.export(layer), layout="keras").ok
    np.testing.assert_allclose(torch_call(module, images), np.asarray(layer(images)), atol=1e-5)
    back = torch_adapter.export(module, layout="keras")
    for key, value in tf2.export(layer).items():
        np.testing.assert_array_equal(back[key], value)


def test_grouped_transposed_convolutions_are_refused_not_guessed():
    module = nn.Sequential(nn.ConvTranspose2d(4, 4, 3, groups=2))
    with pytest.raises(LayoutError) as info:
        torch_adapter.export(module, layout="keras")
    assert "0/weight" in str(info.value) and "'ConvTranspose2d'" in str(info.value)


@pytest.mark.parametrize("rank", [1, 2])
def test_transposed_convolutions_convert_both_ways(rank):
    """Keras's ``[*spatial, out, in]`` kernel is PyTorch's ``[in, out, *spatial]`` reversed, as a
    convolution's is; both frameworks define the transposed convolution as the convolution's adjoint."""
    layer = (keras.layers.Conv1DTranspose if rank == 1 else keras.layers.Conv2DTranspose)(4, 3, strides=2)
    module = (nn.ConvTranspose1d if rank == 1 else nn.ConvTranspose2d)(3, 4, 3, stride=2)
    converts_both_ways(layer, module, (2, 5, 3) if rank == 1 else (2, 5, 4, 3))


def test_torch_export_leaves_num_batches_tracked_out_with_a_layout():
    exported = torch_adapter.export(nn.BatchNorm2d(3), layout="keras")
    assert sorted(exported) == ["beta", "gamma", "moving_mean", "moving_variance"]


def test_kinds_from_names_reads_a_scope_by_its_tensors():
    shapes = {"fc/weight": (4, 3), "fc/bias": (4,), "bn/weight": (4,), "bn/bias": (4,), "bn/running_mean": (4,),
              "ln/weight": (4,), "ln/bias": (4,), "conv/weight": (4, 3, 3, 3), "odd/thing": (2,)}
    kinds = layout.kinds_from_names(layout.KERAS_TO_TORCH, shapes)
    assert kinds == {"fc/weight": "dense", "fc/bias": "dense", "bn/weight": "norm", "bn/bias": "norm",
                     "bn/running_mean": "norm", "ln/weight": "norm", "ln/bias": "norm", "conv/weight": "conv"}


def test_cli_convert_with_a_layout_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    keras_weights = {"fc/kernel": rng.normal(size=(3, 4)), "fc/bias": rng.normal(size=4),
                     "conv/kernel": rng.normal(size=(3, 3, 2, 5)), "bn/gamma": rng.normal(size=5),
                     "bn/beta": rng.normal(size=5), "bn/moving_mean": rng.normal(size=5),
                     "bn/moving_variance": rng.normal(size=5)}
    ws.save(tmp_path / "keras.npz", keras_weights)
    runner = CliRunner()
    result = runner.invoke(app, ["convert", str(tmp_path / "keras.npz"), str(tmp_path / "torch.npz"),
                                 "--layout", "keras-to-torch"])
    assert result.exit_code == 0, result.output
    with np.load(tmp_path / "torch.npz") as file:  # named as load_state_dict takes them
        torch_weights = {name: file[name] for name in file.files if name != "__weightstore__"}
    assert sorted(torch_weights) == ["bn.bias", "bn.running_mean", "bn.running_var", "bn.weight", "conv.weight",
                                     "fc.bias", "fc.weight"]
    assert sorted(ws.load(tmp_path / "torch.npz")) == [name.replace(".", "/") for name in sorted(torch_weights)]
    assert torch_weights["conv.weight"].shape == (5, 2, 3, 3) and torch_weights["fc.weight"].shape == (4, 3)
    result = runner.invoke(app, ["convert", str(tmp_path / "torch.npz"), str(tmp_path / "back.h5"),
                                 "--layout", "torch-to-keras"])
    assert result.exit_code == 0, result.output
    back = ws.load(tmp_path / "back.h5")
    assert back.keys() == keras_weights.keys()
    for key, value in keras_weights.items():
        np.testing.assert_array_equal(back[key], value)


def test_cli_convert_of_a_keras_file_with_a_layout_keys_it_by_its_model(tmp_path):
    """Keras's files name tensors by its save walk (layers/dense/vars/0), which no layout rule
    reads: ws convert --help's own example failed naming every tensor."""
    from safetensors.torch import load_file

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(2, name="out")])
    x = np.random.default_rng(0).random((5, 3)).astype("float32")
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    module = torch.nn.ModuleDict({"hidden": torch.nn.Linear(3, 4), "out": torch.nn.Linear(4, 2)})
    runner = CliRunner()
    for args in (["m.keras"], ["m.weights.h5", "--model", "m.keras"]):
        result = runner.invoke(app, ["convert", str(tmp_path / args[0]), str(tmp_path / "t.safetensors"),
                                     "--layout", "keras-to-torch", *[str(tmp_path / a) if a.endswith(".keras") else a
                                                                     for a in args[1:]]])
        assert result.exit_code == 0, result.output
        module.load_state_dict(load_file(tmp_path / "t.safetensors"))
        with torch.no_grad():
            got = module["out"](module["hidden"](torch.from_numpy(x))).numpy()
        np.testing.assert_allclose(got, np.asarray(model(x)), atol=1e-6)
    result = runner.invoke(app, ["convert", str(tmp_path / "m.weights.h5"), str(tmp_path / "u.safetensors"),
                                 "--layout", "keras-to-torch"])
    assert result.exit_code == 1 and "--model model.keras" in result.output
    result = runner.invoke(app, ["convert", str(tmp_path / "t.safetensors"), str(tmp_path / "u.npz"),
                                 "--layout", "torch-to-keras", "--model", str(tmp_path / "m.keras")])
    assert result.exit_code == 2 and "torch-to-keras does not read" in " ".join(result.output.replace("│", "").split())
    assert not (tmp_path / "u.safetensors").exists() and not (tmp_path / "u.npz").exists()


def test_cli_convert_names_the_file_and_the_tensor_no_rule_covers(tmp_path):
    ws.save(tmp_path / "odd.npz", {"fc/kernel": np.ones((2, 3)), "fc/alpha": np.ones(3)})
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "odd.npz"), str(tmp_path / "out.npz"),
                                      "--layout", "keras-to-torch", "--json"])
    assert result.exit_code == 1
    assert str(tmp_path / "odd.npz") in result.output and "fc/alpha" in result.output
    assert json.loads(result.stdout)["error"]["path"] == str(tmp_path / "odd.npz")
    assert not (tmp_path / "out.npz").exists()
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "odd.npz"), str(tmp_path / "out.npz"),
                                      "--layout", "keras-to-mxnet"])
    assert result.exit_code == 2 and "keras-to-mxnet" in result.output and not (tmp_path / "out.npz").exists()


def test_a_mapping_with_a_layout_reads_the_converted_names():
    """With ``layout="keras"`` a mapping sees the names the layout made (``batch_normalization/weight``):
    a scope rule reads the same either way, and a rule in Keras's own leaf names (``*/gamma``) is
    refused naming the converted keys, as frameworks.md says."""
    module = nn.Module()
    module.fc, module.norm = nn.Linear(4, 8), nn.BatchNorm1d(8)
    rng = np.random.default_rng(5)
    weights = {"dense/kernel": rng.normal(size=(4, 8)).astype("float32"), "dense/bias": np.zeros(8, "float32"),
               **{f"batch_normalization/{name}": rng.random(8).astype("float32")
                  for name in ("gamma", "beta", "moving_mean", "moving_variance")}}
    report = torch_adapter.assign(module, weights, layout="keras", mapping={"dense": "fc", "batch_normalization": "norm"})
    assert len(report.assigned) == 6
    np.testing.assert_array_equal(module.fc.weight.detach().numpy(), weights["dense/kernel"].T)
    np.testing.assert_array_equal(module.norm.weight.detach().numpy(), weights["batch_normalization/gamma"])
    with pytest.raises(ws.errors.SelectionError, match=r"mapping \*/gamma=\*/weight matches no key.*"
                                                       r"'batch_normalization/weight'"):
        torch_adapter.assign(module, weights, layout="keras", mapping=["dense=fc", "*/gamma=*/weight"])


def _hf_folder(folder, module) -> None:
    """``module``'s state_dict as a Hugging Face sharded folder: safetensors shards, torch names, an index."""
    from safetensors.torch import save_file

    folder.mkdir()
    names = list(module.state_dict())
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: t.contiguous() for n, t in module.state_dict().items() if weight_map[n] == shard},
                  str(folder / shard), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_torch_folder_into_keras_says_to_convert_it_and_the_conversion_predicts_alike(tmp_path):
    """A Hugging Face folder mapped onto a Keras model's layer names was refused with "the
    weights and the model look like different architectures": its tensors are PyTorch's
    (``fc/weight``, ``[out, in]``) and the error never named the conversion that fits them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8, eps=1e-3), nn.Linear(8, 3)).eval()
    _hf_folder(tmp_path / "hf", net)
    inputs = keras.Input((6,))
    hidden = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(8, name="fc")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(3, name="proj")(hidden))
    mapping = {"0": "fc", "1": "norm", "2": "proj"}
    with pytest.raises(AssignmentError, match=r"PyTorch's names and layouts of the model's layers \(fc/weight for "
                       r"fc/kernel\): convert them first, `ws convert SRC OUT.npz --layout torch-to-keras`"):
        tf2.assign(model, tmp_path / "hf", mapping=mapping)
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "hf"), str(tmp_path / "keras.npz"),
                                      "--layout", "torch-to-keras"])
    assert result.exit_code == 0, result.output
    tf2.assign(model, tmp_path / "keras.npz", mapping=mapping)
    images = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    np.testing.assert_allclose(model.predict(images, verbose=0), torch_call(net, images), atol=1e-5)


@pytest.mark.parametrize("framework", ["torch", "flax"])
def test_keras_weights_without_a_layout_are_refused_naming_layout_keras(framework):
    """Keras's tensors given to a PyTorch or Flax module without ``layout="keras"`` said the two
    "look like different architectures", though every layer is the module's."""
    layer, _, _ = random_keras("batch_norm")
    weights = {f"bn/{var.name}": np.asarray(var) for var in layer.weights}
    if framework == "torch":
        module, adapter = nn.Sequential(), torch_adapter
        module.add_module("bn", nn.BatchNorm1d(3, eps=1e-3))
    else:
        module, adapter = nnx.Dict(bn=nnx.BatchNorm(3, epsilon=1e-3, use_running_average=True, rngs=RNGS)), flax_adapter
    with pytest.raises(AssignmentError, match=r"Keras's names and layouts of the model's layers \(bn/.+\): "
                                              r"pass layout='keras'"):
        adapter.assign(module, weights)
    adapter.assign(module, weights, layout="keras")


def test_a_depthwise_kernel_converted_as_a_conv_into_keras_is_refused_naming_kind_depthwise(tmp_path):
    """A Flax depthwise Conv's file converted to Keras without ``--kind`` holds a Conv's kernel
    ``[h, w, 1, C]`` (the conversion's caution said so, then); assigning it into Keras's
    ``DepthwiseConv2D`` said only "shapes differ"."""
    images = np.random.default_rng(0).normal(size=(2, 6, 5, 3)).astype("float32")
    flax_module = nnx.Conv(3, 3, (3, 2), padding="VALID", feature_group_count=3, rngs=nnx.Rngs(1))
    flax_module.bias.value = np.random.default_rng(1).normal(size=3).astype("float32")
    expected = np.asarray(flax_module(images))
    ws.save(tmp_path / "flax.npz", {f"dw/{key}": value for key, value in flax_adapter.export(flax_module).items()})
    model = keras.Sequential([keras.Input(images.shape[1:]), keras.layers.DepthwiseConv2D((3, 2), name="dw")])
    runner = CliRunner()
    convert = ["convert", str(tmp_path / "flax.npz"), str(tmp_path / "keras.npz"), "--layout", "flax-to-keras"]
    assert runner.invoke(app, convert).exit_code == 0
    with pytest.raises(AssignmentError, match=r"shapes differ; the value is a depthwise kernel converted as a "
                                              r"Conv's of one input channel: convert the file again with --kind"):
        tf2.assign(model, tmp_path / "keras.npz")
    assert runner.invoke(app, [*convert, "--kind", "dw=depthwise"]).exit_code == 0
    tf2.assign(model, tmp_path / "keras.npz")
    np.testing.assert_allclose(model.predict(images, verbose=0), expected, atol=1e-5)
