"""CRC collisions, made to order: what shows that a checksum cannot decide "unchanged"."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np


def forge_crc32_collision(original: np.ndarray, changed_first: float) -> np.ndarray:
    """A float32 array unlike ``original`` (its first element ``changed_first``, its last four
    bytes computed) whose CRC-32 equals ``original``'s."""
    return _forge(original, changed_first, zlib.crc32, 32)


def forge_crc32_crc64_collision(original: np.ndarray, changed_first: float) -> np.ndarray:
    """A float32 array unlike ``original`` (its first element ``changed_first``, its last twelve
    bytes computed) whose CRC-32 and CRC-64/XZ both equal ``original``'s: one sharded band's
    change digest (a piece stored whole in one block) kept by 12 chosen bytes."""
    from weightstore.core import checksums

    def both(raw: bytes) -> int:
        return zlib.crc32(raw) | (checksums.crc64(memoryview(raw)) or 0) << 32

    return _forge(original, changed_first, both, 96)


def _forge(original: np.ndarray, changed_first: float, crc: Callable[[bytes], int], bits: int) -> np.ndarray:
    """The array ``original`` with its first element ``changed_first`` and its last ``bits``
    bits chosen so that ``crc`` of it is ``crc`` of ``original``.

    A CRC is affine over GF(2): for messages of one length, the CRC of the last bits' changes
    is a linear map of them (invertible for these), so solving it for the CRC wanted is
    Gaussian elimination.
    """
    forged = original.astype(np.float32).copy()
    forged.flat[0] = changed_first
    raw = bytearray(forged.tobytes())
    size = bits // 8
    target = crc(original.tobytes())
    raw[-size:] = bytes(size)
    base = crc(bytes(raw))
    columns = []
    for bit in range(bits):
        probe = bytearray(raw)
        probe[-size + bit // 8] ^= 1 << (bit % 8)
        columns.append(crc(bytes(probe)) ^ base)
    # an XOR basis of the columns, each by its highest bit, with the bits of x that make it
    basis: dict[int, tuple[int, int]] = {}
    for bit, column in enumerate(columns):
        value, combo = column, 1 << bit
        for high in range(bits - 1, -1, -1):
            if value >> high & 1:
                if high not in basis:
                    basis[high] = (value, combo)
                    break
                value, combo = value ^ basis[high][0], combo ^ basis[high][1]
    want, chosen = target ^ base, 0
    for high in range(bits - 1, -1, -1):
        if want >> high & 1:
            want, chosen = want ^ basis[high][0], chosen ^ basis[high][1]
    assert want == 0
    for bit in range(bits):
        if chosen >> bit & 1:
            raw[-size + bit // 8] ^= 1 << (bit % 8)
    result = np.frombuffer(bytes(raw), np.float32).reshape(original.shape).copy()
    assert crc(result.tobytes()) == target and result.tobytes() != original.tobytes()
    return result
