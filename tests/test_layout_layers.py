"""Layers whose tensors convert together (LSTM, GRU, attention), Embedding, and what a file cannot say.

Each conversion is checked against what the frameworks compute: a Keras layer with random
weights goes into the PyTorch (or Flax) layer with ``layout="keras"`` and both must give the
same output; the module's export with the layout must give the layer back.
"""

from __future__ import annotations

import warnings

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
TOLERANCE = 1e-5


def randomized(layer, shape, seed=0):
    """``layer`` built for ``shape`` with random weights, an input, and its output."""
    rng = np.random.default_rng(seed)
    inputs = rng.normal(size=shape).astype("float32")
    if isinstance(layer, keras.layers.MultiHeadAttention):
        layer(inputs, inputs)
    elif isinstance(layer, keras.layers.Embedding):
        inputs = rng.integers(0, layer.input_dim, size=shape).astype("int32")
        layer(inputs)
    else:
        layer(inputs)
    for var in layer.weights:
        var.assign(rng.normal(size=var.shape).astype("float32") * 0.5)
    output = layer(inputs, inputs) if isinstance(layer, keras.layers.MultiHeadAttention) else layer(inputs)
    return inputs, np.asarray(output)


class Attention(nn.Module):
    def __init__(self, model: int, heads: int, bias: bool = True):
        super().__init__()
        self.attention = nn.MultiheadAttention(model, heads, batch_first=True, bias=bias)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)[0]


class Recurrent(nn.Module):
    def __init__(self, cell: type, features: int, units: int, bias: bool = True):
        super().__init__()
        self.rnn = cell(features, units, batch_first=True, bias=bias)

    def forward(self, x):
        return self.rnn(x)[0]


# name: (Keras layer, input shape, PyTorch module, how Keras's keys sit under the module's scope)
LAYERS = {
    "lstm": (lambda: keras.layers.LSTM(5, return_sequences=True), (2, 4, 3),
             lambda: Recurrent(nn.LSTM, 3, 5), "rnn"),
    "lstm_without_bias": (lambda: keras.layers.LSTM(5, return_sequences=True, use_bias=False), (2, 4, 3),
                          lambda: Recurrent(nn.LSTM, 3, 5, bias=False), "rnn"),
    "gru": (lambda: keras.layers.GRU(5, return_sequences=True), (2, 4, 3), lambda: Recurrent(nn.GRU, 3, 5), "rnn"),
    "attention": (lambda: keras.layers.MultiHeadAttention(num_heads=2, key_dim=3), (2, 4, 6),
                  lambda: Attention(6, 2), "attention"),
    "attention_without_bias": (lambda: keras.layers.MultiHeadAttention(num_heads=3, key_dim=2, use_bias=False),
                               (2, 4, 6), lambda: Attention(6, 3, bias=False), "attention"),
    "embedding": (lambda: keras.layers.Embedding(7, 4), (2, 5), lambda: nn.Sequential(nn.Embedding(7, 4)), "0"),
}


def torch_output(module, inputs):
    with torch.no_grad():
        return module.eval()(torch.from_numpy(inputs)).numpy()


