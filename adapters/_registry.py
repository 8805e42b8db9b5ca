"""Which adapter takes an object: one table, keyed on the object's framework.

An object's framework is the module its type, or one of its bases, is defined in: a Keras
model subclass written in ``my_project.models`` is Keras's because ``keras.Model`` is among its
bases. :data:`ADAPTERS` maps a module prefix (a framework's top-level package, or a deeper module
where one package holds the objects of two adapters: TensorFlow's sessions are TF1's, its other
objects TF2's) to the adapter module's name; the longest prefix that any class of the type's
MRO matches decides, so a session wrapper TensorFlow defines elsewhere (``tf_debug``'s) is TF1's
through its base ``SessionInterface``. A dict, list or tuple has no framework of its
own: its first leaf decides (a dict of TF variables is ``tf2``'s, a Flax Linen parameter tree
``flax``'s). The adapter is imported only when an object of its framework arrives, when that
framework is loaded already; as the core's ``CONVERTERS`` and the formats' table, the table
names modules by string.

An adapter module offers ``export``, ``export_pieces``, ``assign``, ``variables`` and ``forget``
(a follower needs ``assign`` and ``variables``: see
:class:`~weightstore.adapters.serving.follower.Follower`), and sets ``ASSIGN_READS_REGIONS = True``
when its ``assign`` reads only regions of a sharded version's tensors (a TF1 partitioned
variable's parts, a DTensor's or a JAX array's shards), so a follower stages just those. One of
another framework is one module and one :func:`register` line.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from weightstore.core.limits import MAX_TREE_DEPTH
from weightstore.errors import UnsupportedTargetError

__all__ = ["ADAPTERS", "adapter_for", "register"]

#: module prefix of a framework's classes -> the adapter module taking its objects
ADAPTERS: dict[str, str] = {
    "tensorflow": "weightstore.adapters.tf2",
    "keras": "weightstore.adapters.tf2",
    # a session (and whatever subclasses its SessionInterface), and the MonitoredSession family
    # wrapping one, hold a TF1 graph
    "tensorflow.python.client.session": "weightstore.adapters.tf1",
    "tensorflow.python.training.monitored_session": "weightstore.adapters.tf1",
    "torch": "weightstore.adapters.torch",
    "flax": "weightstore.adapters.flax",
    "jax": "weightstore.adapters.flax",  # a parameter tree's leaves: jax.Array, whose type lives in jaxlib
    "jaxlib": "weightstore.adapters.flax",
}
_CONTAINERS = (Mapping, list, tuple)
_EMPTY = object()


def register(framework: str, module: str) -> None:
    """Let :func:`adapter_for` give the adapter module named ``module`` for objects of ``framework``.

    ``framework`` is a module prefix, usually the framework's top-level package (``"mlx"``);
    an entry already there for it is replaced. The module is imported when first needed.

    Example::

        weightstore.adapters.register("mlx", "my_project.mlx_adapter")
    """
    ADAPTERS[framework] = module


def adapter_for(obj: Any) -> ModuleType:
    """The adapter module (``weightstore.adapters.tf1``, ``tf2``, ``torch``, ``flax`` or one
    :func:`register` added) that takes ``obj``, by ``obj``'s framework (see the module docstring).

    Raises:
        UnsupportedTargetError: ``obj`` (or a container's first leaf) is of no framework in
            :data:`ADAPTERS`, or is an empty container, which names no framework.

    Example::

        adapter_for(keras_model).assign(keras_model, "model.npz")
    """
    leaf = obj
    for _ in range(MAX_TREE_DEPTH):
        name = _adapter_of_type(type(leaf))
        if name is not None:
            return importlib.import_module(name)
        if not isinstance(leaf, _CONTAINERS):
            break
        values = iter(leaf.values() if isinstance(leaf, Mapping) else leaf)
        leaf = next(values, _EMPTY)
        if leaf is _EMPTY:
            raise UnsupportedTargetError(f"an empty {type(obj).__name__} holds no variables, so no adapter takes it")
    raise UnsupportedTargetError(f"no adapter takes an object of type {_qualified(type(obj))}"
                                 + (f" (holding {_qualified(type(leaf))})" if leaf is not obj else "")
                                 + ": the adapters take a tf.compat.v1.Session (tf1); a Keras model or layer, a "
                                   "tf.Module or TF variables (tf2); a torch.nn.Module (torch); a Flax NNX module "
                                   "or parameter tree (flax); another framework's is added with "
                                   "weightstore.adapters.register")


def _adapter_of_type(kind: type) -> str | None:
    """The adapter module named by the longest prefix any class of ``kind``'s MRO matches."""
    matched = [prefix for cls in kind.__mro__ for prefix in ADAPTERS
               if cls.__module__ == prefix or cls.__module__.startswith(prefix + ".")]
    return ADAPTERS[max(matched, key=len)] if matched else None


def _qualified(kind: type) -> str:
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
