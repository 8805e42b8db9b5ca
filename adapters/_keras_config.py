"""A Keras model rebuilt from a ``.keras`` archive's ``config.json``, only ever in Keras's safe mode.

The CLI has no model object to key a Keras file or TF2 checkpoint by (``tf2.load(model, path)``
needs one), so it builds the model the archive describes. A config is data from a file, and
deserializing it may run code: a ``Lambda`` layer's marshalled Python, or any class a custom
object registry resolves. So it is deserialized with ``safe_mode=True`` (Keras refuses
lambdas), with no custom objects, after a check of our own that refuses lambdas with a clear
message before Keras is asked; classes outside Keras itself are not found and the model is
refused. The training setup (``compile_config``: optimizer, losses, metrics) is dropped unread:
keying weights needs the layers only.

Nor is the config ever used to allocate: the model is built in a Keras ``StatelessScope`` that
leaves its variables uninitialized (their paths, shapes and dtypes are all keying needs), so a
1.4 KB archive whose ``Dense`` claims a billion units builds in no memory, where it took
gigabytes; the weights, read from the archive, are bounded by the bytes that hold them.
"""

from __future__ import annotations

from typing import Any

from weightstore.errors import FormatError
from weightstore.formats import keras_file

_LAMBDA = "__lambda__"  # the class_name Keras gives serialized Python functions


def model_from_archive(path: str) -> Any:
    """The model of the ``.keras`` archive at ``path``, built but without its weights."""
    import keras

    config = keras_file.read_config(path)
    if _mentions_lambda(config):
        raise FormatError("its model has a Lambda layer or other Python code, which ws never runs; "
                          "load the weights in Python with tf2.load(model, path) instead", path=path)
    config = {name: value for name, value in config.items() if name != "compile_config"}
    try:
        with keras.StatelessScope(initialize_variables=False):  # shapes without memory behind them
            model = keras.saving.deserialize_keras_object(config, safe_mode=True)
    except Exception as exc:  # Keras raises TypeError, ValueError, KeyError… for configs it cannot build
        raise FormatError(f"cannot rebuild its model from config.json ({_first_sentence(exc)}); "
                          "ws builds only Keras's own layers, never custom ones: load the weights in Python "
                          "with tf2.load(model, path) instead", path=path) from None
    if not isinstance(model, keras.layers.Layer):
        raise FormatError(f"config.json describes a {type(model).__name__}, not a Keras model", path=path)
    return model


def _mentions_lambda(value: Any) -> bool:
    """Whether a serialized Python function appears anywhere in the JSON ``value``."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if item.get("class_name") in (_LAMBDA, "Lambda"):
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _first_sentence(exc: BaseException) -> str:
    """What failed, in one sentence: Keras wraps a layer's failure in its model's (``Exception
    encountered: …``, innermost last) and goes on to print the whole config."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = text.rsplit("Exception encountered: ", 1)[-1]
    return text.split(". ")[0].rstrip(".")