@pytest.mark.parametrize("name", LAYERS)
def test_keras_layer_into_torch_computes_the_same_and_exports_back(name):
    make, shape, make_module, scope = LAYERS[name]
    layer = make()
    inputs, expected = randomized(layer, shape)
    weights = tf2.export(layer)
    module = make_module()
    report = torch_adapter.assign(module, weights, layout="keras", scope=scope)
    assert report.ok
    np.testing.assert_allclose(torch_output(module, inputs), expected, atol=TOLERANCE)
    back = torch_adapter.export(module, layout="keras", scope=scope)
    assert sorted(back) == sorted(weights)
    for key, value in weights.items():
        np.testing.assert_allclose(back[key], value, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("gates", [nn.LSTM, nn.GRU])
def test_torch_recurrent_layers_into_keras_and_back_compute_the_same(gates):
    torch.manual_seed(0)
    module = Recurrent(gates, 3, 4)
    for parameter in module.parameters():  # PyTorch's biases random too: LSTM's two are summed for Keras
        nn.init.normal_(parameter)
    inputs = np.random.default_rng(1).normal(size=(2, 5, 3)).astype("float32")
    expected = torch_output(module, inputs)
    weights = torch_adapter.export(module, layout="keras", scope="rnn")
    keras_layer = (keras.layers.LSTM if gates is nn.LSTM else keras.layers.GRU)(4, return_sequences=True)
    keras_layer(inputs)
    assert tf2.assign(keras_layer, weights).ok
    np.testing.assert_allclose(np.asarray(keras_layer(inputs)), expected, atol=TOLERANCE)
    again = Recurrent(gates, 3, 4)
    torch_adapter.assign(again, tf2.export(keras_layer), layout="keras", scope="rnn")
    np.testing.assert_allclose(torch_output(again, inputs), expected, atol=TOLERANCE)


def test_a_gru_with_reset_before_is_refused_naming_the_fix():
    layer = keras.layers.GRU(4, reset_after=False)
    layer(np.zeros((1, 2, 3), np.float32))
    with pytest.raises(AssignmentError, match="reset_after=False") as caught:
        torch_adapter.assign(Recurrent(nn.GRU, 3, 4), tf2.export(layer), layout="keras", scope="rnn")
    assert "gru_cell/bias" in str(caught.value)


def test_attention_from_a_file_needs_its_head_count_from_the_module_or_kind(tmp_path):
    """A file's ``in_proj_weight`` does not say its head count: the layer's four tensors are refused
    together, the reason said once (it was repeated for each tensor, four times in one line), and
    ``--kind attention=attention:2`` says it, converting as the module's own export does."""
    module = Attention(6, 2)
    exported = torch_adapter.export(module, layout="keras")
    assert exported["attention/query/kernel"].shape == (6, 2, 3)
    ws.save(tmp_path / "t.npz", torch_adapter.export(module))
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "t.npz"), str(tmp_path / "k.npz"),
                                      "--layout", "torch-to-keras"])
    assert result.exit_code == 1 and "head count" in result.output and "in_proj_weight" in result.output
    said = " ".join(result.output.split())
    assert said.count("head count") == 1 and "attention/out_proj/weight" in said, said
    assert "--kind SCOPE=attention:HEADS" in said and not (tmp_path / "k.npz").exists()
    convert = ["convert", str(tmp_path / "t.npz"), str(tmp_path / "k.npz"), "--layout", "torch-to-keras", "--kind"]
    result = CliRunner().invoke(app, [*convert, "attention=attention:4"])
    assert result.exit_code == 1 and "is not q, k and v of 4 heads" in result.output
    result = CliRunner().invoke(app, [*convert, "attention=attention"])
    assert result.exit_code == 1 and "attention:HEADS for a multi-head attention layer" in result.output
    result = CliRunner().invoke(app, [*convert, "attention=attention:2"])
    assert result.exit_code == 0, result.output
    converted = ws.load(tmp_path / "k.npz")
    assert sorted(converted) == sorted(exported)
    for key, value in exported.items():
        np.testing.assert_array_equal(converted[key], value)


@pytest.mark.parametrize("flag, refused", [("add_bias_kv", ["attention/bias_k", "attention/bias_v"]),
                                           ("add_zero_attn", ["attention/in_proj_weight", "attention/out_proj/bias"])])
def test_attention_keras_cannot_compute_is_refused_saying_so_both_ways(tmp_path, flag, refused):
    """``MultiheadAttention(add_bias_kv=True)``'s ``bias_k``/``bias_v`` were refused as "no rule
    (add a Rule with Layout.extended)", though no rule can make Keras's MultiHeadAttention append a
    learned key and value; ``add_zero_attn=True`` (no tensor of its own) converted silently into
    a Keras layer that predicts otherwise, and Keras's values went into such a module alike. Each
    is refused, from the module and from its file, naming the flag to port without."""
    module = nn.ModuleDict({"attention": nn.MultiheadAttention(6, 2, batch_first=True, **{flag: True})})
    before = {key: value.clone() for key, value in module.state_dict().items()}
    with pytest.raises(LayoutError) as caught:
        torch_adapter.export(module, layout="keras")
    said = str(caught.value)
    assert all(key in said for key in refused) and f"{flag}=False" in said and "Layout.extended" not in said
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)
    randomized(layer, (2, 4, 6))
    with pytest.raises(LayoutError, match=f"{flag}=False"):
        torch_adapter.assign(module, tf2.export(layer), layout="keras", scope="attention")
    assert all(torch.equal(module.state_dict()[key], value) for key, value in before.items())
    if flag == "add_bias_kv":  # a file of it: its own tensors say what it is
        ws.save(tmp_path / "t.npz", module.state_dict())
        result = run("convert", tmp_path / "t.npz", tmp_path / "k.npz", "--layout", "torch-to-keras",
                     "--kind", "attention=attention:2")
        said = " ".join(result.output.split())
        assert result.exit_code == 1 and "attention/bias_k" in said and "add_bias_kv=False" in said, said


