"""The one allocator of aligned memory for bytes read from a file.

Formats that align their tensors in the file (npz, safetensors: :data:`ALIGNMENT`) expect the
arrays made from them to be aligned in memory too, so frameworks adopt them without a copy.
Whatever reads bytes into fresh memory (a ``pread``, a ranged GET, an assign's private copy)
asks :func:`aligned_array` for it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ALIGNMENT", "aligned_array", "aligned_buffer", "memory_owner"]

#: the boundary tensor data is aligned to, in the file and in memory read from it
ALIGNMENT = 64


def aligned_array(length: int, offset: int = 0) -> np.ndarray:
    """``length`` fresh bytes whose address is ``offset`` modulo :data:`ALIGNMENT`.

    Bytes read from file offset ``offset`` land where an aligned tensor in the file is aligned
    in memory; ``offset=0`` gives memory aligned outright.
    """
    raw = np.empty(length + ALIGNMENT, np.uint8)
    shift = (offset - raw.ctypes.data) % ALIGNMENT
    return raw[shift : shift + length]


def aligned_buffer(length: int, offset: int = 0) -> memoryview:
    """:func:`aligned_array` as a writable byte view, for ``readinto``-style fills."""
    return aligned_array(length, offset).data.cast("B")


def memory_owner(array: np.ndarray) -> Any:
    """The object that owns ``array``'s memory, past every view and buffer export: whoever keeps
    it keeps all of that memory alive (a buffer this module allocated, a file's map)."""
    owner: Any = array
    while True:
        if isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        elif isinstance(owner, memoryview):
            owner = owner.obj
        else:
            return owner
