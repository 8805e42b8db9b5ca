"""Which variables of a TF1 graph or ``Saver`` checkpoint are training state, not the model.

A checkpoint a training ``Saver`` wrote holds, beside the model, what the optimizer keeps
(Adam's ``w/Adam`` and ``w/Adam_1`` slots, its ``beta1_power``/``beta2_power``) and the step
counter (``global_step``); an inference graph has none of them. They are found the way the
training graph itself says, not from a list of optimizer names:

- **From the graph** (a live session's graph, or the checkpoint's own ``.meta`` MetaGraph):
  every TF training op (``ApplyAdam``, ``ResourceApplyMomentum``, ``ResourceSparseApplyAdagrad``…)
  takes the variable it trains as its first input and the optimizer's state as variables
  among the others, so every variable reaching such an op other than as its first input is
  optimizer state; the variables in the graph's ``global_step`` collection are the step counter.
- **By TF's naming**, for a checkpoint without its ``.meta`` (or a dict or store): TF names a
  slot ``<variable>/<optimizer name>`` (``w/Adam``, ``w/Adam_1``, ``w/Momentum``), so a key
  whose parent is another key and whose last segment is a capitalised name is a slot; Adam's
  own non-slot variables are ``beta1_power`` and ``beta2_power``, the step counter
  ``global_step`` (``tf.compat.v1.train.get_or_create_global_step``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["by_naming", "in_checkpoint", "in_graph", "trains"]

_TRAINING_OP = re.compile(r"(Resource)?(Sparse)?Apply[A-Z]\w*")
_VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable"})
_READS = frozenset({"Identity", "ReadVariableOp", "Enter", "Switch"})  # ops a variable reaches a training op through
_SLOT = re.compile(r"[A-Z]\w*")
_NON_SLOT_NAMES = frozenset({"beta1_power", "beta2_power", "global_step"})
_GLOBAL_STEP = "global_step"  # tf.compat.v1.GraphKeys.GLOBAL_STEP
_VARIABLE_COLLECTIONS = ("variables", "local_variables")  # GraphKeys.GLOBAL_VARIABLES, LOCAL_VARIABLES: VariableDefs


def in_graph(nodes: Mapping[str, tuple[str, list[str]]], global_steps: Iterable[str]) -> set[str]:
    """Names of the training-state variables among ``nodes`` (name -> (op type, input node names))."""
    found = {name for name in global_steps if name in nodes}
    for op_type, inputs in nodes.values():
        if _TRAINING_OP.fullmatch(op_type):
            found.update(variable for variable in (_variable(nodes, name) for name in inputs[1:]) if variable)
    return found


def trains(op_type: str) -> bool:
    """Whether an op of this type is a training op, whose inputs :func:`in_graph` follows: where
    a graph has none, its ops' inputs need not be listed (a few microseconds an op)."""
    return _TRAINING_OP.fullmatch(op_type) is not None


def in_checkpoint(prefix: str, keys: Iterable[str]) -> set[str]:
    """The keys of the TF1 checkpoint at ``prefix`` that are training state: those its ``.meta``
    shows as such, when it has one, and those TF's naming marks (see the module docstring).
    Both, so that a ``.meta`` never makes a checkpoint fail where naming alone would pass: an
    ``ExponentialMovingAverage`` shadow is no training op's input, but named as a slot is."""
    keys = list(keys)
    meta = prefix + ".meta"
    state = _from_meta(meta) if prefix and os.path.isfile(meta) else None
    return by_naming(keys) | ({key for key in keys if key in state} if state is not None else set())


def by_naming(keys: Iterable[str]) -> set[str]:
    """The keys TF's naming marks as optimizer slots, Adam's beta powers or the step counter."""
    keys = set(keys)
    found = set()
    for key in keys:
        parent, _, last = key.rpartition("/")
        if (parent in keys and _SLOT.fullmatch(last)) or last in _NON_SLOT_NAMES:
            found.add(key)
    return found


def _variable(nodes: Mapping[str, tuple[str, list[str]]], name: str) -> str | None:
    """The variable whose value or handle the tensor of node ``name`` is, following reads."""
    for _ in range(len(nodes)):  # bounded: a malformed graph's cycle of reads ends the walk
        node = nodes.get(name)
        if node is None:
            return None
        op_type, inputs = node
        if op_type in _VARIABLE_OPS:
            return name
        if op_type not in _READS or not inputs:
            return None
        name = inputs[0]
    return None


def _from_meta(path: str) -> set[str] | None:
    """The training-state variable names a MetaGraph file records, or None when it does not parse."""
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import meta_graph_pb2

    meta = meta_graph_pb2.MetaGraphDef()
    try:
        with open(path, "rb") as file:
            meta.ParseFromString(file.read())
    except (OSError, DecodeError):
        return None
    nodes = {node.name: (node.op, [_node_name(i) for i in node.input if not i.startswith("^")])
             for node in meta.graph_def.node}
    collection = meta.collection_def.get(_GLOBAL_STEP)
    steps = [_node_name(name) for name in collection.node_list.value] if collection is not None else []
    steps += [_node_name(variable.variable_name) for variable in _variable_defs(meta, _GLOBAL_STEP)]
    whole = {_node_name(variable.variable_name): variable.save_slice_info_def.full_name
             for name in _VARIABLE_COLLECTIONS for variable in _variable_defs(meta, name)
             if variable.save_slice_info_def.full_name}
    # a part of a partitioned variable (w/part_0/Adam) is saved as a slice of the whole (w/Adam)
    return {whole.get(name, name) for name in in_graph(nodes, steps)}


def _variable_defs(meta: Any, collection_name: str) -> Iterator[Any]:
    """The ``VariableDef``s a MetaGraph's collection holds, those that parse."""
    from google.protobuf.message import DecodeError
    from tensorflow.core.framework import variable_pb2

    collection = meta.collection_def.get(collection_name)
    for raw in collection.bytes_list.value if collection is not None else ():
        variable = variable_pb2.VariableDef()
        try:
            variable.ParseFromString(raw)
        except DecodeError:
            continue
        yield variable


def _node_name(tensor: str) -> str:
    """``name:0`` -> ``name``."""
    return tensor.split(":", 1)[0]