@pytest.mark.parametrize("flag", ["add_bias_kv", "add_zero_attn"])
def test_such_attention_beside_the_layers_assigned_stays_as_it_was_with_strict_false(flag):
    """A module with such attention took a Keras model's other layers with ``strict=False``, the
    attention left as it was, as any variable without a value; that was refused for the attention
    no value went into. Values that do go into it are refused still, ``strict=False`` or not."""
    module = nn.ModuleDict({"attention": nn.MultiheadAttention(6, 2, batch_first=True, **{flag: True}),
                            "head": nn.Linear(6, 3)})
    attention = {key: value.clone() for key, value in module["attention"].state_dict().items()}
    dense = keras.layers.Dense(3)
    randomized(dense, (2, 6))
    values = {f"head/{key}": value for key, value in tf2.export(dense).items()}  # a Keras model's layer "head"
    report = torch_adapter.assign(module, values, layout="keras", strict=False)
    assert sorted(report.assigned) == ["head/bias", "head/weight"]
    np.testing.assert_array_equal(module["head"].weight.detach().numpy(), dense.kernel.numpy().T)
    assert all(torch.equal(module["attention"].state_dict()[key], value) for key, value in attention.items())
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)
    randomized(layer, (2, 4, 6))
    with pytest.raises(LayoutError, match=f"{flag}=False"):
        torch_adapter.assign(module, tf2.export(layer), layout="keras", scope="attention", strict=False)
    assert all(torch.equal(module["attention"].state_dict()[key], value) for key, value in attention.items())


@pytest.mark.parametrize("bias", [True, False])
def test_attention_with_keys_and_values_of_other_widths_converts_both_ways(tmp_path, bias):
    """``nn.MultiheadAttention(8, 2, kdim=4, vdim=6)`` keeps ``q_proj_weight``, ``k_proj_weight``
    and ``v_proj_weight`` apart (no ``in_proj_weight``); they were refused as tensors "no rule"
    covers. They convert to Keras's ``MultiHeadAttention(2, 4)`` fed keys of 4 and values of 6
    (the same outputs), back into the module bit for bit, and from a file with ``--kind``."""
    torch.manual_seed(0)
    module = nn.ModuleDict({"att": nn.MultiheadAttention(8, 2, kdim=4, vdim=6, batch_first=True, bias=bias)}).eval()
    rng = np.random.default_rng(0)
    query, key, value = (rng.normal(size=shape).astype("float32") for shape in ((2, 5, 8), (2, 7, 4), (2, 7, 6)))
    with torch.no_grad():
        expected = module["att"](*map(torch.from_numpy, (query, key, value)), need_weights=False)[0].numpy()
    exported = torch_adapter.export(module, layout="keras")
    assert exported["att/key/kernel"].shape == (4, 2, 4) and exported["att/value/kernel"].shape == (6, 2, 4)
    inputs = [keras.Input((5, 8)), keras.Input((7, 4)), keras.Input((7, 6))]
    model = keras.Model(inputs, keras.layers.MultiHeadAttention(2, 4, use_bias=bias, name="att")(
        inputs[0], inputs[2], key=inputs[1]))
    assert tf2.assign(model, exported).ok
    np.testing.assert_allclose(np.asarray(model([query, key, value])), expected, atol=TOLERANCE)
    again = nn.ModuleDict({"att": nn.MultiheadAttention(8, 2, kdim=4, vdim=6, batch_first=True, bias=bias)})
    assert torch_adapter.assign(again, tf2.export(model), layout="keras").ok
    for name, tensor in module.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name
    ws.save(tmp_path / "t.npz", torch_adapter.export(module))
    result = run("convert", tmp_path / "t.npz", tmp_path / "k.npz", "--layout", "torch-to-keras", "--kind",
                 "att=attention:2")
    assert result.exit_code == 0, result.output
    converted = ws.load(tmp_path / "k.npz")
    assert sorted(converted) == sorted(exported)
    for name, array in exported.items():
        np.testing.assert_array_equal(converted[name], array)


