"""Layers whose tensors convert together: LSTM, GRU and multi-head attention.

A :class:`~weightstore.adapters.layout.Rule` converts one tensor by itself. These layers keep
their weights differently *as a set*, so a :class:`LayerRule` takes all of a layer's tensors
at once (keys relative to the layer's scope) and gives the other framework's set:

- **LSTM**: Keras keeps ``lstm_cell/kernel [in, 4u]``, ``recurrent_kernel [u, 4u]`` and one
  ``bias [4u]``; PyTorch keeps ``weight_ih_l0 [4u, in]``, ``weight_hh_l0 [4u, u]`` and two
  biases. Both order the gates input, forget, cell (PyTorch's ``g``), output. Into PyTorch the
  bias is ``bias_ih_l0`` and ``bias_hh_l0`` is zero; into Keras the two are summed (the same
  function, not the same bits: PyTorch -> Keras -> PyTorch moves ``bias_hh`` into ``bias_ih``).
- **GRU**: Keras orders the gates update, reset, candidate (``z, r, h``), PyTorch reset,
  update, new (``r, z, n``); the blocks are swapped. Keras's default ``reset_after=True``
  keeps ``bias [2, 3u]`` (input, recurrent), exactly PyTorch's ``bias_ih_l0``/``bias_hh_l0``,
  so a GRU converts exactly both ways; ``reset_after=False`` (``bias [3u]``) computes another
  function than PyTorch's GRU and is refused.
- **Multi-head attention**: Keras keeps ``query``/``key``/``value`` kernels ``[d, heads,
  head_dim]`` and ``attention_output/kernel [heads, head_dim, d]``; PyTorch's
  ``nn.MultiheadAttention`` packs q, k, v into ``in_proj_weight [3d, d]`` (heads ``head_dim``
  rows apart, in order; with ``kdim``/``vdim`` other than ``d``, apart: ``q_proj_weight``,
  ``k_proj_weight``, ``v_proj_weight``) and keeps ``out_proj`` as a Linear. PyTorch records no head count in
  its tensors: into Keras it comes from the module (``torch.export(..., layout="keras")``), or
  for a file from ``kinds=`` (``ws convert --kind SCOPE=attention:HEADS``). Flax NNX's ``MultiHeadAttention`` keeps Keras's layout, naming the
  output projection ``out``.

Only single-layer, one-direction PyTorch RNNs (``_l0``, no ``_reverse``, no ``proj_size``)
have rules; other tensors stay for the per-tensor rules, which refuse them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

Arrays = Mapping[str, np.ndarray]
Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class LayerRule:
    """The tensors of one kind of layer, as Keras holds them and as the other framework does.

    ``keras``/``other``: each side's keys relative to the layer's scope; a scope holding all
    of one side's is that layer. ``to_other(arrays, heads)`` and ``to_keras(arrays, heads)``
    convert a whole set (``heads``: the module's head count, 0 when unknown). ``problem(shapes,
    from_keras, heads)`` says why a set cannot convert exactly; empty when it can.
    """

    kind: str
    keras: tuple[str, ...]
    other: tuple[str, ...]
    to_other: Callable[[Arrays, int], dict[str, np.ndarray]]
    to_keras: Callable[[Arrays, int], dict[str, np.ndarray]]
    problem: Callable[[Shapes, bool, int], str]

    def convert(self, arrays: Arrays, from_keras: bool, heads: int) -> dict[str, np.ndarray]:
        return (self.to_other if from_keras else self.to_keras)(arrays, heads)

    def shapes(self, shapes: Shapes, from_keras: bool, heads: int) -> dict[str, tuple[int, ...]]:
        """The converted set's shapes, from zero-filled stand-ins (one byte an element, pages
        the system maps lazily): nothing of the real values is read."""
        stand_ins = {key: np.zeros(shape, np.bool_) for key, shape in shapes.items()}
        return {key: value.shape for key, value in self.convert(stand_ins, from_keras, heads).items()}


def _ranks(shapes: Shapes, ranks: Mapping[str, int]) -> str:
    for key, rank in ranks.items():
        if len(shapes[key]) != rank:
            return f"{key} has rank {len(shapes[key])}, not {rank}"
    return ""


# -- LSTM ----------------------------------------------------------------------------------------

_LSTM_KERAS = ("lstm_cell/kernel", "lstm_cell/recurrent_kernel", "lstm_cell/bias")
_LSTM_TORCH = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")


def _recurrent_problem(gates: int, keras: tuple[str, ...], other: tuple[str, ...]) -> Callable[[Shapes, bool, int], str]:
    def problem(shapes: Shapes, from_keras: bool, heads: int) -> str:
        names = keras if from_keras else other
        kernel, recurrent = shapes[names[0]], shapes[names[1]]
        rank = _ranks(shapes, {names[0]: 2, names[1]: 2})
        if rank:
            return rank
        units = recurrent[0] if from_keras else recurrent[1]
        width = kernel[1] if from_keras else kernel[0]
        if width != gates * units or (recurrent[1] if from_keras else recurrent[0]) != gates * units:
            return f"kernels {list(kernel)} and {list(recurrent)} are not {gates} gates of {units} units"
        return ""
    return problem


def _lstm_to_torch(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    bias = a[_LSTM_KERAS[2]]
    return {"weight_ih_l0": a[_LSTM_KERAS[0]].T, "weight_hh_l0": a[_LSTM_KERAS[1]].T,
            "bias_ih_l0": bias, "bias_hh_l0": np.zeros_like(bias)}


def _lstm_to_keras(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    return {_LSTM_KERAS[0]: a["weight_ih_l0"].T, _LSTM_KERAS[1]: a["weight_hh_l0"].T,
            _LSTM_KERAS[2]: a["bias_ih_l0"] + a["bias_hh_l0"]}


def _lstm_to_torch_unbiased(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    return {"weight_ih_l0": a[_LSTM_KERAS[0]].T, "weight_hh_l0": a[_LSTM_KERAS[1]].T}


def _lstm_to_keras_unbiased(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    return {_LSTM_KERAS[0]: a["weight_ih_l0"].T, _LSTM_KERAS[1]: a["weight_hh_l0"].T}


# -- GRU -----------------------------------------------------------------------------------------

_GRU_KERAS = ("gru_cell/kernel", "gru_cell/recurrent_kernel", "gru_cell/bias")
_GRU_TORCH = ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")


def _swap_first_gates(value: np.ndarray, axis: int) -> np.ndarray:
    """``[z | r | h]`` <-> ``[r | z | n]`` along ``axis``: the first two blocks swapped (its own inverse)."""
    first, second, third = np.split(value, 3, axis=axis)
    return np.concatenate([second, first, third], axis=axis)


def _gru_to_torch(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    bias = a[_GRU_KERAS[2]]
    return {"weight_ih_l0": _swap_first_gates(a[_GRU_KERAS[0]], 1).T,
            "weight_hh_l0": _swap_first_gates(a[_GRU_KERAS[1]], 1).T,
            "bias_ih_l0": _swap_first_gates(bias[0], 0), "bias_hh_l0": _swap_first_gates(bias[1], 0)}


def _gru_to_keras(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    return {_GRU_KERAS[0]: _swap_first_gates(a["weight_ih_l0"].T, 1),
            _GRU_KERAS[1]: _swap_first_gates(a["weight_hh_l0"].T, 1),
            _GRU_KERAS[2]: np.stack([_swap_first_gates(a["bias_ih_l0"], 0), _swap_first_gates(a["bias_hh_l0"], 0)])}


def _gru_problem(shapes: Shapes, from_keras: bool, heads: int) -> str:
    problem = _recurrent_problem(3, _GRU_KERAS, _GRU_TORCH)(shapes, from_keras, heads)
    if problem or not from_keras:
        return problem
    if len(shapes[_GRU_KERAS[2]]) != 2:
        return ("a Keras GRU with reset_after=False (bias [3u]) computes another function than PyTorch's GRU; "
                "rebuild it with reset_after=True (Keras 3's default) and train or convert that")
    return ""


# -- multi-head attention ------------------------------------------------------------------------

_QKV = ("query", "key", "value")
_MHA_KERAS = (*(f"{p}/kernel" for p in _QKV), "attention_output/kernel")
_MHA_KERAS_BIASES = (*(f"{p}/bias" for p in _QKV), "attention_output/bias")
_MHA_TORCH = ("in_proj_weight", "out_proj/weight")
_MHA_TORCH_BIASES = ("in_proj_bias", "out_proj/bias")


def _keras_mha_problem(shapes: Shapes, widths_apart: bool) -> str:
    """What keeps Keras's MultiHeadAttention kernels from PyTorch's: query, key and value of
    ``[d, heads, d / heads]`` (``widths_apart``: key's and value's first axis any width, as
    ``kdim``/``vdim`` make them), and an output that projects back to ``d``."""
    rank = _ranks(shapes, {key: 3 for key in _MHA_KERAS})
    if rank:
        return rank
    query = shapes["query/kernel"]
    model = query[0]
    alike = [shapes[f"{p}/kernel"][1 if widths_apart else 0:] == query[1 if widths_apart else 0:] for p in _QKV]
    if query[1] * query[2] != model or not all(alike):
        shape = "[d, heads, d / heads] (key's and value's first axis any width)" if widths_apart else (
            "one shape [d, heads, d / heads]")
        return (f"PyTorch's MultiheadAttention needs query, key and value kernels of {shape}; these are "
                f"{[list(shapes[f'{p}/kernel']) for p in _QKV]}")
    if shapes["attention_output/kernel"] != (query[1], query[2], model):
        return f"attention_output/kernel {list(shapes['attention_output/kernel'])} does not project back to {model}"
    return ""


def _mha_problem(shapes: Shapes, from_keras: bool, heads: int) -> str:
    if from_keras:
        return _keras_mha_problem(shapes, widths_apart=False)
    if heads < 1:
        return ("PyTorch's in_proj_weight does not record the head count Keras's kernels are split by; "
                "convert from the module (torch.export(module, layout='keras')), which knows it, or say it: "
                "ws convert --kind SCOPE=attention:HEADS")
    packed = shapes["in_proj_weight"]
    if len(packed) != 2 or packed[0] != 3 * packed[1] or packed[1] % heads:
        return f"in_proj_weight {list(packed)} is not q, k and v of {heads} heads"
    return ""


def _mha_to_torch(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    model = a["query/kernel"].shape[0]
    out = {"in_proj_weight": np.concatenate([a[f"{p}/kernel"].reshape(model, -1).T for p in _QKV]),
           "out_proj/weight": a["attention_output/kernel"].reshape(-1, model).T}
    if "query/bias" in a:
        out["in_proj_bias"] = np.concatenate([a[f"{p}/bias"].reshape(-1) for p in _QKV])
        out["out_proj/bias"] = a["attention_output/bias"]
    return out


def _mha_to_keras(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    return _projections_to_keras(a, np.split(a["in_proj_weight"], 3), heads)


def _projections_to_keras(a: Arrays, projections: list[np.ndarray], heads: int) -> dict[str, np.ndarray]:
    """Keras's query, key and value kernels (and biases, output) from PyTorch's q, k and v
    projections (``[d, d]``, or ``[d, kdim]`` for a key of another width): one per head."""
    model = a["out_proj/weight"].shape[0]
    head_dim = model // heads
    out = {f"{p}/kernel": part.T.reshape(-1, heads, head_dim) for p, part in zip(_QKV, projections, strict=True)}
    out["attention_output/kernel"] = a["out_proj/weight"].T.reshape(heads, head_dim, model)
    if "in_proj_bias" in a:
        out.update({f"{p}/bias": part.reshape(heads, head_dim)
                    for p, part in zip(_QKV, np.split(a["in_proj_bias"], 3), strict=True)})
        out["attention_output/bias"] = a["out_proj/bias"]
    return out


#: ``nn.MultiheadAttention(..., kdim=, vdim=)`` of key or value inputs of another width than the
#: query's keeps q, k and v apart: ``q_proj_weight [d, d]``, ``k_proj_weight [d, kdim]``, ``v_proj_weight [d, vdim]``
_MHA_TORCH_APART = ("q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj/weight")


def _mha_apart_problem(shapes: Shapes, from_keras: bool, heads: int) -> str:
    if from_keras:
        return _keras_mha_problem(shapes, widths_apart=True)
    if heads < 1:
        return _mha_problem(shapes, from_keras, heads)
    weights = [shapes[key] for key in _MHA_TORCH_APART[:3]]
    model = weights[0][0]
    if any(len(weight) != 2 or weight[0] != model for weight in weights) or weights[0][1] != model or model % heads:
        return f"q_proj_weight, k_proj_weight and v_proj_weight {[list(w) for w in weights]} are not q, k and v of {heads} heads"
    return ""


def _mha_apart_to_torch(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    model = a["query/kernel"].shape[0]
    out = {name: a[f"{p}/kernel"].reshape(a[f"{p}/kernel"].shape[0], model).T
           for p, name in zip(_QKV, _MHA_TORCH_APART[:3], strict=True)}
    out["out_proj/weight"] = a["attention_output/kernel"].reshape(-1, model).T
    if "query/bias" in a:
        out["in_proj_bias"] = np.concatenate([a[f"{p}/bias"].reshape(-1) for p in _QKV])
        out["out_proj/bias"] = a["attention_output/bias"]
    return out


def _mha_apart_to_keras(a: Arrays, heads: int) -> dict[str, np.ndarray]:
    return _projections_to_keras(a, [a[name] for name in _MHA_TORCH_APART[:3]], heads)


def _renamed(pairs: Mapping[str, str]) -> Callable[[Arrays, int], dict[str, np.ndarray]]:
    return lambda a, heads: {pairs[key]: value for key, value in a.items()}


def _flax_mha_problem(shapes: Shapes, from_keras: bool, heads: int) -> str:
    return ""


_MHA_FLAX = (*(f"{p}/kernel" for p in _QKV), "out/kernel")
_MHA_FLAX_BIASES = (*(f"{p}/bias" for p in _QKV), "out/bias")
_KERAS_TO_FLAX_MHA = dict(zip(_MHA_KERAS + _MHA_KERAS_BIASES, _MHA_FLAX + _MHA_FLAX_BIASES, strict=True))

LSTM, GRU, ATTENTION = "lstm", "gru", "attention"

#: the first rule whose whole set a scope holds wins, so the biased forms come first
TORCH_LAYERS = (
    LayerRule(LSTM, _LSTM_KERAS, _LSTM_TORCH, _lstm_to_torch, _lstm_to_keras,
              _recurrent_problem(4, _LSTM_KERAS, _LSTM_TORCH)),
    LayerRule(LSTM, _LSTM_KERAS[:2], _LSTM_TORCH[:2], _lstm_to_torch_unbiased, _lstm_to_keras_unbiased,
              _recurrent_problem(4, _LSTM_KERAS, _LSTM_TORCH)),
    LayerRule(GRU, _GRU_KERAS, _GRU_TORCH, _gru_to_torch, _gru_to_keras, _gru_problem),
    LayerRule(ATTENTION, _MHA_KERAS + _MHA_KERAS_BIASES, _MHA_TORCH + _MHA_TORCH_BIASES, _mha_to_torch,
              _mha_to_keras, _mha_problem),
    LayerRule(ATTENTION, _MHA_KERAS, _MHA_TORCH, _mha_to_torch, _mha_to_keras, _mha_problem),
    LayerRule(ATTENTION, _MHA_KERAS + _MHA_KERAS_BIASES, _MHA_TORCH_APART + _MHA_TORCH_BIASES, _mha_apart_to_torch,
              _mha_apart_to_keras, _mha_apart_problem),
    LayerRule(ATTENTION, _MHA_KERAS, _MHA_TORCH_APART, _mha_apart_to_torch, _mha_apart_to_keras, _mha_apart_problem),
)

FLAX_LAYERS = (
    LayerRule(ATTENTION, _MHA_KERAS + _MHA_KERAS_BIASES, _MHA_FLAX + _MHA_FLAX_BIASES,
              _renamed(_KERAS_TO_FLAX_MHA), _renamed({v: k for k, v in _KERAS_TO_FLAX_MHA.items()}),
              _flax_mha_problem),
    LayerRule(ATTENTION, _MHA_KERAS, _MHA_FLAX, _renamed(_KERAS_TO_FLAX_MHA),
              _renamed({v: k for k, v in _KERAS_TO_FLAX_MHA.items()}), _flax_mha_problem),
)
