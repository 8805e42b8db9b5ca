"""A value given to a save or an assign, as the numpy array it is written from.

Anything ``np.asarray`` takes is taken so; a PyTorch tensor (a ``state_dict()`` passed as
it is) goes through the PyTorch adapter's own reading, which ``np.asarray`` lacks: it detaches
a tensor that requires grad, copies one off its device, carries bfloat16 and float8 over as
their ml_dtypes kinds, and refuses a meta tensor, which holds no values. The adapter is
imported only for such a value, when PyTorch is already loaded, so the core imports no framework.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["as_numpy"]


def as_numpy(value: Any, key: str = "") -> np.ndarray:
    """``value`` as a numpy array (itself, where it is one); ``key`` names it in a refusal."""
    if type(value) is np.ndarray:
        return value
    if type(value).__module__.partition(".")[0] == "torch" and hasattr(value, "detach"):
        from weightstore.adapters.torch import to_numpy

        return to_numpy(value, key)
    return np.asarray(value)