@pytest.mark.parametrize("bias", [True, False])
def test_keras_attention_into_flax_computes_the_same(bias):
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, use_bias=bias)
    inputs, expected = randomized(layer, (2, 4, 6))
    module = nnx.MultiHeadAttention(num_heads=2, in_features=6, qkv_features=6, out_features=6, decode=False,
                                    use_bias=bias, rngs=nnx.Rngs(0))
    assert flax_adapter.assign(module, tf2.export(layer), layout="keras").ok
    np.testing.assert_allclose(np.asarray(module(inputs)), expected, atol=TOLERANCE)
    back = flax_adapter.export(module, layout="keras")
    assert sorted(back) == sorted(tf2.export(layer))


def test_keras_embedding_into_flax_and_back():
    layer = keras.layers.Embedding(7, 4)
    inputs, expected = randomized(layer, (2, 5))
    module = nnx.Embed(7, 4, rngs=nnx.Rngs(0))
    assert flax_adapter.assign(module, tf2.export(layer), layout="keras").ok
    np.testing.assert_allclose(np.asarray(module(inputs)), expected, atol=0)
    assert list(flax_adapter.export(module, layout="keras")) == ["embeddings"]


# -- what a file cannot say ----------------------------------------------------------------------

def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def saved_under_dw(path, layer):
    """``layer``'s weights saved to ``path`` under the scope ``dw``; a batch and its outputs."""
    inputs, expected = randomized(layer, (1, 6, 6, 4))
    ws.save(path, {f"dw/{key}": value for key, value in tf2.export(layer).items()})
    return inputs, expected


def channels_last(conv, inputs):
    """A PyTorch convolution's outputs for channels-last ``inputs``, channels last (Keras's order)."""
    with torch.no_grad():
        return conv(torch.from_numpy(inputs).movedim(-1, 1)).movedim(1, -1).numpy()


def test_a_keras_3_depthwise_kernel_in_a_file_is_refused_until_its_kind_is_given(tmp_path):
    layer = keras.layers.DepthwiseConv2D(3)  # a multiplier of 1: its bias passes for a Conv's too
    inputs, expected = saved_under_dw(tmp_path / "k.npz", layer)
    out = tmp_path / "t.safetensors"
    result = run("convert", tmp_path / "k.npz", out, "--layout", "keras-to-torch")
    assert result.exit_code == 1 and not out.exists()
    assert "dw/kernel:" in result.output and "--kind 'dw=depthwise'" in result.output
    result = run("convert", tmp_path / "k.npz", out, "--layout", "keras-to-torch", "--kind", "dw=depthwise")
    assert result.exit_code == 0, result.output
    module = nn.ModuleDict({"dw": nn.Conv2d(4, 4, 3, groups=4)})
    assert torch_adapter.assign(module, out).ok
    np.testing.assert_allclose(channels_last(module["dw"], inputs), expected, atol=TOLERANCE)
    result = run("convert", tmp_path / "k.npz", out, "--layout", "keras-to-torch", "--kind", "dw=pooling")
    assert result.exit_code == 1 and "unknown layer kind 'pooling'" in result.output
    result = run("convert", tmp_path / "k.npz", out, "--layout", "keras-to-torch", "--kind", "wd=depthwise")
    assert result.exit_code == 2 and "'wd' matches no layer" in result.output and "'dw'" in result.output
    result = run("convert", tmp_path / "k.npz", out, "--kind", "dw=depthwise")  # no --layout: nothing it could say
    assert result.exit_code == 2 and "without --layout nothing is converted" in " ".join(result.output.split())



