"""How an npz member is laid out: the ``.npy`` header of a tensor, where its data starts (64-byte
aligned), the manifest member's name; what the writer writes and the reader checks."""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass

import numpy as np

from weightstore.core.manifest import (
    from_storage,
    storage_dtype,
)
from weightstore.io._buffer import ALIGNMENT

MANIFEST_MEMBER = "__weightstore__.npy"


def header_text(header: bytes) -> str:
    """The dictionary an npy header holds, as its text (cut to 100 characters); "" where the
    header is damaged past reading it (a hostile file's bytes are not echoed raw)."""
    start, end = header.find(b"{"), header.rfind(b"}")
    if not header.startswith(b"\x93NUMPY") or start < 0 or end < start:
        return ""
    text = header[start : end + 1].decode("latin-1")
    if not text.isprintable():
        return ""
    return text if len(text) <= 100 else text[:97] + "..."


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """An npy v1.0 header padded so the data after it starts 64-byte aligned."""
    text = f"{{'descr': {np.lib.format.dtype_to_descr(dtype)!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    total = 10 + len(text) + 1
    text += " " * (-total % ALIGNMENT) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


@dataclass(frozen=True)
class Layout:
    """What a manifest entry says a member holds, byte for byte: the header, then the data."""

    header: bytes
    storage: np.dtype
    logical: np.dtype  # what the stored bytes are viewed as (native order, ml_dtypes by name)
    count: int  # elements
    viewed: bool  # whether ``logical`` differs from ``storage`` (an extra view per read)


@functools.lru_cache(maxsize=4096)  # files hold many tensors of few (dtype, shape) pairs
def layout_of(dtype_name: str, shape: tuple[int, ...]) -> Layout:
    storage = storage_dtype(dtype_name)
    logical = from_storage(np.empty(0, storage), dtype_name).dtype
    return Layout(npy_header(storage, shape), storage, logical, math.prod(shape), logical != storage)
