"""The keys ``tf2.export`` gives a ``.keras`` archive's model, worked out from its ``config.json`` alone.

Keras saves a model's weights where its save walk finds them: ``layers/<snake-cased class>[_<n>]``
for each layer of a Sequential or Functional model (numbered per container, by class), the
layer's attributes below it (``lstm/cell``, ``multi_head_attention/query_dense``), and
``vars/<i>`` for the layer's own trainable then non-trainable variables in creation order.
``tf2.export`` keys the same variables by layer names and variable names (``dense_1/kernel``,
``lstm/lstm_cell/bias``), with Keras's automatic layer names renumbered over the root. Both
follow from the config: the walk is replayed on the JSON, and each built-in layer's variables
are named by :data:`_OWN` below. Nothing is deserialized or run.

The table is trusted only where the file agrees with it: a class it does not know, a layer
whose ``vars`` the file holds more or fewer of, or any tensor the walk does not reach (other
than the optimizer's ``optimizer/vars/<i>``, which ``tf2.export`` keys so too) leaves the whole
file with its own names, and :func:`model_names` says why, as does a layer name that makes no
key. A config that is not what Keras writes (a layer that is no object, no list of layers) is
refused. Layer names become key segments as ``tf2`` makes them (:mod:`._keras_naming`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from weightstore.core.keys import validate_key
from weightstore.errors import FormatError, InvalidKeyError, shown_key
from weightstore.formats._keras_naming import Ranking, automatic, snake_case

#: what the file keeps under its own names, as ``tf2.export(model, optimizer=True)`` keys it too
_OPTIMIZER = "optimizer/"
_MODELS = ("Sequential", "Functional")


class _Unknown(Exception):
    """The table cannot key this file: the reason, for ``ws ls``."""


def _flag(config: dict[str, Any], name: str, default: bool = True) -> bool:
    value = config.get(name, default)
    return bool(value) if value is not None else False


def _kernel_bias(config: dict[str, Any]) -> list[str]:
    return ["kernel", "bias"] if _flag(config, "use_bias") else ["kernel"]


def _cell(config: dict[str, Any]) -> list[str]:
    return ["kernel", "recurrent_kernel", "bias"] if _flag(config, "use_bias") else ["kernel", "recurrent_kernel"]


def _einsum(config: dict[str, Any]) -> list[str]:
    return ["kernel", "bias"] if config.get("bias_axes") else ["kernel"]


def _separable(config: dict[str, Any]) -> list[str]:
    return ["depthwise_kernel", "pointwise_kernel", *(["bias"] if _flag(config, "use_bias") else [])]


def _scale_center(config: dict[str, Any]) -> list[str]:
    return [*(["gamma"] if _flag(config, "scale") else []), *(["beta"] if _flag(config, "center") else [])]


def _batch_norm(config: dict[str, Any]) -> list[str]:
    return [*_scale_center(config), "moving_mean", "moving_variance"]


def _normalization(config: dict[str, Any]) -> list[str]:
    """An adapted ``Normalization`` (no ``mean`` given) holds its statistics as variables."""
    return ["mean", "variance", "count"] if config.get("mean") is None else []


def _none(config: dict[str, Any]) -> list[str]:
    return []


#: class name -> the names of a built-in layer's own variables, in the order Keras saves them
_OWN: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "Dense": _kernel_bias, "EinsumDense": _einsum, "Embedding": lambda config: ["embeddings"],
    **{name: _kernel_bias for name in ("Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose",
                                       "Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D")},
    "SeparableConv1D": _separable, "SeparableConv2D": _separable,
    "BatchNormalization": _batch_norm, "LayerNormalization": _scale_center, "GroupNormalization": _scale_center,
    "Normalization": _normalization, "LSTMCell": _cell,
    "GRUCell": _cell, "SimpleRNNCell": _cell,
    "LayerScale": lambda config: ["variable"],  # keras.applications' ConvNeXt: an unnamed weight
    **{name: _none for name in (
        "InputLayer", "Activation", "ReLU", "LeakyReLU", "ELU", "Softmax", "Dropout",
        "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "GaussianNoise", "GaussianDropout",
        "AlphaDropout", "Flatten", "Reshape", "Permute", "RepeatVector", "Cropping1D", "Cropping2D", "Cropping3D",
        "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "UpSampling1D", "UpSampling2D", "UpSampling3D",
        "MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "AveragePooling1D", "AveragePooling2D", "AveragePooling3D",
        "GlobalMaxPooling1D", "GlobalMaxPooling2D", "GlobalMaxPooling3D", "GlobalAveragePooling1D",
        "GlobalAveragePooling2D", "GlobalAveragePooling3D", "Add", "Subtract", "Multiply", "Average", "Maximum",
        "Minimum", "Concatenate", "Dot", "Rescaling", "UnitNormalization", "Identity", "Masking",
        "CustomScaleLayer")},  # the last: keras.applications' InceptionResNetV2
}
#: a recurrent layer's one sublayer: class -> the name its cell gets
_CELLS = {"LSTM": "lstm_cell", "GRU": "gru_cell", "SimpleRNN": "simple_rnn_cell"}
#: MultiHeadAttention's projections, in the order it makes them: (attribute the file names, layer name)
_ATTENTION = (("query_dense", "query"), ("key_dense", "key"), ("value_dense", "value"),
              ("output_dense", "attention_output"))


class _Layer:
    """One layer of the config (or one a built-in layer makes): class, name, parent, and its
    automatic name parsed once (a ``Bidirectional``'s copies alone may carry ``forward_``)."""

    def __init__(self, kind: str, name: str, parent: _Layer | None, *, copy: bool = False):
        self.kind = kind
        self.name = name
        self.parent = parent
        self.automatic = automatic(name, kind, copy=copy)


class _Walk:
    """The config walked as Keras's save walk and ``tf2``'s export walk go: variables in export order."""

    def __init__(self, where: str):
        self.where = where
        self.layers: list[_Layer] = []
        #: (file key, layer, variable name), in the order tf2.export lists them
        self.variables: list[tuple[str, _Layer, str]] = []

    def layer(self, node: Any, file_path: str, parent: _Layer | None, *, copy: bool = False,
              name: str | None = None) -> None:
        kind, config = _class_and_config(node, self.where, file_path)
        own_name = config.get("name") if name is None else name
        if not _builtin(node):
            raise _Unknown(f"its layer {_shown(own_name or kind)} is a {_shown(kind)} {_origin(node)}, "
                           "not one of Keras's built-in layers")
        if not isinstance(own_name, str):
            raise FormatError(f"config.json gives the layer at {file_path or 'the root'} no name", path=self.where,
                              key=file_path or None)
        layer = _Layer(kind, own_name, parent, copy=copy)
        self.layers.append(layer)
        if kind in _MODELS:
            self._container(config, file_path, layer)
        elif kind in _CELLS:
            self._own(f"{kind}Cell", config, f"{file_path}/cell", self._made(f"{kind}Cell", _CELLS[kind], layer))
        elif kind == "Bidirectional":
            self._bidirectional(config, file_path, layer)
        elif kind == "MultiHeadAttention":
            if config.get("use_gate"):
                raise _Unknown(f"its layer {_shown(own_name)} is a gated MultiHeadAttention, which the table does not know")
            for attribute, sub_name in _ATTENTION:
                self._own("EinsumDense", {"bias_axes": _flag(config, "use_bias")}, f"{file_path}/{attribute}",
                          self._made("EinsumDense", sub_name, layer))
        elif kind in _OWN:
            if config.get("lora_rank") or _quantized(config):
                raise _Unknown(f"its layer {_shown(own_name)} is quantized or LoRA-enabled, which the table does not know")
            self._own(kind, config, file_path, layer)
        else:
            raise _Unknown(f"its layer {_shown(own_name)} is a {_shown(kind)}, which the table of Keras's layers does not cover")

    def _made(self, kind: str, name: str, parent: _Layer) -> _Layer:
        """A layer a built-in layer makes itself (an LSTM's cell), which its config does not list."""
        layer = _Layer(kind, name, parent)
        self.layers.append(layer)
        return layer

    def _own(self, kind: str, config: dict[str, Any], file_path: str, layer: _Layer) -> None:
        for i, variable in enumerate(_OWN[kind](config)):
            self.variables.append((f"{file_path}/vars/{i}".lstrip("/"), layer, variable))

    def _container(self, config: dict[str, Any], file_path: str, layer: _Layer) -> None:
        layers = config.get("layers")
        if not isinstance(layers, list):
            raise FormatError(f"config.json gives model {layer.name!r} no list of layers", path=self.where,
                              key=file_path or None)
        used: dict[str, int] = {}
        for node in layers:
            kind = _class_and_config(node, self.where, file_path)[0]
            if kind == "InputLayer":  # Sequential.layers and Functional.layers leave them out
                continue
            stem = snake_case(kind)
            used[stem] = used.get(stem, -1) + 1
            saved = f"{stem}_{used[stem]}" if used[stem] else stem
            self.layer(node, f"{file_path}/layers/{saved}", layer)

    def _bidirectional(self, config: dict[str, Any], file_path: str, layer: _Layer) -> None:
        """Its two copies, named as ``Bidirectional`` names them: ``forward_<name>``, and the
        backward layer's own name where the config has one (Keras writes it), else ``backward_<name>``."""
        forward, backward = config.get("layer"), config.get("backward_layer")
        for attribute, node, prefix in (("forward_layer", forward, "forward_"),
                                        ("backward_layer", backward or forward, "" if backward else "backward_")):
            inner = _class_and_config(node, self.where, file_path)[1].get("name")
            if not isinstance(inner, str):
                raise FormatError("config.json gives a Bidirectional's layer no name", path=self.where, key=file_path)
            self.layer(node, f"{file_path}/{attribute}", layer, copy=True,
                       name=prefix + inner.removeprefix(prefix) if prefix else inner)


def _origin(node: dict[str, Any]) -> str:
    """Where a layer's class comes from, as its config says: its module, or a script's own class,
    whose module (``__main__``) Keras writes as null."""
    module = node.get("module")
    return "defined in a script (__main__)" if module is None else f"from {_shown(module)}"


def _shown(value: Any) -> str:
    """A name from the config as a note shows it: escaped (``ws ls`` prints notes to a terminal) and bounded."""
    return shown_key(value) if isinstance(value, str) else repr(value)[:80]


def _class_and_config(node: Any, where: str, file_path: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(node, dict) or not isinstance(node.get("class_name"), str) \
            or not isinstance(node.get("config"), dict):
        raise FormatError("config.json describes a layer that is not an object with a class_name and a config",
                          path=where, key=file_path or None)
    return node["class_name"], node["config"]


def _builtin(node: dict[str, Any]) -> bool:
    """Whether Keras itself defines the class (a registered class of the user's may share its name)."""
    module = node.get("module")
    return (node.get("registered_name") in (None, node["class_name"]) and isinstance(module, str)
            and (module == "keras" or module.startswith("keras.")))


def _quantized(config: dict[str, Any]) -> bool:
    """Whether the layer's dtype policy is a quantized one, in any of the JSON shapes Keras writes:
    a policy name (``int8_from_float32``) or, from Keras 3.15, a ``QuantizedDTypePolicy`` (or
    ``QuantizedFloat8DTypePolicy``) whose config holds ``mode`` and ``source_name`` and no name."""
    policy = config.get("dtype")
    if not isinstance(policy, dict):
        return str(policy).startswith(("int", "float8"))
    inner = policy.get("config")
    if str(policy.get("class_name")).startswith("Quantized") or isinstance(inner, dict) and "mode" in inner:
        return True
    return isinstance(inner, dict) and str(inner.get("name")).startswith(("int", "float8"))


def _segments(walk: _Walk) -> dict[int, str]:
    """Layer id -> its key segment, as ``tf2`` names it: automatic names ranked over the root,
    then siblings that share a segment told apart."""
    ranking = Ranking(layer.automatic for layer in walk.layers)
    siblings: dict[int, list[_Layer]] = {}
    for layer in walk.layers:
        siblings.setdefault(id(layer.parent), []).append(layer)
    segments = {}
    for group in siblings.values():
        for layer, segment in zip(group, ranking.segments((layer.name, layer.automatic) for layer in group),
                                  strict=True):
            segments[id(layer)] = segment
    return segments


def _key(layer: _Layer, variable: str, segments: dict[int, str]) -> str:
    parts = [variable]
    node: _Layer | None = layer
    while node is not None and node.parent is not None:  # the root's own name is never part of a key
        parts.append(segments[id(node)])
        node = node.parent
    return "/".join(reversed(parts))


def model_names(config: dict[str, Any], file_keys: list[str], where: str) -> tuple[dict[str, str] | None, str]:
    """Model key -> file key for every tensor of a ``.keras`` archive at ``where``, in export
    order, or ``(None, why)`` where the table cannot key the file (it then keeps its own names).

    Raises:
        FormatError: the config is not one Keras writes (naming the file and where in it).
    """
    walk = _Walk(where)
    try:
        walk.layer(config, "", None)
    except _Unknown as exc:
        return None, str(exc)
    segments = _segments(walk)
    names: dict[str, str] = {}
    for file_key, layer, variable in walk.variables:
        try:
            key = validate_key(_key(layer, variable, segments))
        except InvalidKeyError as exc:
            return None, f"its config names a layer that makes no key ({exc.message})"
        if key in names:  # siblings are told apart, so only names with a '/' in them get here
            return None, f"its config gives {shown_key(names[key])} and {shown_key(file_key)} one key {shown_key(key)}"
        names[key] = file_key
    held = set(file_keys)
    planned = set(names.values())
    if missing := sorted(planned - held):
        return None, f"its config gives {shown_key(missing[0])} a variable the file does not hold"
    if extra := next(_unreached(file_keys, planned), None):
        return None, f"the file holds {shown_key(extra)}, which its config gives no built-in layer"
    state = sorted((key for key in file_keys if key.startswith(_OPTIMIZER)), key=_natural)
    names.update((key, key) for key in state)  # in optimizer.variables order, as tf2.export lists them
    return names, ""


def _natural(key: str) -> list[Any]:
    """``optimizer/vars/2`` before ``optimizer/vars/10``: HDF5 lists names as strings."""
    return [(0, int(part), "") if part.isascii() and part.isdigit() else (1, 0, part) for part in key.split("/")]


def _unreached(file_keys: list[str], planned: set[str]) -> Iterator[str]:
    return (key for key in file_keys if key not in planned and not key.startswith(_OPTIMIZER))