def test_a_pytorch_depthwise_weight_in_a_file_converts_to_keras_as_its_kind_says(tmp_path):
    """A PyTorch depthwise ``[4, 1, 3, 3]`` weight reads as a one-input-channel Conv's unless
    ``--kind`` says otherwise; ``--kind dw=depthwise`` once still gave the Conv's ``[3, 3, 1, 4]``
    (one group assumed), which no DepthwiseConv2D takes. It gives Keras's ``[3, 3, 4, 1]`` now."""
    conv = nn.Conv2d(4, 4, 3, groups=4)
    with torch.no_grad():
        for tensor in conv.parameters():
            tensor.normal_()
    ws.save(tmp_path / "t.npz", {f"dw/{key}": value for key, value in torch_adapter.export(conv).items()})
    out = tmp_path / "k.npz"
    result = run("convert", tmp_path / "t.npz", out, "--layout", "torch-to-keras", "--kind", "dw=depthwise")
    assert result.exit_code == 0, result.output
    assert ws.load(out)["dw/kernel"].shape == (3, 3, 4, 1)
    model = keras.Sequential([keras.Input((6, 6, 4)), keras.layers.DepthwiseConv2D(3, name="dw")])
    assert tf2.assign(model, out).ok
    inputs = np.random.default_rng(0).normal(size=(1, 6, 6, 4)).astype("float32")
    np.testing.assert_allclose(np.asarray(model(inputs)), channels_last(conv, inputs), atol=TOLERANCE)


def test_a_depthwise_kernel_of_multiplier_2_crosses_files_as_depthwise_2_says_and_is_named_when_it_did_not(tmp_path):
    """A PyTorch depthwise ``Conv2d(3, 6, groups=3)`` holds ``[6, 1, 3, 3]``: 3 channels of
    multiplier 2, or 6 of multiplier 1, as no file tells; ``--kind dw=depthwise`` reads 6 of 1,
    ``[3, 3, 6, 1]``, which Keras's ``DepthwiseConv2D(depth_multiplier=2)`` ``[3, 3, 3, 2]``
    refused saying only "shapes differ". It names the multiplier now, ``--kind dw=depthwise:2``
    converts it, and the Keras layer predicts as the PyTorch one; the other way, a bias-free
    Keras kernel read as a Conv's names ``--kind`` where PyTorch's depthwise weight refuses it."""
    conv = nn.Conv2d(3, 6, 3, groups=3, bias=False)
    with torch.no_grad():
        conv.weight.normal_()
    ws.save(tmp_path / "t.npz", {f"dw/{key}": value for key, value in torch_adapter.export(conv).items()})
    model = keras.Sequential([keras.Input((6, 6, 3)), keras.layers.DepthwiseConv2D(3, depth_multiplier=2,
                                                                                   use_bias=False, name="dw")])
    out = tmp_path / "k.npz"
    result = run("convert", tmp_path / "t.npz", out, "--layout", "torch-to-keras")  # read as a Conv's: cautioned
    assert result.exit_code == 0 and "'dw=depthwise:M' for a depth multiplier M" in " ".join(result.output.split())
    assert run("convert", tmp_path / "t.npz", out, "--layout", "torch-to-keras", "--kind", "dw=depthwise").exit_code == 0
    with pytest.raises(AssignmentError, match=r"shapes differ; the value is a depthwise kernel of multiplier 2 "
                                              r"converted as one of multiplier 1.*--kind SCOPE=depthwise:2"):
        tf2.assign(model, out)
    result = run("convert", tmp_path / "t.npz", out, "--layout", "torch-to-keras", "--kind", "dw=depthwise:2")
    assert result.exit_code == 0, result.output
    assert tf2.assign(model, out).ok
    inputs = np.random.default_rng(0).normal(size=(1, 6, 6, 3)).astype("float32")
    np.testing.assert_allclose(np.asarray(model(inputs)), channels_last(conv, inputs), atol=TOLERANCE)
    result = run("convert", tmp_path / "t.npz", out, "--layout", "torch-to-keras", "--kind", "dw=depthwise:4")
    assert result.exit_code == 1 and "of 6 channels cannot have a multiplier of 4" in " ".join(result.output.split())
    assert run("convert", tmp_path / "t.npz", out, "--layout", "torch-to-keras", "--kind", "dw=conv:2").exit_code == 1
    ws.save(tmp_path / "k.npz", tf2.export(model))  # back: [3, 3, 3, 2] passes for a Conv's kernel
    assert run("convert", tmp_path / "k.npz", tmp_path / "t.npz", "--layout", "keras-to-torch").exit_code == 0
    with pytest.raises(AssignmentError, match=r"shapes differ; the value is a Keras depthwise kernel converted as a "
                                              r"Conv's: convert the file again with --kind SCOPE=depthwise"):
        torch_adapter.assign(nn.ModuleDict({"dw": conv}), tmp_path / "t.npz")


