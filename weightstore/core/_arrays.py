"""A value given to a save or an assign, as the numpy array it is written from.

Anything ``np.asarray`` takes is taken so; a framework's tensor that needs more than
``np.asarray`` (a PyTorch ``state_dict()`` passed as it is) goes through the adapter of its
framework, named in :data:`CONVERTERS`: PyTorch's detaches a tensor that requires grad, copies
one off its device, carries bfloat16 and float8 over as their ml_dtypes kinds, and refuses a
meta tensor, which holds no values. A CPU tensor's array shares its memory, as ``np.asarray``
shares a numpy array's, so a save converts one tensor at a time and holds no copy of the model.

The table is the core's one extension point towards the adapters: the core names no adapter
in an import, and loads the one a value needs only when such a value arrives (its framework
is then loaded already).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from weightstore.errors import UnsupportedDTypeError

__all__ = ["as_numpy", "declared_dtype", "CONVERTERS"]

#: a framework's top-level module -> the module converting its tensors, which provides
#: ``to_numpy(value, key, copy=)`` and ``numpy_dtype(value, key)``
CONVERTERS = {"torch": "weightstore.adapters.torch"}


def as_numpy(value: Any, key: str = "") -> np.ndarray:
    """``value`` as a numpy array (itself, where it is one); ``key`` names it in a refusal."""
    if type(value) is np.ndarray:
        return value
    converter = _converter(value)
    if converter is not None:
        return converter.to_numpy(value, key, copy=False)
    if np.ma.is_masked(value):  # np.asarray would keep the placeholders under the mask as weights
        raise UnsupportedDTypeError("is a masked array with masked values, which no weight file can mark; "
                                    "fill them first (value.filled(...))", key=key or None)
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as exc:  # a ragged list, an object numpy cannot make an array of
        raise UnsupportedDTypeError(f"is no array ({type(value).__name__} numpy cannot convert: {exc})",
                                    key=key or None) from None


def declared_dtype(value: Any, key: str = "") -> np.dtype | None:
    """The numpy dtype an array-like states without being converted, or ``None``.

    A TF tensor (``dtype.as_numpy_dtype``), a PyTorch tensor (through its adapter) or any
    ``__array__`` object with a numpy ``dtype`` is checked now and converted only when written,
    one at a time: a trainer's snapshot or state dict is not copied to numpy all at once.
    """
    if isinstance(value, np.ma.MaskedArray):
        return None  # converted at once, so that one with masked values is refused before any write
    if isinstance(value, np.ndarray):
        return value.dtype
    converter = _converter(value)
    if converter is not None:
        return converter.numpy_dtype(value, key)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "__array__"):
        return None
    try:
        return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    except (TypeError, ValueError):
        return None


def _converter(value: Any) -> Any:
    """The module converting ``value``'s framework's tensors, or ``None`` for anything else."""
    framework = type(value).__module__.partition(".")[0]
    if framework in CONVERTERS and hasattr(value, "detach"):
        return importlib.import_module(CONVERTERS[framework])
    return None