def test_a_pytorch_weight_of_one_input_channel_in_a_file_converts_as_a_conv_s_with_a_caution(tmp_path):
    """A ``[C, 1, kh, kw]`` weight is a Conv's of one input channel (a grayscale first layer) or a
    depthwise Conv's alike; ``ws convert --layout torch-to-keras`` wrote it as a Conv kernel without
    a word. It still does, saying so and naming ``--kind``; a Keras DepthwiseConv2D's shape refuses
    the result, and with ``--kind`` (either kind) or a module at hand nothing is cautioned."""
    rng = np.random.default_rng(3)
    weights = {"dw.weight": rng.normal(size=(4, 1, 3, 3)).astype(np.float32), "dw.bias": np.zeros(4, np.float32),
               "pw.weight": rng.normal(size=(2, 4, 1, 1)).astype(np.float32)}
    ws.save(tmp_path / "t.safetensors", weights)
    out = tmp_path / "k.npz"
    result = run("convert", tmp_path / "t.safetensors", out, "--layout", "torch-to-keras")
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "converted 1 kernel of one input channel as a Conv's" in said and "'dw/weight'" in said, said
    assert "--kind 'dw=depthwise'" in said and "pw" not in said.partition("kernel of")[2]
    assert ws.load(out)["dw/kernel"].shape == (3, 3, 1, 4)
    model = keras.Sequential([keras.Input((6, 6, 4)), keras.layers.DepthwiseConv2D(3, name="dw")])
    before = model.get_layer("dw").kernel.numpy()
    with pytest.raises(AssignmentError, match="dw/kernel"):
        tf2.assign(model, out, include="dw")  # the target's shape decides: not a depthwise kernel
    np.testing.assert_array_equal(model.get_layer("dw").kernel.numpy(), before)
    for kind in ("conv", "depthwise"):  # the last written is the depthwise one
        result = run("convert", tmp_path / "t.safetensors", out, "--layout", "torch-to-keras", "--kind", f"dw={kind}",
                     "--json")
        assert result.exit_code == 0 and '"caution": null' in result.output, result.output
    assert tf2.assign(model, out, include="dw").ok
    with pytest.warns(layout.LayoutWarning, match="'c/kernel'.*kinds=\\{'c': 'depthwise'\\}"):  # Flax's [kh, kw, 1, C]
        layout.convert({"c/kernel": np.ones((3, 3, 1, 4), np.float32)}, "flax-to-keras")
    module = nn.ModuleDict({"dw": nn.Conv2d(4, 4, 3, groups=4), "gray": nn.Conv2d(1, 4, 3)})
    with warnings.catch_warnings():
        warnings.simplefilter("error", layout.LayoutWarning)  # the module says which each is
        exported = torch_adapter.export(module, layout="keras")
    assert exported["dw/kernel"].shape == (3, 3, 4, 1) and exported["gray/kernel"].shape == (3, 3, 1, 4)

def test_a_keras_archive_tells_its_bias_free_depthwise_kernels_by_its_own_model(tmp_path):
    """A bias-free ``[3, 3, 3, 2]`` kernel passes for a Conv's and a DepthwiseConv's alike; a
    ``.keras`` archive's config says which each layer is, so ``ws convert`` needs no ``--kind``."""
    inputs, gray = keras.Input((6, 6, 3)), keras.Input((6, 6, 1))
    depthwise = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, use_bias=False, name="dw")
    conv = keras.layers.Conv2D(2, 3, use_bias=False, name="cv")
    up = keras.layers.Conv2DTranspose(2, 3, use_bias=False, name="up")  # [3, 3, 2, 1]: a depthwise shape too
    model = keras.Model([inputs, gray], [depthwise(inputs), conv(inputs), up(gray)])
    model.save(tmp_path / "m.keras")
    out = tmp_path / "t.safetensors"
    result = run("convert", tmp_path / "m.keras", out, "--layout", "keras-to-torch")
    assert result.exit_code == 0, result.output
    module = nn.ModuleDict({"dw": nn.Conv2d(3, 6, 3, groups=3, bias=False), "cv": nn.Conv2d(3, 2, 3, bias=False),
                            "up": nn.ConvTranspose2d(1, 2, 3, bias=False)})
    assert torch_adapter.assign(module, out).ok
    rng = np.random.default_rng(0)
    images = [rng.random((2, 6, 6, 3)).astype(np.float32), rng.random((2, 6, 6, 1)).astype(np.float32)]
    for name, seen, expected in zip(("dw", "cv", "up"), images[:1] * 2 + images[1:], model(images), strict=True):
        np.testing.assert_allclose(channels_last(module[name], seen), np.asarray(expected), atol=TOLERANCE)
    result = run("convert", tmp_path / "m.keras", out, "--layout", "keras-to-torch", "--kind", "dw=conv")
    assert result.exit_code == 0, result.output  # the user's word wins: a Conv's layout, which a grouped conv refuses
    with pytest.raises(AssignmentError):
        torch_adapter.assign(module, out)


def test_kind_patterns_name_the_layers_of_a_state_dict_as_keys(tmp_path):
    """A state dict saved with ``np.savez`` names its tensors ``fc.weight``; ``--kind`` speaks
    of the layers as the conversion reads them, ``fc``, as the refusal without it says to."""
    np.savez(tmp_path / "sd.npz", **{"fc.weight": np.ones((3, 4), np.float32), "head.weight": np.ones((2, 3), np.float32),
                                     "head.bias": np.zeros(2, np.float32)})
    out = tmp_path / "k.npz"
    result = run("convert", tmp_path / "sd.npz", out, "--layout", "torch-to-keras")
    assert result.exit_code == 1 and "--kind 'fc=dense'" in result.output
    result = run("convert", tmp_path / "sd.npz", out, "--layout", "torch-to-keras", "--kind", "fc=dense")
    assert result.exit_code == 0, result.output
    assert ws.load(out)["fc/kernel"].shape == (4, 3)
    result = run("convert", tmp_path / "sd.npz", out, "--layout", "torch-to-keras", "--kind", "fc.weight=dense")
    assert result.exit_code == 2 and "matches no layer" in result.output


def test_gpt2s_conv1d_weights_in_a_file_are_refused_not_transposed(tmp_path):
    """GPT-2's c_attn/c_proj/c_fc are Hugging Face's Conv1D, whose weight is [in, out] and already
    a Dense kernel; read as a Linear's, the square c_proj was transposed and exit was 0."""
    rng = np.random.default_rng(5)
    weights = {"h.0.attn.c_attn.weight": rng.normal(size=(4, 12)), "h.0.attn.c_attn.bias": rng.normal(size=12),
               "h.0.attn.c_proj.weight": rng.normal(size=(4, 4)), "h.0.attn.c_proj.bias": rng.normal(size=4),
               "h.0.ln_1.weight": np.ones(4), "h.0.ln_1.bias": np.zeros(4)}
    np.savez(tmp_path / "gpt2.npz", **{name: value.astype(np.float32) for name, value in weights.items()})
    out = tmp_path / "k.npz"
    result = run("convert", tmp_path / "gpt2.npz", out, "--layout", "torch-to-keras")
    assert result.exit_code == 1 and "Conv1D" in result.output and not out.exists()
    assert "--kind 'h/0/attn/c_proj=dense'" in result.output and "--kind 'h/*/attn/c_proj=dense'" in result.output
    result = run("convert", tmp_path / "gpt2.npz", out, "--layout", "torch-to-keras", "--kind", "h/*/attn/c_*=dense")
    assert result.exit_code == 0, result.output  # the user's word: Linear layers after all
    np.testing.assert_array_equal(ws.load(out)["h/0/attn/c_proj/kernel"], weights["h.0.attn.c_proj.weight"].T.astype(np.float32))


def test_a_state_dict_converted_the_wrong_way_is_told_the_way(tmp_path):
    """--layout keras-to-torch of a file PyTorch wrote listed "no torch layout rule" for every
    tensor, without a word that the file is PyTorch's already."""
    from safetensors.numpy import save_file

    save_file({"fc.weight": np.ones((3, 4), np.float32), "fc.bias": np.zeros(3, np.float32)}, str(tmp_path / "sd.safetensors"))
    result = run("convert", tmp_path / "sd.safetensors", tmp_path / "out.safetensors", "--layout", "keras-to-torch")
    assert result.exit_code == 1 and "use --layout torch-to-keras" in result.output
    assert run("convert", tmp_path / "sd.safetensors", tmp_path / "k.npz", "--layout", "torch-to-keras").exit_code == 0


def test_a_depthwise_kernel_is_told_by_its_bias_in_a_file(tmp_path):
    """A [3, 3, 4, 2] kernel passes for a Conv's; its bias of 8 (4 channels x 2) is a
    DepthwiseConv's, and a file converted as a Conv's made a state dict no module loads."""
    layer = keras.layers.DepthwiseConv2D(3, depth_multiplier=2)
    inputs, expected = saved_under_dw(tmp_path / "k.npz", layer)
    out = tmp_path / "t.safetensors"
    result = run("convert", tmp_path / "k.npz", out, "--layout", "keras-to-torch")
    assert result.exit_code == 0, result.output
    module = nn.ModuleDict({"dw": nn.Conv2d(4, 8, 3, groups=4)})
    assert torch_adapter.assign(module, out).ok
    np.testing.assert_allclose(channels_last(module["dw"], inputs), expected, atol=TOLERANCE)
    conv = {"c/kernel": np.ones((3, 3, 4, 2), np.float32), "c/bias": np.ones(2, np.float32)}
    assert layout.convert(conv, "keras-to-torch")["c/weight"].shape == (2, 4, 3, 3)  # a Conv's bias: a Conv
    einsum = {"e/kernel": np.ones((16, 2, 8), np.float32), "e/bias": np.ones((2, 8), np.float32)}
    assert layout.convert(einsum, "keras-to-flax")["e/kernel"].shape == (16, 2, 8)  # a bias of two axes: no depthwise
    upsampling = {"up/kernel": np.ones((3, 3, 4, 1), np.float32), "up/bias": np.ones(4, np.float32)}
    with pytest.raises(LayoutError, match="may be a DepthwiseConv's or a Conv's"):  # a ConvTranspose's bias too
        layout.convert(upsampling, "keras-to-torch")


def test_a_bias_free_torch_weight_in_a_file_is_refused_until_its_kind_is_given():
    shapes = {"embed/weight": np.ones((7, 4), np.float32), "fc/weight": np.ones((3, 4), np.float32),
              "fc/bias": np.ones(3, np.float32)}
    with pytest.raises(LayoutError, match="bias-free Linear's or an Embedding's") as caught:
        layout.convert(shapes, "torch-to-keras")
    assert "embed/weight" in str(caught.value) and "fc/weight" not in str(caught.value)
    assert layout.convert(shapes, "torch-to-keras", kinds={"embed": "embedding"})[
        "embed/embeddings"].shape == (7, 4)
    assert layout.convert(shapes, "torch-to-keras", kinds={"embed": "dense"})[
        "embed/kernel"].shape == (4, 7)


def test_a_conv_bias_with_no_target_is_refused_naming_the_fold():
    weights = {"conv/kernel": np.ones((3, 3, 2, 4), np.float32), "conv/bias": np.arange(4, dtype=np.float32),
               "bn/gamma": np.ones(4, np.float32), "bn/beta": np.zeros(4, np.float32),
               "bn/moving_mean": np.full(4, 10, np.float32), "bn/moving_variance": np.ones(4, np.float32)}
    module = nn.ModuleDict({"conv": nn.Conv2d(2, 4, 3, bias=False), "bn": nn.BatchNorm2d(4)})
    with pytest.raises(AssignmentError, match="fold_bias_into_norm") as caught:
        torch_adapter.assign(module, weights, layout="keras")
    assert "conv/bias" in str(caught.value)
    folded = layout.fold_bias_into_norm(weights, "conv", "bn")
    assert "conv/bias" not in folded and folded["bn/moving_mean"].tolist() == [10, 9, 8, 7]
    assert torch_adapter.assign(module, folded, layout="keras").ok
    x = np.random.default_rng(0).normal(size=(1, 2, 5, 5)).astype("float32")
    with_bias = nn.ModuleDict({"conv": nn.Conv2d(2, 4, 3), "bn": nn.BatchNorm2d(4)})
    torch_adapter.assign(with_bias, weights, layout="keras")
    with torch.no_grad():
        a = module.eval()["bn"](module["conv"](torch.from_numpy(x)))
        b = with_bias.eval()["bn"](with_bias["conv"](torch.from_numpy(x)))
    np.testing.assert_allclose(a.numpy(), b.numpy(), atol=TOLERANCE)
